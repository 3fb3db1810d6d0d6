defmodule Bourse.RateLimiter.Exchange.CoinbaseAdvanced do
  @moduledoc """
  Coinbase Advanced Trade REST (`api.coinbase.com/api/v3/brokerage`): the profile
  `:coinbase_advanced` of `Bourse.RateLimiter.Exchange`, exchange id `"coinbase"`.

  | counter | scope | window | limit | axis |
  | --- | --- | --- | --- | --- |
  | private endpoints | user | 1 second | 30 requests | `"private"` |
  | public endpoints | IP | 1 second | 10 requests | `"public"` |

  Sources, read 2026-12-01: 30 requests per second per user for private endpoints and
  10 per second per IP for public ones, from
  <https://docs.cloud.coinbase.com/advanced-trade/docs/rest-api-rate-limits> as
  summarised at <https://rate-limits.apis.io/rate-limits/coinbase/coinbase-rate-limits/>
  (a third-party summary: no stored copy of Coinbase's page itself; check it before
  relying on the numbers). Coinbase's own pages say a limit answers `429 Too Many
  Requests` (<https://docs.cdp.coinbase.com/exchange/rest-api/rate-limits>, where the
  Exchange API's public limit is also 10 a second per IP) with
  `{"errors": [{"id": "rate_limit_exceeded"}]}`
  (<https://docs.cdp.coinbase.com/coinbase-app/api-architecture/rate-limiting>). Limits
  "may tighten during periods of elevated trading volume" (the same summary): keep the
  share low.

  Signals: 429, and `rate_limit_exceeded` in the body (`Bourse.RateLimiter.BodySignal`).
  """

  @page "https://docs.cloud.coinbase.com/advanced-trade/docs/rest-api-rate-limits"
  @copy "https://rate-limits.apis.io/rate-limits/coinbase/coinbase-rate-limits/"

  @doc "The profile; see the module documentation."
  @spec profile(keyword()) :: {:ok, Bourse.RateLimiter.Exchange.profile()}
  def profile(_opts) do
    source = %{url: @page, read: "2026-12-01", note: "read in a third-party summary: #{@copy}"}

    {:ok,
     %{
       name: :coinbase_advanced,
       exchange_id: "coinbase",
       title: "Coinbase Advanced Trade",
       counters: [
         %{
           axis: "private",
           name: "private endpoints",
           scope: :account,
           kind: :rolling,
           limit: 30,
           window_ms: 1_000,
           cost: 1,
           source: source
         },
         %{
           axis: "public",
           name: "public endpoints",
           scope: :ip,
           kind: :rolling,
           limit: 10,
           window_ms: 1_000,
           cost: 1,
           burst: 0.25,
           source: source
         }
       ],
       signals: [
         "429 Too Many Requests",
         "errors[].id or error: rate_limit_exceeded"
       ],
       notes: ["Limits may tighten during high volume"]
     }}
  end
end
