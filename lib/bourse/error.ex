defmodule Bourse.Error do
  @moduledoc """
  The error every `:bourse` call returns (or raises) when it cannot do what was asked.

  Fields:

    * `:type` – what went wrong:
      * `:invalid_parameters` – a malformed key, limit, cost or option; nothing was paid
        (malformed headers of a limited reply given to `observe_response/6`: the reply
        still paused its buckets, and `:retry_after`, `:http_status` and `:stop` say so);
      * `:rate_limit_exceeded` – the wait would exceed the caller's budget, or the
        exchange answered 429/418; `:retry_after` says when to come back.
      * `:unavailable` – the limiter's bucket table could not be reached (the port
        process died, the shared daemon is down or did not answer in time); nothing is
        known to be paid: do not send the request now, try again shortly.
    * `:message` – a human-readable explanation naming what is wrong.
    * `:exchange` – the exchange id (`"binance"`), when known.
    * `:retry_after` – milliseconds to wait before trying again, when known.
    * `:http_status` – the exchange's HTTP status, when the error came from a reply.
    * `:stop` – `true` when retrying is pointless (a ban, an HTTP 418 or a WAF 403): stop
      and alert instead.

  Examples:

      {:ok, _} = Bourse.RateLimiter.start_link(name: MyApp.Limiter)

      {:error, %Bourse.Error{type: :invalid_parameters}} =
        Bourse.RateLimiter.check_rate({"binance", "key"}, %{capacity: -1, refill_per_sec: 1}, 1, MyApp.Limiter)

      Bourse.Error.rate_limited(1_500, exchange: "binance", http_status: 429)
      #=> %Bourse.Error{type: :rate_limit_exceeded, retry_after: 1500, ...}

      raise Bourse.Error.invalid("cost must be a finite number >= 0")
  """

  @type type :: :invalid_parameters | :rate_limit_exceeded | :unavailable | atom()

  @type t :: %__MODULE__{
          type: type(),
          message: String.t() | nil,
          exchange: String.t() | nil,
          retry_after: non_neg_integer() | nil,
          http_status: pos_integer() | nil,
          stop: boolean()
        }

  defexception [:type, :message, :exchange, :retry_after, :http_status, stop: false]

  @doc "An `:invalid_parameters` error with the given message."
  @spec invalid(String.t()) :: t()
  def invalid(message) when is_binary(message),
    do: %__MODULE__{type: :invalid_parameters, message: message}

  @doc "An `:unavailable` error: the bucket table could not be reached, for the reason given."
  @spec unavailable(String.t()) :: t()
  def unavailable(message) when is_binary(message),
    do: %__MODULE__{type: :unavailable, message: message}

  @doc """
  A `:rate_limit_exceeded` error asking to retry after `retry_after_ms` milliseconds.

  Options: `:exchange`, `:http_status`, `:stop` (default `false`) and `:message`
  (default: one built from the other fields).
  """
  @spec rate_limited(non_neg_integer(), keyword()) :: t()
  def rate_limited(retry_after_ms, opts \\ []) do
    error = %__MODULE__{
      type: :rate_limit_exceeded,
      retry_after: retry_after_ms,
      exchange: opts[:exchange],
      http_status: opts[:http_status],
      stop: Keyword.get(opts, :stop, false)
    }

    %{error | message: opts[:message] || message(error)}
  end

  @doc """
  Describes `value` for a message, in bounded size and Elixir syntax: atoms, small
  integers and floats as written; everything else by its type and size (a binary may be
  an API key and is never shown).

      iex> Bourse.Error.describe(:infinity)
      ":infinity"
      iex> Bourse.Error.describe("secret")
      "a binary of 6 bytes"
      iex> Bourse.Error.describe(10 ** 400)
      "an integer of 167 bytes"
  """
  @spec describe(term()) :: String.t()
  def describe(value) when is_atom(value), do: inspect(value)
  def describe(value) when is_float(value), do: inspect(value)

  def describe(value) when is_integer(value) and abs(value) < 1_000_000_000_000_000_000,
    do: Integer.to_string(value)

  def describe(value) when is_integer(value),
    do: "an integer of #{count(byte_size(:binary.encode_unsigned(abs(value))), "byte")}"

  def describe(value) when is_binary(value), do: "a binary of #{count(byte_size(value), "byte")}"

  def describe(value) when is_bitstring(value),
    do: "a bitstring of #{count(bit_size(value), "bit")}"

  def describe([]), do: "[]"
  def describe(value) when is_list(value), do: "a list"
  def describe(value) when is_map(value), do: "a map of #{count(map_size(value), "key")}"
  def describe({}), do: "{}"

  def describe(value) when is_tuple(value),
    do: "a tuple of #{count(tuple_size(value), "element")}"

  def describe(value) when is_pid(value), do: "a pid"
  def describe(value) when is_reference(value), do: "a reference"
  def describe(value) when is_port(value), do: "a port"
  def describe(value) when is_function(value), do: "a function"

  defp count(1, unit), do: "1 #{unit}"
  defp count(n, unit), do: "#{n} #{unit}s"

  @doc """
  A file path as messages show it: itself, or as `inspect/1` writes it when it is not
  UTF-8 or holds control characters (Linux allows any bytes but NUL), so that every
  message is text of one line.
  """
  @spec path(binary()) :: String.t()
  def path(path) when is_binary(path) do
    if String.valid?(path) and not String.match?(path, ~r/[\x00-\x1f\x7f]/),
      do: path,
      else: inspect(path)
  end

  @doc """
  `error` with its `:exchange` set to `exchange` when it has none and `exchange` is an
  exchange id by the core's rule for key parts (UTF-8 text of at most 1024 bytes).
  """
  @spec with_exchange(t(), term()) :: t()
  def with_exchange(%__MODULE__{exchange: nil} = error, exchange) when is_binary(exchange) do
    if Bourse.Native.check_key({exchange, :public}) == :ok,
      do: %{error | exchange: exchange},
      else: error
  end

  def with_exchange(%__MODULE__{} = error, _exchange), do: error

  @impl true
  def message(%__MODULE__{message: message}) when is_binary(message), do: message

  def message(%__MODULE__{} = error) do
    [
      error.exchange && "#{error.exchange}:",
      describe_type(error.type),
      error.http_status && "(HTTP #{error.http_status})",
      error.retry_after && "retry after #{error.retry_after} ms",
      error.stop && "(stop: do not retry)"
    ]
    |> Enum.filter(& &1)
    |> Enum.join(" ")
  end

  defp describe_type(:rate_limit_exceeded), do: "rate limit exceeded"
  defp describe_type(:invalid_parameters), do: "invalid parameters"
  defp describe_type(:unavailable), do: "rate limiter unavailable"
  defp describe_type(type), do: inspect(type)
end
