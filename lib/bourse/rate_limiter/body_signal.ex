defmodule Bourse.RateLimiter.BodySignal do
  @moduledoc """
  Rate-limit signals an exchange puts in a reply's body or status besides 429 and 418,
  which `Bourse.RateLimiter.observe_response/6` treats like a 429 (or, for bans, like a
  418). Several exchanges answer HTTP 200 with the error in the JSON body.

  Signals are matched by exchange id as `Bourse.RateLimiter` spells it: `"binance"`,
  `"bybit"`, `"okx"`, `"kraken"`, `"coinbase"`, or an id that starts with one of them
  followed by `_`, `-` or `.` (`"binance_usdm"`, `"bybit-testnet"`). Other exchanges have
  none.

  The body is a decoded JSON map (string or atom keys), as an adapter has it, or the raw
  binary, of which only the top-level fields at its start are read
  (`Bourse.RateLimiter.BodyScan`: at most 16 KiB, 8 levels deep, linear time). Lists in
  the body are read up to their first 16 items.

  | exchange | signal | scope | reaction |
  | --- | --- | --- | --- |
  | Binance | `"code"` -1003 `TOO_MANY_REQUESTS` (request weight, counted per IP) | exchange (the IP) | as a 429, for every credential; with `IP banned until <ms>` in `"msg"`: a ban until then, stop |
  | Binance | `"code"` -1015 `TOO_MANY_ORDERS` | credential | as a 429; the wait is the rest of the order window its `"msg"` names (`per 10 SECOND`, `per MINUTE`) |
  | Binance | `"code"` -1015 naming the day's limit (`per DAY`) | the credential's `"orders_1d"` bucket | until 00:00 UTC, when the day's count restarts; stop (other requests of the credential go on) |
  | Binance | HTTP 403: the WAF limit was violated | exchange (the IP) | as a 418: stop |
  | Bybit | `"retCode"` 10006: too many visits, the per-UID API limit | credential | as a 429; the wait is `X-Bapi-Limit-Reset-Timestamp` when no `Retry-After` |
  | Bybit | `"retCode"` 10018: the IP rate limit | exchange (the IP) | as a 429, for every credential |
  | Bybit | `"retCode"` 10009: IP banned; HTTP 403: access too frequent | exchange (the IP) | stop; 403 waits 10 minutes, as documented |
  | OKX | `"code"` 50011: rate limit reached (the user's limit or the IP's); either as an order's `"sCode"` in `"data"` when the batch failed (`"code"` 1 or 2) | credential, and with `ip:` the IP's buckets too | as a 429 |
  | OKX | `"code"` 50061: sub-account rate limit reached; as `"sCode"` as above | credential | as a 429 |
  | Kraken | `"error"` holds `EAPI:Rate limit exceeded` (the REST call counter) or `EOrder:Rate limit exceeded` (the trading counter) | credential | as a 429 |
  | Kraken | `"error"` holds `EService:Throttled: <unix time>` (too many concurrent requests) | credential | as a 429, until that time |
  | Kraken | `"error"` holds `EGeneral:Temporary lockout` (the counter was exceeded; requests sent meanwhile prolong it) | credential | 15 minutes, as the lockout typically lasts; stop |
  | Coinbase | `"errors"` holds `%{"id" => "rate_limit_exceeded"}`, or `"error"` is `"rate_limit_exceeded"` (the key's limit or the IP's) | credential, and with `ip:` the IP's buckets too | as a 429 |

  Codes may be numbers or strings (OKX sends `"50011"`). A `Retry-After` header, when
  usable, sets the wait before any time named in the body.

  ## Sources (read 2026-12-01, from the stored copies of these pages)

    * Binance: error codes, <https://developers.binance.com/docs/binance-spot-api-docs/errors>
      (-1003, -1015); HTTP return codes, "HTTP 403 return code is used when the WAF Limit
      (Web Application Firewall) has been violated",
      <https://developers.binance.com/docs/binance-spot-api-docs/rest-api/limits> and the
      general information of every Binance API (e.g.
      <https://developers.binance.com/docs/derivatives/portfolio-margin>).
    * Bybit V5: error codes, <https://bybit-exchange.github.io/docs/v5/error> (10006
      "Too many visits. Exceeded the API Rate Limit.", 10009 "IP has been banned.", 10018
      "Exceeded the IP Rate Limit.", 403 "IP rate limit breached"); rate limit rules,
      <https://bybit-exchange.github.io/docs/v5/rate-limit> ("retCode": 10006; "403,
      access too frequent": "wait for at least 10 minutes").
    * OKX: REST error codes 50011 "Rate limit reached" and 50061 "Sub-account rate limit
      reached", <https://www.okx.com/docs-v5/en/#error-code-rest-api-general> (read in a
      stored mirror of that table; OKX's own Web3 API pages list 50011 with HTTP 429). A
      batch's per-order results carry `"sCode"` and `"sMsg"` in `"data"`, with `"code"`
      1 (all failed) or 2 (some failed).
    * Kraken: <https://docs.kraken.com/api/docs/guides/spot-rest-ratelimits> (errors
      `EAPI:Rate limit exceeded` and `EService: Throttled: [UNIX timestamp]`);
      <https://support.kraken.com/hc/en-us/articles/360045239571-Trading-rate-limits>
      and <https://docs.kraken.com/exchange/guides/general/ratelimits>
      (`EOrder:Rate limit exceeded`);
      <https://support.kraken.com/hc/en-us/articles/360001491786-API-error-messages>
      (`EGeneral:Temporary lockout` among the rate-limit errors, typically about 15
      minutes); <https://docs.kraken.com/exchange/guides/general/errors> (a lockout,
      "typically a few minutes"; retrying meanwhile does not end it).
    * Coinbase: a 429 with `{"errors": [{"id": "rate_limit_exceeded", ...}]}`,
      <https://docs.cdp.coinbase.com/coinbase-app/api-architecture/rate-limiting>;
      Advanced Trade and Exchange REST answer 429 Too Many Requests,
      <https://docs.cdp.coinbase.com/exchange/rest-api/rate-limits>. No stored copy of
      Coinbase's own Advanced Trade error page shows a rate-limit code in a 200 body.
  """

  alias Bourse.RateLimiter.BodyScan

  @typedoc """
  A signal found: which buckets to pause (`:credential`: every bucket of the credential;
  `:unnamed`: a limit that may be the credential's or the IP's, paused as a 429 that
  names none; `:exchange`: every bucket of the exchange; `{:axis, axis}`: the
  credential's bucket of that axis), whether to stop, the wait the reply names
  (ms, `nil` if none) and a description for the error message.
  """
  @type t :: %{
          scope: :credential | :unnamed | :exchange | {:axis, String.t()},
          stop: boolean(),
          wait_ms: non_neg_integer() | nil,
          reason: String.t()
        }

  @typedoc "A reply body: a binary, a decoded JSON map or list, or `nil`."
  @type body :: binary() | map() | list() | nil

  @families ~w(binance bybit okx kraken coinbase)
  @max_items 16
  @bybit_ip_ban_ms 600_000
  # How long Kraken's temporary lockout typically lasts.
  @kraken_lockout_ms 900_000
  @day_ms 86_400_000

  # The fields read, as strings and as the atoms of a map decoded with atom keys.
  @keys %{
    "code" => :code,
    "msg" => :msg,
    "retCode" => :retCode,
    "error" => :error,
    "errors" => :errors,
    "id" => :id
  }

  @doc """
  The signal in a reply of `exchange_id` with `status` and `body`, or `nil`.
  `headers` are the reply's lower-case headers (Bybit's reset timestamp is read there);
  `now_ms` is the system time in ms.
  """
  @spec find(String.t(), 100..599, body(), %{String.t() => String.t()}, integer()) :: t() | nil
  def find(exchange_id, status, body, headers, now_ms) do
    case family(exchange_id) do
      nil ->
        nil

      family ->
        status_signal(family, status) ||
          body_signal(family, fields(body, family), headers, now_ms)
    end
  end

  @doc "The signal family of an exchange id (`\"binance\"` for `\"binance_usdm\"`), or `nil`."
  @spec family(String.t()) :: String.t() | nil
  def family(exchange_id) when is_binary(exchange_id) do
    head =
      exchange_id
      |> binary_part(0, min(byte_size(exchange_id), 16))
      |> String.split(["_", "-", "."], parts: 2)
      |> hd()

    if head in @families, do: head
  end

  # The top-level fields each family's signals are in.
  @wanted %{
    "binance" => ["code", "msg"],
    "bybit" => ["retCode"],
    "okx" => ["code", "data"],
    "kraken" => ["error"],
    "coinbase" => ["error", "errors"]
  }

  defp fields(body, family) when is_binary(body), do: BodyScan.fields(body, @wanted[family])
  defp fields(body, _family) when is_map(body), do: body
  defp fields(_none_or_list, _family), do: %{}

  ## By status

  defp status_signal("binance", 403),
    do: signal(:exchange, true, nil, "Binance's WAF limit was violated")

  defp status_signal("bybit", 403),
    do:
      signal(
        :exchange,
        true,
        @bybit_ip_ban_ms,
        "Bybit's IP limit was breached (access too frequent)"
      )

  defp status_signal(_family, _status), do: nil

  ## By body

  defp body_signal("binance", body, _headers, now_ms) do
    case code(body) do
      -1003 ->
        case banned_until(get(body, "msg")) do
          nil ->
            signal(:exchange, false, nil, "Binance code -1003 (too many requests)")

          until ->
            signal(:exchange, true, max(until - now_ms, 0), "Binance code -1003: IP banned")
        end

      -1015 ->
        msg = get(body, "msg")

        case day_left(msg, now_ms) do
          nil ->
            wait = order_window_left(msg, now_ms)
            signal(:credential, false, wait, "Binance code -1015 (too many new orders)")

          left ->
            signal({:axis, "orders_1d"}, true, left, "Binance code -1015 (the day's new orders)")
        end

      _ ->
        nil
    end
  end

  defp body_signal("bybit", body, headers, now_ms) do
    case code(get(body, "retCode")) do
      10006 ->
        signal(
          :credential,
          false,
          bybit_reset(headers, now_ms),
          "Bybit retCode 10006 (too many visits)"
        )

      10018 ->
        signal(:exchange, false, nil, "Bybit retCode 10018 (IP rate limit)")

      10009 ->
        signal(:exchange, true, nil, "Bybit retCode 10009 (IP banned)")

      _ ->
        nil
    end
  end

  # A batch that failed in whole or in part (code 1 or 2) names each order's error in its
  # `"sCode"`.
  defp body_signal("okx", body, _headers, _now_ms) do
    case code(body) do
      batch when batch in [1, 2] ->
        body |> get("data") |> items() |> Enum.find_value(&okx_code(get(&1, "sCode"), "sCode"))

      code ->
        okx_code(code, "code")
    end
  end

  defp body_signal("kraken", body, _headers, now_ms) do
    body |> get("error") |> items() |> Enum.find_value(&kraken_error(&1, now_ms))
  end

  defp body_signal("coinbase", body, _headers, _now_ms) do
    ids = [get(body, "error") | body |> get("errors") |> items() |> Enum.map(&get(&1, "id"))]

    if "rate_limit_exceeded" in ids,
      do: signal(:unnamed, false, nil, "Coinbase rate_limit_exceeded")
  end

  defp okx_code(code, field) do
    case code(code) do
      50011 ->
        signal(:unnamed, false, nil, "OKX #{field} 50011 (rate limit reached)")

      50061 ->
        signal(:credential, false, nil, "OKX #{field} 50061 (sub-account rate limit reached)")

      _ ->
        nil
    end
  end

  defp kraken_error("EAPI:Rate limit exceeded", _now_ms),
    do: signal(:credential, false, nil, "Kraken EAPI:Rate limit exceeded")

  defp kraken_error("EOrder:Rate limit exceeded", _now_ms),
    do: signal(:credential, false, nil, "Kraken EOrder:Rate limit exceeded")

  # Sent while locked out; requests sent meanwhile prolong it.
  defp kraken_error("EGeneral:Temporary lockout", _now_ms),
    do: signal(:credential, true, @kraken_lockout_ms, "Kraken EGeneral:Temporary lockout")

  defp kraken_error("EService:" <> rest, now_ms) when byte_size(rest) <= 64 do
    case Regex.run(~r/\A\s*Throttled:\s*(\d{1,12})\s*\z/, rest) do
      [_, seconds] ->
        wait = max(String.to_integer(seconds) * 1000 - now_ms, 0)
        signal(:credential, false, wait, "Kraken EService:Throttled")

      nil ->
        nil
    end
  end

  defp kraken_error(_other, _now_ms), do: nil

  ## Reading fields

  defp signal(scope, stop, wait_ms, reason),
    do: %{scope: scope, stop: stop, wait_ms: wait_ms, reason: reason}

  defp get(map, key) when is_map(map) do
    case Map.fetch(map, key) do
      {:ok, value} -> value
      :error -> Map.get(map, Map.fetch!(@keys, key))
    end
  end

  defp get(_not_a_map, _key), do: nil

  # A map's "code", or the code itself: an integer, or a decimal integer as text.
  defp code(map) when is_map(map), do: code(get(map, "code"))
  defp code(code) when is_integer(code), do: code

  defp code(text) when is_binary(text) and byte_size(text) <= 12 do
    case Integer.parse(text) do
      {code, ""} -> code
      _ -> nil
    end
  end

  defp code(_other), do: nil

  defp items(list) when is_list(list), do: take(list, @max_items)
  defp items(_not_a_list), do: []

  # The first `n` items of a list that may be improper.
  defp take([item | rest], n) when n > 0, do: [item | take(rest, n - 1)]
  defp take(_rest, _n), do: []

  defp banned_until(msg) when is_binary(msg) and byte_size(msg) <= 512 do
    case Regex.run(~r/banned until (\d{13})/, msg) do
      [_, ms] -> String.to_integer(ms)
      nil -> nil
    end
  end

  defp banned_until(_msg), do: nil

  # What is left of the order window a -1015 names ("current limit is 50 orders per 10
  # SECOND"), on the local clock: Binance's order windows start at whole intervals.
  defp order_window_left(msg, now_ms) when is_binary(msg) and byte_size(msg) <= 512 do
    with [_, count, unit] <- Regex.run(~r/per (\d{0,3}) ?(SECOND|MINUTE)\b/i, msg),
         interval when interval in 1..300_000 <- window_ms(count, String.upcase(unit)) do
      interval - rem(now_ms, interval)
    else
      _ -> nil
    end
  end

  defp order_window_left(_msg, _now_ms), do: nil

  # What is left of the UTC day, when a -1015 names the day's order limit ("200000 orders
  # per DAY").
  defp day_left(msg, now_ms) when is_binary(msg) and byte_size(msg) <= 512 do
    if Regex.match?(~r/per 1? ?DAY\b/i, msg), do: @day_ms - rem(now_ms, @day_ms)
  end

  defp day_left(_msg, _now_ms), do: nil

  defp window_ms("", unit), do: window_ms("1", unit)
  defp window_ms(count, "SECOND"), do: String.to_integer(count) * 1_000
  defp window_ms(count, "MINUTE"), do: String.to_integer(count) * 60_000

  # Bybit's reset time, while limited; the current time otherwise (then nothing to wait).
  defp bybit_reset(%{"x-bapi-limit-reset-timestamp" => text}, now_ms)
       when byte_size(text) <= 16 do
    case Integer.parse(text) do
      {reset_ms, ""} when reset_ms > now_ms -> reset_ms - now_ms
      _ -> nil
    end
  end

  defp bybit_reset(_headers, _now_ms), do: nil
end
