defmodule Bourse.Testing.AdapterLoop do
  @moduledoc """
  The request loop an exchange client writes around `Bourse.RateLimiter`, for tests and
  the demo: wait for capacity, send, report the reply (status, headers and body) with
  `Bourse.RateLimiter.observe_response/6`, then retry or return.

      {:ok, body} =
        Bourse.Testing.AdapterLoop.get(url, "binance", api_key,
          %{capacity: 480, refill_per_sec: 72}, axis: "ip", limiter: MyApp.Limiter)

  A 429, or a rate-limit signal in the body (Bybit's `retCode` 10006 on an HTTP 200, ...),
  without `stop` is retried, at most `:tries` attempts in all: the limiter has paused the
  credential's buckets, so the next `wait_for_capacity/5` waits out `Retry-After` (or the
  wait the reply names, or the backoff). Everything else ends the loop: a ban or any other
  `stop: true`, a 418, a status other than 2xx (401, 503, ...: a 5xx on an order leaves
  its outcome unknown, so look it up before sending it again), a 2xx that is not JSON,
  and connection errors.
  """

  alias Bourse.{Error, RateLimiter}
  alias Bourse.Testing.HTTP

  @type result ::
          {:ok, binary()}
          | {:error, Error.t()}
          | {:error, {:http, pos_integer(), binary()}}
          | {:error, {:not_json, pos_integer()}}
          | {:error, term()}

  @doc """
  GETs `url` for `credential` of `exchange`, spending `:cost` (default 1) from the bucket
  `{exchange, credential, axis}` defined by `limit`.

  Options: `:axis` (default `"request"`), `:cost`, `:tries` (default 4), `:limiter`
  (default `Bourse.RateLimiter`).
  """
  @spec get(String.t(), String.t(), String.t() | :public, RateLimiter.rate_limit(), keyword()) ::
          result()
  def get(url, exchange, credential, limit, opts \\ []) do
    request = %{
      url: url,
      exchange: exchange,
      credential: credential,
      key: {exchange, credential, Keyword.get(opts, :axis, "request")},
      limit: limit,
      cost: Keyword.get(opts, :cost, 1),
      limiter: Keyword.get(opts, :limiter, RateLimiter)
    }

    attempt(request, Keyword.get(opts, :tries, 4))
  end

  defp attempt(request, tries_left) do
    %{exchange: exchange, credential: credential, limiter: limiter} = request

    with :ok <- RateLimiter.wait_for_capacity(request.key, request.limit, request.cost, limiter),
         {:ok, status, headers, body} <- HTTP.get(request.url),
         :ok <-
           RateLimiter.observe_response(exchange, credential, status, headers, limiter, body: body) do
      result(status, headers, body)
    else
      {:error, %Error{type: :rate_limit_exceeded, stop: false}} when tries_left > 1 ->
        attempt(request, tries_left - 1)

      error ->
        error
    end
  end

  defp result(status, headers, body) when status in 200..299 do
    case List.keyfind(headers, "content-type", 0) do
      {_, "application/json" <> _} -> {:ok, body}
      _ -> {:error, {:not_json, status}}
    end
  end

  defp result(status, _headers, body), do: {:error, {:http, status, body}}
end
