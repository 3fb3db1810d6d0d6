defmodule Bourse.Testing.HTTP do
  @moduledoc """
  A minimal HTTP GET client on OTP's `:httpc`, for tests and the demo.

  It uses its own `:httpc` profile (`:bourse_testing`), started on first use, and
  answers with the status, the headers as lower-case binary name/value pairs and the body
  as a binary; 4xx and 5xx replies are answers like any other.

      {:ok, 429, headers, _body} = Bourse.Testing.HTTP.get(url, [{"x-weight", "5"}])
      {"retry-after", "1"} = List.keyfind(headers, "retry-after", 0)
  """

  @profile :bourse_testing

  @doc "GETs `url`, sending `headers` (`{name, value}` strings or charlists)."
  @spec get(String.t(), [{String.t() | charlist(), String.t() | charlist()}]) ::
          {:ok, 100..599, [{String.t(), String.t()}], binary()} | {:error, term()}
  def get(url, headers \\ []) do
    request =
      {String.to_charlist(url), for({k, v} <- headers, do: {to_charlist(k), to_charlist(v)})}

    with :ok <- ensure_profile(),
         {:ok, {{_version, status, _reason}, reply_headers, body}} <-
           :httpc.request(
             :get,
             request,
             [timeout: 10_000, connect_timeout: 5_000],
             [body_format: :binary],
             @profile
           ) do
      {:ok, status,
       for({k, v} <- reply_headers, do: {String.downcase(to_string(k)), to_string(v)}), body}
    end
  end

  defp ensure_profile do
    with {:ok, _} <- Application.ensure_all_started(:inets) do
      case :inets.start(:httpc, profile: @profile) do
        {:ok, _} -> :ok
        {:error, {:already_started, _}} -> :ok
        error -> error
      end
    end
  end
end
