defmodule Bourse.RateLimiter.Exchange.OKX do
  @moduledoc """
  OKX API v5 (`www.okx.com`): the profile `:okx` of `Bourse.RateLimiter.Exchange`,
  exchange id `"okx"`.

  | counter | scope | window | limit | axis |
  | --- | --- | --- | --- | --- |
  | place order, `POST /api/v5/trade/order` | UID and instrument | 2 seconds | 60 requests | `"order"` |
  | new and amended orders of a sub-account | sub-account | 2 seconds | 1,000 orders | `"sub_account_orders"` |
  | public market data (tickers, books, candles) | IP | 2 seconds | 20 requests | `"market"` |

  OKX limits each endpoint on its own, public ones per IP and private ones per User ID
  (each sub-account has its own), and names the rule beside each endpoint; it sends no
  usage headers. Add a counter per endpoint the adapter calls; for per-instrument
  counters put the instrument in the axis (`"order:BTC-USDT"`). The windows are given as
  "per 2 seconds" without saying fixed or rolling: both are safe with this sizing.

  Sources, read 2026-12-01:

    * the sub-account limit, "a maximum of 1000 order requests per 2 seconds. Only new
      order requests and amendment order requests will be counted", as documented on
      <https://www.okx.com/help/fill-ratio-sub-account-rate-limit> (OKX's own page,
      updated 4 April 2024);
    * place order, "60 requests per 2 seconds", rule "User ID + Instrument ID", from
      <https://www.okx.com/docs-v5/en/#order-book-trading-trade-post-place-order> as
      copied at <https://cloudquant.github.io/bt_api_py/exchanges/okx/order_book_trading_trade>
      (no stored copy of OKX's page itself);
    * market data, 20 requests per 2 seconds per IP, from
      <https://www.okx.com/docs-v5/en/#overview-rate-limits> as summarised at
      <https://raw.githubusercontent.com/api-evangelist/okx/refs/heads/main/rate-limits/okx-rate-limits.yml>
      (a third-party summary: check the page before relying on it).

  Signals: `code` 50011 (rate limit reached, with HTTP 429) and 50061 (sub-account rate
  limit reached) in the body (`Bourse.RateLimiter.BodySignal`).
  """

  @doc "The profile; see the module documentation."
  @spec profile(keyword()) :: {:ok, Bourse.RateLimiter.Exchange.profile()}
  def profile(_opts) do
    {:ok,
     %{
       name: :okx,
       exchange_id: "okx",
       title: "OKX API v5",
       counters: [
         %{
           axis: "order",
           name: "POST /api/v5/trade/order",
           scope: :instrument,
           kind: :rolling,
           limit: 60,
           window_ms: 2_000,
           cost: 1,
           source: %{
             url: "https://www.okx.com/docs-v5/en/#order-book-trading-trade-post-place-order",
             read: "2026-12-01",
             note:
               "read in a copy: https://cloudquant.github.io/bt_api_py/exchanges/okx/order_book_trading_trade"
           }
         },
         %{
           axis: "sub_account_orders",
           name: "sub-account order limit",
           scope: :account,
           kind: :rolling,
           limit: 1_000,
           window_ms: 2_000,
           cost: "1 per new or amended order, each order of a batch",
           source: %{
             url: "https://www.okx.com/help/fill-ratio-sub-account-rate-limit",
             read: "2026-12-01"
           }
         },
         %{
           axis: "market",
           name: "public market data",
           scope: :ip,
           kind: :rolling,
           limit: 20,
           window_ms: 2_000,
           cost: 1,
           burst: 0.125,
           source: %{
             url: "https://www.okx.com/docs-v5/en/#overview-rate-limits",
             read: "2026-12-01",
             note:
               "read in a third-party summary: https://raw.githubusercontent.com/api-evangelist/okx/refs/heads/main/rate-limits/okx-rate-limits.yml"
           }
         }
       ],
       signals: [
         "code \"50011\": rate limit reached (HTTP 429)",
         "code \"50061\": sub-account rate limit reached"
       ],
       notes: ["Every endpoint has its own limit and rule: add the ones the adapter calls"]
     }}
  end
end
