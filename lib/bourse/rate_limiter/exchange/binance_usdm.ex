defmodule Bourse.RateLimiter.Exchange.BinanceUSDM do
  @moduledoc """
  Binance USDⓈ-M futures (`fapi.binance.com`): the profile `:binance_usdm` of
  `Bourse.RateLimiter.Exchange`, exchange id `"binance_usdm"` (its body signals are
  Binance's).

  | counter | scope | window | limit | axis | header |
  | --- | --- | --- | --- | --- | --- |
  | `REQUEST_WEIGHT` | IP | fixed, 1 minute | 2,400 weight | `"ip"` | `X-MBX-USED-WEIGHT-1M` |
  | `ORDERS` | account | fixed, 1 minute | 1,200 orders | `"orders_1m"` | `X-MBX-ORDER-COUNT-1M` |
  | `ORDERS` | account | fixed, 10 seconds | 300 orders | `"orders_10s"` | `X-MBX-ORDER-COUNT-10S` |

  Source: "The default rate limit per IP is 2,400/min, and the default order limit per
  account/sub-account is 1,200/min", "an additional 10-second limit applicable to USDⓈ-M
  Futures, default at 300/10s", as documented on
  <https://www.binance.com/en/support/faq/rate-limits-on-binance-futures-281596e222414cdd9051664ea621cdc3>
  (last updated 27 December 2024 in the stored copy), read 2026-12-01. Accounts with
  higher volume get higher limits: load `/fapi/v1/exchangeInfo` with
  `Bourse.RateLimiter.Limits.from_binance_exchange_info/2` and
  `exchange: "binance_usdm"`. Headers and windows as for spot.

  Header sync holds `"binance_usdm"` buckets to these limits (2,400 weight a minute, not
  spot's 6,000) with nothing to set.
  """

  @faq "https://www.binance.com/en/support/faq/rate-limits-on-binance-futures-281596e222414cdd9051664ea621cdc3"

  @doc "The profile; see the module documentation."
  @spec profile(keyword()) :: {:ok, Bourse.RateLimiter.Exchange.profile()}
  def profile(_opts) do
    source = %{url: @faq, read: "2026-12-01"}

    {:ok,
     %{
       name: :binance_usdm,
       exchange_id: "binance_usdm",
       title: "Binance USDⓈ-M futures",
       counters: [
         %{
           axis: "ip",
           name: "REQUEST_WEIGHT",
           scope: :ip,
           kind: :fixed,
           limit: 2_400,
           window_ms: 60_000,
           cost: "the endpoint's weight",
           header: "x-mbx-used-weight-1m",
           source: source
         },
         %{
           axis: "orders_1m",
           name: "ORDERS",
           scope: :account,
           kind: :fixed,
           limit: 1_200,
           window_ms: 60_000,
           cost: "1 per order placed",
           header: "x-mbx-order-count-1m",
           source: source
         },
         %{
           axis: "orders_10s",
           name: "ORDERS",
           scope: :account,
           kind: :fixed,
           limit: 300,
           window_ms: 10_000,
           cost: "1 per order placed",
           header: "x-mbx-order-count-10s",
           source: source
         }
       ],
       signals: [
         "429 with Retry-After; 418: IP banned; 403: the WAF limit was violated",
         "code -1003 (too many requests), -1015 (too many orders)"
       ],
       notes: ["VIP and high-volume accounts have higher limits: load exchangeInfo"]
     }}
  end
end
