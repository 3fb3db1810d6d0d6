defmodule Bourse.RateLimiter.Exchange.BybitV5 do
  @moduledoc """
  Bybit V5 (`api.bybit.com`): the profile `:bybit_v5` of `Bourse.RateLimiter.Exchange`,
  exchange id `"bybit"`.

  | counter | scope | window | limit | axis | header |
  | --- | --- | --- | --- | --- | --- |
  | HTTP IP limit | IP | any 5 seconds | 600 requests | `"ip"` | – |
  | `/v5/order/create` | UID and endpoint | rolling 1 second | 10 requests | `"order_create"` | `X-Bapi-Limit*` |
  | `/v5/order/amend` | UID and endpoint | rolling 1 second | 10 requests | `"order_amend"` | `X-Bapi-Limit*` |
  | `/v5/order/cancel` | UID and endpoint | rolling 1 second | 10 requests | `"order_cancel"` | `X-Bapi-Limit*` |

  Source: "You are allowed to send 600 requests within a 5-second window per IP by
  default", "The API rate limit is based on the rolling time window per second and UID",
  the `X-Bapi-Limit`, `X-Bapi-Limit-Status` and `X-Bapi-Limit-Reset-Timestamp` headers
  ("your remaining requests for current endpoint") and the API rate limit table (order
  create, amend, cancel: 10/s for the lowest account kind; more for some, and
  upgradable), as documented on <https://bybit-exchange.github.io/docs/v5/rate-limit>,
  read 2026-12-01. Other endpoints have limits of their own in that table; add them as
  counters.

  The `X-Bapi-Limit*` headers describe the endpoint of the reply: pass its axis,
  `observe_response("bybit", key, status, headers, axis: "order_create")`, and header
  sync applies them to that bucket (without `axis:`, to `"request"`).

  Signals: `retCode` 10006 (per-UID limit), 10018 (IP limit), 10009 (IP banned) in the
  body; HTTP 403 "access too frequent": stop and wait at least 10 minutes
  (`Bourse.RateLimiter.BodySignal`).
  """

  @page "https://bybit-exchange.github.io/docs/v5/rate-limit"

  @doc "The profile; see the module documentation."
  @spec profile(keyword()) :: {:ok, Bourse.RateLimiter.Exchange.profile()}
  def profile(_opts) do
    source = %{url: @page, read: "2026-12-01"}

    endpoint = fn axis, path ->
      %{
        axis: axis,
        name: path,
        scope: :endpoint,
        kind: :rolling,
        limit: 10,
        window_ms: 1_000,
        cost: 1,
        burst: 0.25,
        source: source
      }
    end

    {:ok,
     %{
       name: :bybit_v5,
       exchange_id: "bybit",
       title: "Bybit V5",
       counters: [
         %{
           axis: "ip",
           name: "HTTP IP limit",
           scope: :ip,
           kind: :rolling,
           limit: 600,
           window_ms: 5_000,
           cost: 1,
           source: source
         },
         endpoint.("order_create", "/v5/order/create"),
         endpoint.("order_amend", "/v5/order/amend"),
         endpoint.("order_cancel", "/v5/order/cancel")
       ],
       signals: [
         "retCode 10006 with HTTP 200: the per-UID limit; X-Bapi-Limit-Reset-Timestamp says when it resets",
         "retCode 10018: the IP limit; 10009: IP banned",
         "HTTP 403, access too frequent: stop every session, wait at least 10 minutes"
       ],
       notes: ["Keep a margin: Bybit advises against running at the edge of its limits"]
     }}
  end
end
