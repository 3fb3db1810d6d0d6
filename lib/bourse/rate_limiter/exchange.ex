defmodule Bourse.RateLimiter.Exchange do
  @moduledoc """
  Exchange profiles: what each exchange publishes about its rate limits, as data an
  adapter reads, overrides and turns into bucket definitions.

      {:ok, buckets} = Exchange.buckets(:binance_spot, share: 0.8)
      buckets["ip"]        #=> %{capacity: 480.0, refill_per_sec: 72.0}

      Bourse.RateLimiter.wait_for_capacity({"binance", api_key, "ip"}, buckets["ip"], weight)

  Profiles (`profiles/0`):

  | name | exchange id | module |
  | --- | --- | --- |
  | `:binance_spot` | `"binance"` | `Bourse.RateLimiter.Exchange.BinanceSpot` |
  | `:binance_usdm` | `"binance_usdm"` | `Bourse.RateLimiter.Exchange.BinanceUSDM` |
  | `:bybit_v5` | `"bybit"` | `Bourse.RateLimiter.Exchange.BybitV5` |
  | `:okx` | `"okx"` | `Bourse.RateLimiter.Exchange.OKX` |
  | `:kraken_spot` | `"kraken"` | `Bourse.RateLimiter.Exchange.KrakenSpot` |
  | `:coinbase_advanced` | `"coinbase"` | `Bourse.RateLimiter.Exchange.CoinbaseAdvanced` |

  Each module documents its numbers with the page they come from and the date it was
  read.

  ## A profile

  A map with `:name`, `:exchange_id` (the id to use in keys: body signals are matched by
  it, `Bourse.RateLimiter.BodySignal`), `:title`, `:signals` (what the exchange answers
  when limited, in words), `:notes` and `:counters`, a list of the exchange's published
  counters, each a map of:

    * `:axis` – the bucket axis it maps to (`{exchange_id, credential, axis}`);
    * `:scope` – who is counted: `:ip`, `:account` (an account or UID), `:api_key`,
      `:endpoint` (per account and endpoint), `:instrument` (per account and
      instrument);
    * `:kind` – how the exchange counts:
      * `:fixed` – `:limit` per `:window_ms`, the window restarting at wall-clock
        multiples of it (Binance);
      * `:rolling` – `:limit` in any `:window_ms`;
      * `:decaying` – a counter each request raises by its cost, that decays by
        `:decay_per_sec` and refuses above `:max` (Kraken; a token bucket counted the
        other way);
    * `:cost` – what one request costs: `1`, or a description (`"the endpoint's
      weight"`), and `:costs` for endpoints that cost more (`%{"Ledgers" => 2}`);
    * `:header` – the reply header that reports it, if any (header sync,
      `Bourse.RateLimiter.Feedback`);
    * `:burst` (optional) – the least part of the counter's ceiling available at once,
      where the default would leave fewer than two whole requests: such a counter gets a
      capacity of 2 at the default share (0.8), scaled by `:share`; a larger `:burst`
      option applies;
    * `:source` – `%{url: ..., read: "YYYY-MM-DD"}`, and `:note` where the number comes
      from a copy of the page rather than the page itself.

  Override anything before sizing: `Exchange.profile(:binance_spot)` returns
  `{:ok, map}`; change a counter of the map and pass the map to `buckets/2`.

  ## Sizing

  A `:fixed` or `:rolling` counter of `L` per window `W` gets the bucket of
  `Bourse.RateLimiter.Limits.size/3`: `capacity + refill_per_sec * W <= share * L`, with
  `capacity = burst * share * L`. A `:decaying` counter gets `capacity = share * max`, but
  at least one request of cost 1 where `max` allows one (Kraken's public counter of 1),
  and `refill_per_sec = share * decay_per_sec`: the bucket never spends faster than the
  counter decays, nor holds more than its maximum.
  """

  alias Bourse.Error
  alias Bourse.RateLimiter.{Feedback, Limits, Options}
  alias Bourse.RateLimiter.Exchange.{BinanceSpot, BinanceUSDM, BybitV5, CoinbaseAdvanced}
  alias Bourse.RateLimiter.Exchange.{KrakenSpot, OKX}

  @type counter :: %{
          required(:axis) => String.t(),
          required(:scope) => atom(),
          required(:kind) => :fixed | :rolling | :decaying,
          required(:source) => map(),
          optional(atom()) => term()
        }
  @type profile :: %{
          required(:name) => atom(),
          required(:exchange_id) => String.t(),
          required(:counters) => [counter()],
          optional(atom()) => term()
        }

  @modules %{
    binance_spot: BinanceSpot,
    binance_usdm: BinanceUSDM,
    bybit_v5: BybitV5,
    okx: OKX,
    kraken_spot: KrakenSpot,
    coinbase_advanced: CoinbaseAdvanced
  }

  # Each profile's counters, by exchange id (for `header_limits/1`).
  @counters_by_exchange (for {_name, module} <- @modules, into: %{} do
                           {:ok, %{exchange_id: id, counters: counters}} = module.profile([])
                           {id, counters}
                         end)

  @doc "The names of the profiles."
  @spec profiles() :: [atom()]
  def profiles, do: @modules |> Map.keys() |> Enum.sort()

  # The options each profile takes; the others take none.
  @profile_options %{kraken_spot: [:tier]}

  @doc """
  The profile `name`. Options go to the profile: `tier:` for Kraken (`:starter`
  (default), `:intermediate` or `:pro`); the other profiles take none.
  """
  @spec profile(atom(), keyword()) :: {:ok, profile()} | {:error, Error.t()}
  def profile(name, opts \\ []) do
    case @modules do
      %{^name => module} ->
        known = Map.get(@profile_options, name, [])
        expected = "#{inspect(known)} for #{inspect(name)}"

        case Options.known_options(opts, "profile option", known, expected) do
          :ok -> module.profile(opts)
          {:error, message} -> invalid(message)
        end

      _ ->
        invalid(
          "unknown exchange profile #{Error.describe(name)}; expected one of #{inspect(profiles())}"
        )
    end
  end

  @doc """
  Bucket definitions for every counter of a profile (a name or a profile map), keyed by
  axis. Options: `:share` of each limit to use, in `(0, 1]` (default 0.8), `:burst`
  for fixed and rolling counters (default 0.1, see `Bourse.RateLimiter.Limits.size/3`;
  a counter's own `:burst` is the least it gets),
  and the profile's own options.

      Exchange.buckets(:kraken_spot, tier: :pro)
      #=> {:ok, %{"private" => %{capacity: 16.0, refill_per_sec: 0.8}, "public" => ...}}
  """
  @spec buckets(atom() | profile(), keyword()) ::
          {:ok, %{String.t() => Limits.limit()}} | {:error, Error.t()}
  def buckets(name_or_profile, opts \\ [])

  def buckets(name, opts) when is_atom(name) do
    with {:ok, _sizing} <- check_options(opts),
         {:ok, profile} <- profile(name, Keyword.drop(opts, [:share, :burst])),
         do: buckets(profile, opts)
  end

  def buckets(%{counters: counters}, opts) when is_list(counters) do
    with {:ok, sizing} <- check_options(opts), do: size_counters(counters, sizing)
  end

  def buckets(other, _opts),
    do: invalid("expected a profile name or a profile map, got #{Error.describe(other)}")

  @options [:share, :burst, :tier]

  # The share and burst of known options (`Limits.sizing/1`).
  defp check_options(opts) do
    case Options.known_options(opts, "option", @options, "one of #{inspect(@options)}") do
      :ok -> Limits.sizing(opts)
      {:error, message} -> invalid(message)
    end
  end

  defp size_counters(counters, sizing) do
    Enum.reduce_while(counters, {:ok, %{}}, fn counter, {:ok, buckets} ->
      case bucket(counter, sizing) do
        {:ok, axis, bucket} -> {:cont, {:ok, Map.put(buckets, axis, bucket)}}
        error -> {:halt, error}
      end
    end)
  end

  defp bucket(%{axis: axis, kind: kind, limit: limit, window_ms: window_ms} = counter, sizing)
       when is_binary(axis) and kind in [:fixed, :rolling] do
    # The counter's own burst is a floor: a larger `:burst` option applies.
    burst = max(Map.get(counter, :burst, 0), sizing.burst)

    with {:ok, bucket} <- Limits.size(limit, window_ms, share: sizing.share, burst: burst),
         do: {:ok, axis, bucket}
  end

  defp bucket(%{axis: axis, kind: :decaying, max: max, decay_per_sec: decay}, %{share: share})
       when is_binary(axis) and is_number(max) and max > 0 and is_number(decay) and decay > 0,
       do:
         {:ok, axis,
          %{capacity: max(share * max, 1.0 * min(max, 1)), refill_per_sec: share * decay}}

  defp bucket(counter, _sizing),
    do: invalid("malformed counter in the profile: #{Error.describe(counter)}")

  @doc """
  Records the limits of the profile's counters that a reply header reports as the
  exchange's own limits for header sync (`Bourse.RateLimiter.Feedback.put_header_limits/2`),
  for the profile's exchange id. Call it once when the adapter starts; a later
  `Bourse.RateLimiter.Limits.from_binance_exchange_info/2` with `exchange:` overrides it
  with the live numbers.
  """
  @spec put_header_limits(atom() | profile(), keyword()) :: :ok | {:error, Error.t()}
  def put_header_limits(name_or_profile, opts \\ [])

  def put_header_limits(name, opts) when is_atom(name) do
    with {:ok, profile} <- profile(name, opts), do: put_header_limits(profile, [])
  end

  def put_header_limits(%{exchange_id: exchange_id, counters: counters}, [])
      when is_list(counters),
      do: Feedback.put_header_limits(exchange_id, counter_header_limits(counters))

  def put_header_limits(other, opts) do
    invalid(
      "put_header_limits/2 takes a profile name, or a profile map (with :exchange_id and a " <>
        "list of :counters) and no options, got #{Error.describe(other)} and " <>
        Error.describe(opts)
    )
  end

  @doc false
  # Header sync's defaults for `exchange_id`: the limits of the counters of the profile
  # with that exchange id, by header (`%{}` for none).
  @spec header_limits(String.t()) :: %{String.t() => number()}
  def header_limits(exchange_id),
    do: @counters_by_exchange |> Map.get(exchange_id, []) |> counter_header_limits()

  defp counter_header_limits(counters),
    do: for(%{header: header, limit: limit} <- counters, into: %{}, do: {header, limit})

  defp invalid(message), do: {:error, Error.invalid(message)}
end
