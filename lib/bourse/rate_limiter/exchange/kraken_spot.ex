defmodule Bourse.RateLimiter.Exchange.KrakenSpot do
  @moduledoc """
  Kraken spot REST (`api.kraken.com`): the profile `:kraken_spot` of
  `Bourse.RateLimiter.Exchange`, exchange id `"kraken"`. Option `tier:` – `:starter`
  (default: the lowest), `:intermediate` or `:pro`.

  | counter | scope | kind | limit | axis |
  | --- | --- | --- | --- | --- |
  | REST call counter (private endpoints) | API key | decaying | maximum 15 / 20 / 20, decay 0.33 / 0.5 / 1 per second (starter / intermediate / pro) | `"private"` |
  | public endpoints | IP | decaying | 1 call a second | `"public"` |

  The call counter: "Ledger/trade history calls increase the counter by 2. All other API
  calls increase this counter by 1 (except AddOrder, CancelOrder which operate on a
  different limiter)", "Each API key's counter is separate", as documented on
  <https://docs.kraken.com/api/docs/guides/spot-rest-ratelimits> (also
  <https://docs.kraken.com/exchange/guides/rest/ratelimits>), read 2026-12-01. The costs
  of 2 are listed in the counter's `:costs` (`Ledgers`, `QueryLedgers`, `TradesHistory`,
  `QueryTrades`): pass them as the cost of the check.

  Public endpoints: "Calling the public endpoints at a frequency of 1 per second (or
  less) would remain within the rate limits", by IP (and pair, for `Trades` and `OHLC`),
  as documented on
  <https://support.kraken.com/articles/206548367-what-are-the-api-rate-limits->, read
  2026-12-01: modelled as a counter of maximum 1 decaying 1 a second.

  Not sized here: the trading engine's per-pair counter (`AddOrder`, `CancelOrder`, ...,
  `EOrder:Rate limit exceeded`), whose thresholds per tier are not in the stored copy of
  <https://docs.kraken.com/api/docs/guides/spot-ratelimits>; add it as a `:decaying`
  counter per pair once known.

  Signals: `EAPI:Rate limit exceeded`, `EOrder:Rate limit exceeded` and
  `EService:Throttled: <unix time>` in the body's `error` list
  (`Bourse.RateLimiter.BodySignal`).
  """

  alias Bourse.Error

  @rest "https://docs.kraken.com/api/docs/guides/spot-rest-ratelimits"
  @public "https://support.kraken.com/articles/206548367-what-are-the-api-rate-limits-"
  @tiers %{starter: {15, 0.33}, intermediate: {20, 0.5}, pro: {20, 1}}

  @doc "The profile; see the module documentation."
  @spec profile(keyword()) :: {:ok, Bourse.RateLimiter.Exchange.profile()} | {:error, Error.t()}
  def profile(opts) do
    tier = Keyword.get(opts, :tier, :starter)

    case @tiers do
      %{^tier => {max, decay}} ->
        {:ok, profile(tier, max, decay)}

      _ ->
        {:error,
         Error.invalid(
           "tier must be :starter, :intermediate or :pro, got #{Error.describe(tier)}"
         )}
    end
  end

  defp profile(tier, max, decay) do
    %{
      name: :kraken_spot,
      exchange_id: "kraken",
      title: "Kraken spot REST (#{tier} tier)",
      tier: tier,
      counters: [
        %{
          axis: "private",
          name: "REST call counter",
          scope: :api_key,
          kind: :decaying,
          max: max,
          decay_per_sec: decay,
          cost: 1,
          costs: %{"Ledgers" => 2, "QueryLedgers" => 2, "TradesHistory" => 2, "QueryTrades" => 2},
          source: %{url: @rest, read: "2026-12-01"}
        },
        %{
          axis: "public",
          name: "public endpoints",
          scope: :ip,
          kind: :decaying,
          max: 1,
          decay_per_sec: 1,
          cost: 1,
          source: %{url: @public, read: "2026-12-01"}
        }
      ],
      signals: [
        "EAPI:Rate limit exceeded: the call counter is above its maximum",
        "EOrder:Rate limit exceeded: the trading counter of a pair",
        "EService:Throttled: <unix time>: too many concurrent requests, retry after that time"
      ],
      notes: ["AddOrder and CancelOrder count on the trading engine's per-pair counter instead"]
    }
  end
end
