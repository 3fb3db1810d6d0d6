defmodule Bourse.RateLimiter.Limits do
  @moduledoc """
  Bucket definitions sized from an exchange's published limits.

  A fixed window of `window` can receive a full bucket plus one window of refill, so a
  bucket stays under an exchange limit `L` per window only when

      capacity + refill_per_sec * window <= share * L

  `share` (default 0.8) keeps the rest of `L` for other programs on the same IP or
  account and for requests that cross a window boundary in flight; `burst` (default 0.1)
  is the part of that ceiling available at once:

      ceiling        = share * L
      capacity       = burst * ceiling
      refill_per_sec = (ceiling - capacity) / window

      Limits.size(6000, 60_000)
      #=> {:ok, %{capacity: 480.0, refill_per_sec: 72.0}}

  The maps returned are limits for `Bourse.RateLimiter` calls.
  """

  alias Bourse.{Error, Native}
  alias Bourse.RateLimiter.Options

  @size_options [:share, :burst]

  @type limit :: %{capacity: float(), refill_per_sec: float()}
  @type binance_key :: {type :: String.t(), interval_num :: pos_integer(), interval :: String.t()}

  @interval_ms %{"SECOND" => 1_000, "MINUTE" => 60_000, "HOUR" => 3_600_000, "DAY" => 86_400_000}
  # Windows above this are not limits anyone publishes; they would overflow doubles.
  @max_window_ms 1.0e15

  @doc """
  Sizes a bucket for an exchange limit of `limit` cost per `window_ms`.

  Options: `:share` of the limit to use, in `(0, 1]` (default 0.8), and `:burst`, the
  part of that share available at once, in `(0, 1)` (default 0.1). The capacity is
  rounded to 12 significant digits to shed float noise (480.0, not
  480.00000000000006), and the refill is then chosen so that the bound above holds
  exactly in floating point. The limit is at most the largest amount a bucket holds
  (1.0e12), and so are the capacity and the refill per second: a bucket returned is one
  every call takes.

      Limits.size(100, 10_000)               #=> {:ok, %{capacity: 8.0, refill_per_sec: 7.2}}
      Limits.size(10, 1_000, share: 1.0, burst: 0.2)
      #=> {:ok, %{capacity: 2.0, refill_per_sec: 8.0}}
      Limits.size(0, 1_000)                  #=> {:error, %Bourse.Error{type: :invalid_parameters}}
  """
  @spec size(number(), number(), keyword()) :: {:ok, limit()} | {:error, Error.t()}
  def size(limit, window_ms, opts \\ []) do
    with :ok <- known_options(opts, @size_options),
         {:ok, %{share: share, burst: burst}} <- sizing(opts) do
      size_checked(limit, window_ms, share, burst)
    end
  end

  @doc """
  The `:share` and `:burst` of `opts` as `size/3` takes them, their defaults filled in, or
  the error `size/3` answers. Other options are left alone.
  """
  @spec sizing(keyword()) :: {:ok, %{share: number(), burst: number()}} | {:error, Error.t()}
  def sizing(opts) do
    {share, burst} = {Keyword.get(opts, :share, 0.8), Keyword.get(opts, :burst, 0.1)}

    cond do
      not (is_number(share) and share > 0 and share <= 1) ->
        invalid("share must be in (0, 1], got #{Error.describe(share)}")

      not (is_number(burst) and burst > 0 and burst < 1) ->
        invalid("burst must be in (0, 1), got #{Error.describe(burst)}")

      true ->
        {:ok, %{share: share, burst: burst}}
    end
  end

  defp size_checked(limit, window_ms, share, burst) do
    cond do
      not positive_amount?(limit) ->
        invalid(
          "limit must be a positive number of at most #{Native.bound(:max_amount)}, " <>
            "got #{Error.describe(limit)}"
        )

      not (is_number(window_ms) and window_ms >= 1 and window_ms <= @max_window_ms) ->
        invalid("window_ms must be a number >= 1, got #{Error.describe(window_ms)}")

      true ->
        do_size(share * limit, burst, window_ms / 1000)
    end
  end

  defp do_size(ceiling, burst, window_s) do
    exact = burst * ceiling
    rounded = round_significant(exact)
    capacity = if rounded < ceiling, do: rounded, else: exact
    refill = fit_refill(capacity, (ceiling - capacity) / window_s, window_s, ceiling)

    if capacity > 0 and refill > 0 do
      within_bounds(%{capacity: capacity, refill_per_sec: refill})
    else
      invalid("limit too small to size a bucket: capacity #{capacity}, refill #{refill}/s")
    end
  end

  # The core's rule for a bucket, as every call applies it.
  defp within_bounds(bucket) do
    case Native.limit_definition(bucket) do
      {:ok, _definition} ->
        {:ok, bucket}

      {:error, message, _exchange} ->
        invalid("limit too large for its window to size a bucket: " <> message)
    end
  end

  defp known_options(opts, known) do
    with {:error, message} <-
           Options.known_options(opts, "option", known, "one of #{inspect(known)}"),
         do: invalid(message)
  end

  defp round_significant(x), do: String.to_float(:erlang.float_to_binary(x, scientific: 11))

  # Steps the refill down one double at a time until the bound survives rounding.
  defp fit_refill(capacity, refill, window_s, ceiling) do
    if refill <= 0 or capacity + refill * window_s <= ceiling do
      refill
    else
      <<bits::64>> = <<refill::float>>
      <<lower::float>> = <<bits - 1::64>>
      fit_refill(capacity, lower, window_s, ceiling)
    end
  end

  @doc """
  One bucket per entry of a Binance `exchangeInfo` reply's `"rateLimits"`, keyed by
  `{rateLimitType, intervalNum, interval}` (never by type alone: Binance publishes two
  `ORDERS` entries), each sized with `size/3` (options as there).

      info = %{
        "rateLimits" => [
          %{"rateLimitType" => "REQUEST_WEIGHT", "interval" => "MINUTE", "intervalNum" => 1, "limit" => 6000},
          %{"rateLimitType" => "ORDERS", "interval" => "SECOND", "intervalNum" => 10, "limit" => 100},
          %{"rateLimitType" => "ORDERS", "interval" => "DAY", "intervalNum" => 1, "limit" => 200_000}
        ]
      }

      Limits.from_binance_exchange_info(info)
      #=> {:ok,
      #     %{
      #       {"REQUEST_WEIGHT", 1, "MINUTE"} => %{capacity: 480.0, refill_per_sec: 72.0},
      #       {"ORDERS", 10, "SECOND"} => %{capacity: 8.0, refill_per_sec: 7.2},
      #       {"ORDERS", 1, "DAY"} => %{capacity: 16000.0, refill_per_sec: 1.6666666666666667}
      #     }}

  With `exchange: exchange_id`, each entry's limit also becomes that exchange's own limit
  for the used-weight header that counts it (`REQUEST_WEIGHT` 1 `MINUTE` for
  `X-MBX-USED-WEIGHT-1M`, `ORDERS` 10 `SECOND` for `X-MBX-ORDER-COUNT-10S`, ...: Binance
  names them `X-MBX-USED-WEIGHT-(intervalNum)(intervalLetter)` and
  `X-MBX-ORDER-COUNT-(intervalNum)(intervalLetter)`), so that header sync
  (`Bourse.RateLimiter.Feedback`) holds every bucket of that exchange to what the
  exchange admits: `Bourse.RateLimiter.Feedback.put_header_limits/2`. Header sync reads
  the headers of its table (the README's "Used-weight headers"); an entry of another
  interval (`REQUEST_WEIGHT` 1 `SECOND`, say) takes effect once its header is given an
  axis and window in `config :bourse, :header_axes`.

      {:ok, buckets} = Limits.from_binance_exchange_info(info, exchange: "binance")

  Keys may be strings (decoded JSON) or atoms. A missing or empty `"rateLimits"`, a
  duplicate entry or a malformed one (a missing field, a non-positive number, a limit
  above 1.0e12, an interval other than `SECOND`, `MINUTE`, `HOUR` or `DAY`) is
  `{:error, %Bourse.Error{type: :invalid_parameters}}`.
  """
  @spec from_binance_exchange_info(map(), keyword()) ::
          {:ok, %{binance_key() => limit()}} | {:error, Error.t()}
  def from_binance_exchange_info(info, opts \\ [])

  def from_binance_exchange_info(info, opts) when is_map(info) do
    with :ok <- known_options(opts, [:exchange | @size_options]),
         {:ok, exchange} <- exchange_option(opts),
         {:ok, buckets, header_limits} <- rate_limits(info, opts),
         :ok <- put_header_limits(exchange, header_limits) do
      {:ok, buckets}
    end
  end

  def from_binance_exchange_info(info, _opts),
    do: invalid("exchangeInfo must be a map, got #{Error.describe(info)}")

  defp exchange_option(opts) do
    case Keyword.get(opts, :exchange) do
      exchange when is_nil(exchange) or is_binary(exchange) -> {:ok, exchange}
      other -> invalid("exchange must be an exchange id (a binary), got #{Error.describe(other)}")
    end
  end

  defp rate_limits(info, opts) do
    case field(info, "rateLimits") do
      [_ | _] = entries -> entries(entries, 0, {%{}, %{}}, opts)
      _ -> invalid("exchangeInfo has no rateLimits, or they are empty")
    end
  end

  defp entries([], _index, {buckets, headers}, _opts), do: {:ok, buckets, headers}

  defp entries([entry | rest], index, {buckets, headers}, opts) do
    with {:ok, key, limit, window_ms} <- entry(entry, index),
         :ok <- unique(key, buckets),
         {:ok, bucket} <- size(limit, window_ms, Keyword.take(opts, @size_options)) do
      headers = Map.merge(headers, used_header(key, limit))
      entries(rest, index + 1, {Map.put(buckets, key, bucket), headers}, opts)
    end
  end

  defp entries(_improper, _index, _buckets, _opts), do: invalid("rateLimits is not a proper list")

  # The response header that reports how much of an entry is spent, if Binance sends one.
  defp used_header({type, num, interval}, limit) do
    letter = interval |> String.first() |> String.downcase()

    case type do
      "REQUEST_WEIGHT" -> %{"x-mbx-used-weight-#{num}#{letter}" => limit}
      "ORDERS" -> %{"x-mbx-order-count-#{num}#{letter}" => limit}
      _raw_requests -> %{}
    end
  end

  defp put_header_limits(nil, _header_limits), do: :ok

  defp put_header_limits(exchange, header_limits),
    do: Bourse.RateLimiter.Feedback.put_header_limits(exchange, header_limits)

  defp entry(entry, index) when is_map(entry) do
    type = field(entry, "rateLimitType")
    interval = field(entry, "interval")
    num = field(entry, "intervalNum")
    limit = field(entry, "limit")

    cond do
      not (is_binary(type) and type != "") -> malformed(index, entry, "rateLimitType")
      not Map.has_key?(@interval_ms, interval) -> malformed(index, entry, "interval")
      not (is_integer(num) and num > 0) -> malformed(index, entry, "intervalNum")
      not positive_amount?(limit) -> malformed(index, entry, "limit")
      true -> {:ok, {type, num, interval}, limit, num * @interval_ms[interval]}
    end
  end

  defp entry(entry, index),
    do: invalid("rateLimits entry #{index} must be a map, got #{Error.describe(entry)}")

  defp unique({type, num, interval} = key, buckets) do
    # The type is the exchange's text: shown when it is a short name, else by its size.
    type = if type =~ ~r/\A[A-Z_]{1,64}\z/, do: inspect(type), else: Error.describe(type)

    if Map.has_key?(buckets, key),
      do: invalid("duplicate rateLimits entry {#{type}, #{num}, #{inspect(interval)}}"),
      else: :ok
  end

  defp malformed(index, entry, name) do
    value = Error.describe(field(entry, name))
    invalid("rateLimits entry #{index} has a missing or bad #{name}, got #{value}")
  end

  defp field(map, name) do
    # `name` is one of this module's literals, so `String.to_atom/1` is bounded.
    Map.get_lazy(map, name, fn -> Map.get(map, String.to_atom(name)) end)
  end

  defp positive_amount?(x), do: is_number(x) and x > 0 and x <= Native.bound(:max_amount)

  defp invalid(message), do: {:error, Error.invalid(message)}
end
