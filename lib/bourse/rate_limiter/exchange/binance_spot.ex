defmodule Bourse.RateLimiter.Exchange.BinanceSpot do
  @moduledoc """
  Binance spot (`api.binance.com`, `/api/*`): the profile `:binance_spot` of
  `Bourse.RateLimiter.Exchange`, exchange id `"binance"`.

  | counter | scope | window | limit | axis | header |
  | --- | --- | --- | --- | --- | --- |
  | `REQUEST_WEIGHT` | IP | fixed, 1 minute | 6,000 weight | `"ip"` | `X-MBX-USED-WEIGHT-1M` |
  | `RAW_REQUESTS` | IP | fixed, 5 minutes | 300,000 requests | `"raw_requests"` | – |
  | `ORDERS` | account | fixed, 10 seconds | 100 unfilled orders | `"orders_10s"` | `X-MBX-ORDER-COUNT-10S` |
  | `ORDERS` | account | fixed, 1 day | 200,000 unfilled orders | `"orders_1d"` | `X-MBX-ORDER-COUNT-1D` |

  Sources: the limits as the live `exchangeInfo` listed them on 6 November 2026 (the
  field report, docs/CONTRACT.md; `https://data-api.binance.vision/api/v3/exchangeInfo?symbol=BTCUSDT`);
  headers, fixed windows ("a 1 MINUTE interval starts every minute") and the scopes as
  documented on <https://developers.binance.com/docs/binance-spot-api-docs/rest-api/limits>
  and <https://developers.binance.com/docs/binance-spot-api-docs/websocket-api/rate-limits>,
  read 2026-12-01. The live numbers can differ: size from `exchangeInfo` with
  `Bourse.RateLimiter.Limits.from_binance_exchange_info/2` when the adapter starts.

  Signals: 429 with `Retry-After`; 418 (IP ban, 2 minutes to 3 days); 403 (WAF limit);
  `code` -1003 and -1015 in the body (`Bourse.RateLimiter.BodySignal`).
  """

  @limits "https://developers.binance.com/docs/binance-spot-api-docs/rest-api/limits"
  @exchange_info "https://data-api.binance.vision/api/v3/exchangeInfo?symbol=BTCUSDT"

  @doc "The profile; see the module documentation."
  @spec profile(keyword()) :: {:ok, Bourse.RateLimiter.Exchange.profile()}
  def profile(_opts) do
    {:ok,
     %{
       name: :binance_spot,
       exchange_id: "binance",
       title: "Binance spot",
       counters: [
         %{
           axis: "ip",
           name: "REQUEST_WEIGHT",
           scope: :ip,
           kind: :fixed,
           limit: 6_000,
           window_ms: 60_000,
           cost: "the endpoint's weight",
           header: "x-mbx-used-weight-1m",
           source: source()
         },
         %{
           axis: "raw_requests",
           name: "RAW_REQUESTS",
           scope: :ip,
           kind: :fixed,
           limit: 300_000,
           window_ms: 300_000,
           cost: 1,
           source: source()
         },
         %{
           axis: "orders_10s",
           name: "ORDERS",
           scope: :account,
           kind: :fixed,
           limit: 100,
           window_ms: 10_000,
           cost: "1 per order placed",
           header: "x-mbx-order-count-10s",
           source: source()
         },
         %{
           axis: "orders_1d",
           name: "ORDERS",
           scope: :account,
           kind: :fixed,
           limit: 200_000,
           window_ms: 86_400_000,
           cost: "1 per order placed",
           header: "x-mbx-order-count-1d",
           source: source()
         }
       ],
       signals: [
         "429 with Retry-After (seconds)",
         "418: IP banned, 2 minutes to 3 days, Retry-After until the end",
         "403: the WAF limit was violated",
         "code -1003 (too many requests, or IP banned until <ms>), -1015 (too many orders)"
       ],
       notes: [
         "Limits are per IP for weight, per account for orders; the live exchangeInfo is " <>
           "authoritative: Limits.from_binance_exchange_info(info, exchange: \"binance\")"
       ]
     }}
  end

  defp source,
    do: %{
      url: @limits,
      read: "2026-12-01",
      note: "numbers from the live exchangeInfo of 6 November 2026 (#{@exchange_info})"
    }
end
