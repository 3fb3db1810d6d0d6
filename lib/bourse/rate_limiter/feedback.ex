defmodule Bourse.RateLimiter.Feedback do
  @moduledoc """
  What an exchange's replies tell the limiter: the logic behind
  `Bourse.RateLimiter.observe_response/6`, the one call an adapter makes after every
  response.

  ## 429, 418 and rate-limit signals in the body

  A 429 pauses every bucket of the credential (`{exchange_id, credential_key}`: every
  axis) for every caller at once, and, given `ip:`, every bucket of that IP too unless
  its body names a limit of the credential alone (the 429 may be the IP's); a 418
  (Binance's IP ban) pauses every bucket of the whole exchange, every credential and
  `:public` included, since the ban is on the IP that all of them share. A rate-limit
  signal in the body or status of any other reply
  (Bybit's `retCode` 10006 on an HTTP 200, Binance's 403, ...:
  `Bourse.RateLimiter.BodySignal` lists them, with their sources) is treated the same
  way: like a 429 for the credential, or for the whole exchange when the exchange counts
  by IP, and like a 418 (`stop: true`) for bans.

  The wait is, in this order:

    1. `Retry-After` (`Bourse.RateLimiter.RetryAfter`: seconds or an HTTP date; a floor
       of 1 s; see below past 300 s);
    2. a wait the reply names in its body or headers (Bybit's
       `X-Bapi-Limit-Reset-Timestamp` with `retCode` 10006, Kraken's
       `EService:Throttled: <unix time>`, Binance's `IP banned until <ms>`), with the same
       floor and cap;
    3. for a ban (below) that names none, 2 minutes, the shortest IP ban Binance documents
       (requests sent into a ban lengthen it);
    4. an exponential backoff of 1 s, 2 s, 4 s, ..., at most 300 s (never a stop), per
       consecutive limited reply without a usable wait on that credential, or on the
       exchange for replies that limit the whole exchange (Binance's -1003),
       whichever credential they came to: every key of the exchange shares that count
       (one per exchange, whatever IP a key sends from). With `ip:`, a 429 that names
       no limit is counted for the IP's buckets, shared by the keys that pass that
       `ip:`, and a 2xx also starts that count again. A 2xx
       without a signal on the credential starts both counts again, each unless its
       backoff's pause holds (the 2xx was sent before it). A reply that comes back while
       the backoff's pause holds was sent before it: it pauses as long again and is not
       counted (a burst of replies to requests in flight together is one step).

  The answer is `{:error, %Bourse.Error{type: :rate_limit_exceeded, http_status: status,
  retry_after: ms, exchange: exchange_id}}` (`http_status` is the reply's own: 200 for a
  signal in a 200's body), with `stop: true` when retrying is pointless:

    * **past the 300 s cap**: a reply asking for more than 300 s is a ban. The answer
      says `stop: true` and `retry_after` is the whole time asked, and the buckets are
      paused for that whole time (a 418 with `Retry-After: 600` pauses the exchange for
      600 s), up to 3 days, Binance's longest IP ban: a request sent during a ban only
      extends it. A longer wait still pauses for 3 days; `retry_after` keeps the time
      asked, up to 4,294,967,295 ms (what `Process.sleep/1` takes; the message then says
      "or more").
      `reset_exchange/2` lifts the pause;
    * any 418, Binance's 403 and Bybit's IP bans: a ban calls for an alert, not a retry
      loop.

  When the table cannot be reached (a daemon or Redis down), a limited reply is not
  recorded: the answer is `{:error, %Bourse.Error{type: :unavailable}}` with the reply's
  `http_status` and `stop`, and `retry_after` the wait it asked for (`nil` when it named
  none), so that the caller can hold off itself.

  The backoff count is kept in the limiter's bucket table, beside its pauses (in the
  daemon, or in Redis, for the limiters sharing them): limiters sharing a table share
  the count, and a limited reply counts and pauses in one call. The count is no bucket:
  it never shows in `Bourse.RateLimiter.busiest/2` or `mix bourse.top`. It lapses
  10 minutes after the last limited reply (counted or not), and `reset_exchange/2`
  and `reset_all/1` forget it; a table counts at most 10,000 credentials and exchanges at
  once (when full, a new one's backoff stays at 1 s).

  Calls to the bucket table per reply: one `pause` (or, for the backoff, one
  `back_off`) per limited reply, and with `ip:` one more for the other buckets a 429 holds;
  one to start the backoff count again per 2xx without a signal (two with `ip:`); per
  used-weight header present, one `sync`, after an `inspect_key` for the bucket's
  definition unless the adapter passes it
  (`limits: %{axis => limit}`, each limit in any form a check takes, such as
  `Bourse.RateLimiter.Exchange.buckets/2` returns); nothing else. A typical 2xx reply
  with one used-weight header and `limits:` costs two round trips to a daemon or Redis.
  With a daemon or Redis, the round trips of one call share one timeout (the backend's):
  a slow store gets `{:error, %Bourse.Error{type: :unavailable}}` within it, what was
  done before staying done.

  ## Used-weight headers

  Headers that say how much of a counter the exchange has seen spent bring the bucket of
  the matching axis, `{exchange_id, credential_key, axis}`, in line with it: its tokens
  are lowered so that what it may still admit until the exchange's window ends fits the
  allowance below. Tokens are never raised (what the exchange says is spent stays spent
  here) and a key the limiter holds no definition for is left alone. Headers are read on
  every reply, 429s included; names are case-insensitive.

  | header | axis | exchange window |
  | --- | --- | --- |
  | `x-mbx-used-weight-1m` (Binance) | `"ip"` | 60 s, restarting each wall-clock minute |
  | `x-sapi-used-ip-weight-1m` (Binance) | `"sapi_ip"` | 60 s, wall-clock |
  | `x-sapi-used-uid-weight-1m` (Binance) | `"sapi_uid"` | 60 s, wall-clock |
  | `x-mbx-order-count-10s` (Binance) | `"orders_10s"` | 10 s, wall-clock |
  | `x-mbx-order-count-1m` (Binance futures) | `"orders_1m"` | 60 s, wall-clock |
  | `x-mbx-order-count-1d` (Binance) | `"orders_1d"` | 1 day, wall-clock (UTC) |
  | `x-bapi-limit`, `x-bapi-limit-status`, `x-bapi-limit-reset-timestamp` (Bybit) | `"request"`, or `axis:` | 1 s |
  | `x-ratelimit-limit`, `x-ratelimit-remaining`, `x-ratelimit-reset` (generic) | `"request"`, or `axis:` | unknown |
  | `gw-ratelimit-limit`, `gw-ratelimit-remaining`, `gw-ratelimit-reset` (KuCoin) | `"request"`, or `axis:` | unknown |

  The last three describe the endpoint of the reply (Bybit: "your remaining requests for
  current endpoint"): an adapter passes that endpoint's axis with
  `observe_response(..., axis: "order_create")`, and they sync that bucket.

  `x-mbx-used-weight-1m` and `x-sapi-used-ip-weight-1m` count the IP the reply came
  from. Keys sharing an IP check one bucket of it (`{"binance", :public, "ip"}`) and pass
  `ip: :public` (the credential part of the IP's buckets): those two headers then sync
  `{exchange_id, ip, axis}`, and the others the key's own buckets.

  Binance's `x-mbx-used-weight` without an interval suffix is ignored: it names no window.

  **Used counters** (Binance) give `used`, the cost the exchange counted in the current
  window `W`, which restarts at wall-clock multiples of `W`. A bucket sized by
  `Bourse.RateLimiter.Limits` (`capacity + refill_per_sec * W <= share * limit`) may spend
  `B = capacity + refill_per_sec * W` per window, and the exchange admits `L` per window,
  so the bucket may still spend `min(B, L) - used` until the window ends in
  `W - rem(now, W)` ms; nothing new when that is negative, and no debt past the window,
  which the exchange forgets (bookings made before keep their turn: they were paid). Its own requests are in `used` and already gone from its tokens,
  so a correctly sized bucket alone on the counter is never lowered; what other programs
  on the IP or account spent is taken off. Its bookings due before the window ends are
  gone from its tokens but not yet in `used` (their requests are not sent yet): they take
  their part of the allowance as well, and those it cannot cover go out once the window
  ends. A bucket sized above the exchange's limit
  (`%{requests: 6000, period: 60_000}` may spend `B = 12_000` in one minute) is held to
  `L` as soon as a reply says how much of it is spent.

  A reply whose `Date` header falls in an earlier window than the current one (made just
  before the boundary, read just after it) counted `used` in a window that has ended: its
  used counters are not applied, so it does not hold the bucket through the new window.
  Pass the reply's `Date` with the other headers; without it a reading read in the first
  second of a window (the first tenth of a shorter one) is not applied, as it may be from
  the window before, and every other reading is taken as current.

  `L` is, for each used counter, the first of:

    1. the exchange's own, for that exchange id: set by
       `Bourse.RateLimiter.Limits.from_binance_exchange_info/2` with `exchange: id`
       (each `rateLimits` entry is the limit of its header), or by
       `put_header_limits/2`;
    2. `config :bourse, :header_limits, %{header => limit}` (`nil`: no limit known);
    3. for the exchange id of a profile of `Bourse.RateLimiter.Exchange`, its counters'
       limits (`"binance_usdm"`: 2,400 weight and 1,200 orders a minute, 300 orders in
       10 s);
    4. the default below: Binance spot's, as documented on
       <https://developers.binance.com/docs/binance-spot-api-docs/rest-api/limits> and
       <https://developers.binance.com/docs/products/caas/basics/4.rate-limits> (SAPI),
       and as the live `exchangeInfo` listed them on 6 November 2026 (the field report,
       docs/CONTRACT.md); read 2026-12-01. Other Binance markets count differently: use
       their profile's exchange id, load their `exchangeInfo`, or set their limits. A
       reply of another exchange id held to this default logs a warning, once per header.

  | header | default `L` |
  | --- | --- |
  | `x-mbx-used-weight-1m` | 6,000 (`REQUEST_WEIGHT`, 1 `MINUTE`) |
  | `x-sapi-used-ip-weight-1m` | 12,000 (each IP-limited SAPI endpoint) |
  | `x-sapi-used-uid-weight-1m` | 180,000 (each UID-limited SAPI endpoint) |
  | `x-mbx-order-count-10s` | 100 (`ORDERS`, 10 `SECOND`) |
  | `x-mbx-order-count-1m` | 1,200 (USD-M futures `ORDERS`, 1 `MINUTE`: spot has none) |
  | `x-mbx-order-count-1d` | 200,000 (`ORDERS`, 1 `DAY`) |

  **Limit and remaining** (Bybit, KuCoin, generic) give `limit` and `remaining`, so
  `used = limit - remaining`, and the allowance is `min(B, limit) - used`: never more
  than `remaining`. When the exchange's window is unknown (the generic headers, by
  default) `B` is taken as `limit` and the allowance is `remaining` itself; configure the
  window to keep the same room for other programs as the Binance headers do. The time
  left is `x-bapi-limit-reset-timestamp - now` (ms since the epoch; Bybit sends the
  current time while not limited: the allowance then holds right now) or
  `x-ratelimit-reset`: seconds until the reset (decimals allowed), from 1e9 up the reset
  time in seconds since the epoch, from 1e12 up in ms since the epoch; or
  `gw-ratelimit-reset`: ms until the reset. Without a reset header the allowance holds
  right now. The time left is capped at the window when known, else at one day.

  A 429 whose reply names no wait (no usable `Retry-After`, none in its body) waits until
  the reset one of these reset headers names, when it names one still to come (capped at
  its window when known, as above); else the backoff. A 418, a ban, is never shortened
  by one.

  ## Repeated and malformed headers

  A header given more than once (or as a list of values) is read the most cautious way:
  the longest `Retry-After`, the largest count used or limit, the smallest remaining, the
  latest reset or `Date`; a value it cannot use counts only when no other is usable. A
  number value (as a decoder may give it) is read as its text: `2.5` as `"2.5"`, `-2` as
  `"-2"` (for `Retry-After`, the 1 s floor). A list value is a list of values, but for
  character codes alone: a charlist, one value (as `:httpc` gives them).

  Malformed headers (not a list or map, an improper list, an entry that is not a
  `{name, value}` pair, a name that is not text, a value of a header read that is not
  text, a number or a list of them) answer `{:error, %Bourse.Error{type:
  :invalid_parameters}}` naming the first, and nothing is synced or started again. A
  limited reply (429, 418, a signal in the body) is still acted on, from the well-formed
  entries: its buckets are paused as above, and that error keeps the reply's
  `http_status`, `retry_after` and `stop`. Values of headers not read are not judged.

  ## Configuration

  The axis and window of each header can be changed, and used counters added, in the
  application environment. Keys are used-counter header names or the family names
  `"x-bapi-limit"`, `"x-ratelimit"` and `"gw-ratelimit"`; values are an axis,
  `{axis, window_ms}` (`window_ms` may be `nil` for the families) or `nil` to ignore the
  header:

      config :bourse, :header_axes, %{
        "x-mbx-used-weight-1m" => "weight",
        "x-ratelimit" => {"ip", 1_000},
        "x-used-weight" => {"ip", 1_000}
      }

  A new used-counter header needs a window. Its exchange limit, if any, goes in
  `:header_limits`:

      config :bourse, :header_limits, %{"x-used-weight" => 10, "x-mbx-used-weight-1m" => 2_400}
  """

  require Logger

  alias Bourse.{Error, Native, RateLimiter}
  alias Bourse.RateLimiter.{BodySignal, CallDeadline, Events, Exchange, Options, RetryAfter}
  alias Bourse.RateLimiter.Router

  @cap_ms 300_000
  # The shortest IP ban Binance documents ("from 2 minutes to 3 days").
  @unnamed_ban_ms 120_000
  @max_ban_ms 3 * 86_400_000
  @max_window_ms 86_400_000
  @beyond_any_count 1.0e15

  @used_counters %{
    "x-mbx-used-weight-1m" => {"ip", 60_000},
    "x-sapi-used-ip-weight-1m" => {"sapi_ip", 60_000},
    "x-sapi-used-uid-weight-1m" => {"sapi_uid", 60_000},
    "x-mbx-order-count-10s" => {"orders_10s", 10_000},
    "x-mbx-order-count-1m" => {"orders_1m", 60_000},
    "x-mbx-order-count-1d" => {"orders_1d", 86_400_000}
  }

  # The used counters that count the IP, not the account: `ip:` names their buckets.
  @ip_counters ["x-mbx-used-weight-1m", "x-sapi-used-ip-weight-1m"]

  # limit, remaining and reset header names, and how to read the reset.
  @families %{
    "x-bapi-limit" =>
      {"x-bapi-limit", "x-bapi-limit-status", "x-bapi-limit-reset-timestamp", :epoch_ms},
    "x-ratelimit" =>
      {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset", :seconds_or_epoch},
    "gw-ratelimit" =>
      {"gw-ratelimit-limit", "gw-ratelimit-remaining", "gw-ratelimit-reset", :ms_left}
  }

  # Of a repeated header, the smallest remaining and the latest reset are the cautious reading.
  @remaining_names for {_family, {_limit, remaining, _reset, _kind}} <- @families, do: remaining
  @reset_kinds Map.new(@families, fn {_family, {_limit, _remaining, reset, kind}} ->
                 {reset, kind}
               end)

  # The exchange's limit per window of each used counter: see the moduledoc.
  @default_header_limits %{
    "x-mbx-used-weight-1m" => 6_000,
    "x-sapi-used-ip-weight-1m" => 12_000,
    "x-sapi-used-uid-weight-1m" => 180_000,
    "x-mbx-order-count-10s" => 100,
    "x-mbx-order-count-1m" => 1_200,
    "x-mbx-order-count-1d" => 200_000
  }

  @default_axes Map.merge(@used_counters, %{
                  "x-bapi-limit" => {"request", 1_000},
                  "x-ratelimit" => {"request", nil},
                  "gw-ratelimit" => {"request", nil}
                })

  @typedoc "Reply headers: `{name, value}` pairs, or a map of name to value or values."
  @type headers :: [{String.t() | charlist(), String.t() | charlist() | number()}] | map()

  @doc """
  Sets the exchange's own limits per window for the used counters of `exchange_id`:
  `%{header => limit}` (names case-insensitive; `nil` forgets a limit set before). They
  take precedence over `config :bourse, :header_limits` and the defaults. They
  are kept for the life of the VM, for every limiter in it.

      Feedback.put_header_limits("binance_usdm", %{"x-mbx-used-weight-1m" => 2_400})
  """
  @spec put_header_limits(String.t(), %{String.t() => number() | nil}) ::
          :ok | {:error, Error.t()}
  def put_header_limits(exchange_id, limits) when is_binary(exchange_id) and is_map(limits) do
    with :ok <- check_credential(exchange_id, :public),
         {:ok, limits} <- Enum.reduce_while(limits, {:ok, %{}}, &header_limit/2) do
      merged =
        exchange_id
        |> header_limits()
        |> Map.merge(limits)
        |> Map.reject(fn {_header, limit} -> is_nil(limit) end)

      if merged != header_limits(exchange_id),
        do: :persistent_term.put({__MODULE__, :header_limits, exchange_id}, merged)

      :ok
    end
  end

  def put_header_limits(exchange_id, limits),
    do:
      invalid(
        "put_header_limits/2 takes an exchange id (a binary) and a map of header to limit, " <>
          "got #{Error.describe(exchange_id)} and #{Error.describe(limits)}"
      )

  defp header_limit({header, limit}, {:ok, acc}) when is_binary(header) do
    if is_nil(limit) or (is_number(limit) and limit > 0 and limit <= Native.bound(:max_amount)),
      do: {:cont, {:ok, Map.put(acc, String.downcase(header), limit)}},
      else: {:halt, bad_header_limit(header, limit)}
  end

  defp header_limit({header, limit}, _acc), do: {:halt, bad_header_limit(header, limit)}

  defp bad_header_limit(header, limit),
    do:
      invalid(
        "a header limit must be a header name => a positive number of at most " <>
          "#{Native.bound(:max_amount)} or nil, " <>
          "got #{Error.describe(header)} => #{Error.describe(limit)}"
      )

  # The limits set for one exchange.
  defp header_limits(exchange_id),
    do: :persistent_term.get({__MODULE__, :header_limits, exchange_id}, %{})

  # The exchange's limit of each used counter (`nil`: none known): see the moduledoc.
  defp exchange_limits(exchange_id) do
    with {:ok, configured} <- configured_header_limits() do
      {:ok,
       @default_header_limits
       |> Map.merge(Exchange.header_limits(exchange_id))
       |> Map.merge(configured)
       |> Map.merge(header_limits(exchange_id))}
    end
  end

  defp configured_header_limits do
    case Application.get_env(:bourse, :header_limits) do
      nil ->
        {:ok, %{}}

      limits when is_map(limits) ->
        case Enum.reduce_while(limits, {:ok, %{}}, &header_limit/2) do
          {:ok, limits} ->
            {:ok, limits}

          {:error, %Error{message: message}} ->
            invalid("config :bourse, :header_limits: " <> message)
        end

      other ->
        invalid("config :bourse, :header_limits must be a map, got #{Error.describe(other)}")
    end
  end

  @doc "See `Bourse.RateLimiter.observe_response/6`."
  @spec observe_response(
          String.t(),
          String.t() | :public,
          100..599,
          headers(),
          GenServer.name(),
          keyword()
        ) :: :ok | {:error, Error.t()}
  def observe_response(exchange_id, credential_key, status, headers, name, opts \\ []) do
    with {:ok, running} <- check_name(name),
         :ok <- check_credential(exchange_id, credential_key),
         :ok <- check_status(status),
         {:ok, given} <- options(opts, exchange_id, credential_key),
         {:ok, axes} <- axes(),
         axes = endpoint_axis(axes, given.endpoint),
         {:ok, limits} <- exchange_limits(exchange_id),
         {found, malformed} = collect(headers, wanted(axes)),
         :ok <- running(running, name),
         reply = {status, given.body, cautious(found)},
         counters = {axes, limits, given.definitions, given.ip},
         :ok <-
           CallDeadline.shared(fn ->
             record(exchange_id, credential_key, reply, counters, malformed, name)
           end) do
      :ok
    else
      {:error, %Error{} = error} -> {:error, Error.with_exchange(error, exchange_id)}
    end
  end

  # The reply's effects on the table; with a daemon or Redis, within one timeout. A limited
  # reply is acted on whatever became of the sync (a store down: its answer still says the
  # wait asked, and the pause is noted), and answers first. With malformed headers
  # (`malformed`, their description) nothing is synced or started again, but a limited
  # reply is still acted on, from the well-formed entries: the answer is then
  # `:invalid_parameters` (P5), with what the reply asked.
  defp record(exchange_id, credential, {status, body, found}, counters, malformed, name) do
    {axes, _limits, _definitions, ip} = counters

    synced =
      if malformed,
        do: invalid(malformed),
        else: sync_all(exchange_id, credential, found, counters, name)

    signal = BodySignal.find(exchange_id, status, body, found, System.os_time(:millisecond))
    # The waits its headers name: `Retry-After`, and for a 429 a limit family's reset.
    waits = {found["retry-after"], if(status == 429, do: reset_named(found, axes))}
    # A 429 that names no limit may be the credential's or the IP's: with `ip:` it holds
    # both, as requests sent through an IP during its Retry-After earn an IP ban.
    unnamed = if ip == credential, do: :credential, else: {:credential, ip}

    case limited(status, signal, unnamed) do
      nil when status in 200..299 and is_nil(malformed) ->
        reset = &RateLimiter.reset_backoff({exchange_id, &1}, name)
        with :ok <- each(Enum.uniq([credential, ip]), reset), do: synced

      nil ->
        synced

      limited ->
        exchange_id
        |> limit(credential, status, waits, limited, name)
        |> despite(malformed)
    end
  end

  # A limited reply acted on despite malformed headers: `:invalid_parameters`, keeping
  # the wait, status and stop of the answer.
  defp despite({:error, %Error{type: :rate_limit_exceeded} = error}, malformed)
       when is_binary(malformed),
       do:
         {:error,
          %{
            error
            | type: :invalid_parameters,
              message: "#{malformed}; acted on: #{error.message}"
          }}

  defp despite(answer, _malformed), do: answer

  defp options(opts, exchange_id, credential) do
    with :ok <-
           Options.known_options(
             opts,
             "option",
             [:body, :limits, :axis, :ip],
             ":body, :limits, :axis or :ip"
           ),
         {:ok, body} <- body(Keyword.get(opts, :body)),
         {:ok, definitions} <-
           definitions(Keyword.get(opts, :limits, %{}), exchange_id, credential),
         {:ok, endpoint} <- endpoint(Keyword.get(opts, :axis), exchange_id, credential),
         {:ok, ip} <- ip(Keyword.get(opts, :ip, credential), exchange_id) do
      {:ok, %{body: body, definitions: definitions, endpoint: endpoint, ip: ip}}
    else
      {:error, %Error{}} = error -> error
      {:error, message} -> invalid(message)
    end
  end

  # `limits:` – the definitions of the credential's buckets by axis, as the adapter
  # passes them to its checks (any form of a limit): header sync then reads no definition
  # from the table. Each axis and definition is held to the rules of every check
  # (`Bourse.Native`), and the definition taken as capacity and refill.
  defp definitions(limits, exchange_id, credential)
       when is_map(limits) and not is_struct(limits) do
    Enum.reduce_while(limits, {:ok, %{}}, fn {axis, definition}, {:ok, definitions} ->
      case definition(exchange_id, credential, axis, definition) do
        {:ok, definition} -> {:cont, {:ok, Map.put(definitions, axis, definition)}}
        error -> {:halt, error}
      end
    end)
  end

  defp definitions(other, _exchange_id, _credential),
    do: invalid("limits must be a map of axis => limit, got #{Error.describe(other)}")

  defp definition(exchange_id, credential, axis, definition) do
    with :ok <- native(Native.check_key({exchange_id, credential, axis}), "limits: "),
         do: native(Native.limit_definition(definition), "limits: ")
  end

  # `axis:` – the axis of the reply's endpoint, held to the key rules of every check.
  defp endpoint(nil, _exchange_id, _credential), do: {:ok, nil}

  defp endpoint(axis, exchange_id, credential) do
    with :ok <- native(Native.check_key({exchange_id, credential, axis}), "axis: "),
         do: {:ok, axis}
  end

  # `ip:` – the credential part of the buckets of the IP the reply came from.
  defp ip(ip, exchange_id) do
    with :ok <- native(Native.check_key({exchange_id, ip}), "ip: "), do: {:ok, ip}
  end

  # The limit-and-remaining headers describe the endpoint of the reply: given its axis,
  # they sync that bucket, in the window configured for them.
  defp endpoint_axis(axes, nil), do: axes

  defp endpoint_axis(axes, endpoint) do
    Enum.reduce(Map.keys(@families), axes, fn family, axes ->
      case axes do
        %{^family => {_axis, window_ms}} -> Map.put(axes, family, {endpoint, window_ms})
        _ignored -> axes
      end
    end)
  end

  # The answer of a rule of the core, as every call gives it.
  defp native({:error, message, exchange}, prefix),
    do: {:error, Error.with_exchange(Error.invalid(prefix <> message), exchange)}

  defp native(valid, _prefix), do: valid

  defp body(body) when is_nil(body) or is_binary(body) or is_map(body) or is_list(body),
    do: {:ok, body}

  defp body(other),
    do:
      invalid(
        "body must be a binary, a decoded JSON map or list, or nil, got #{Error.describe(other)}"
      )

  # A name of anything but a limiter is refused before the input is judged (that process
  # is never called); a limiter that is not running exits the caller after (`running/2`),
  # whatever the response.
  # A name that reaches no limiter (none runs, or its node did not answer within the remote
  # timeout) exits as a call would, once the input is judged; it is asked once, not again.
  defp check_name(name) do
    case Router.route(name) do
      {:invalid, message} -> invalid(message)
      :noproc -> {:ok, {:absent, :noproc}}
      {:exit, reason} -> {:ok, {:absent, reason}}
      _reachable -> {:ok, :running}
    end
  end

  defp running(:running, _name), do: :ok
  defp running({:absent, reason}, name), do: Router.exit_as_call(reason, name)

  # The key-part rules of every call, from the core.
  defp check_credential(exchange_id, credential_key),
    do: native(Native.check_key({exchange_id, credential_key}), "")

  defp check_status(status) when is_integer(status) and status in 100..599, do: :ok

  defp check_status(status),
    do: invalid("status must be an HTTP status code (100..599), got #{Error.describe(status)}")

  ## 429, 418, body signals and backoff

  # What a reply asks: `{scope, stop, wait named in the body, reason}`, or `nil`; `unnamed`
  # is the scope of a 429 that names no limit.
  defp limited(418, signal, _unnamed),
    do: {:exchange, true, signal[:wait_ms], signal[:reason]}

  defp limited(429, nil, unnamed), do: {unnamed, false, nil, nil}
  defp limited(_status, nil, _unnamed), do: nil

  defp limited(_status, %{scope: :unnamed} = signal, unnamed),
    do: {unnamed, signal.stop, signal.wait_ms, signal.reason}

  defp limited(_status, signal, _unnamed),
    do: {signal.scope, signal.stop, signal.wait_ms, signal.reason}

  defp limit(exchange_id, credential, status, waits, {scope, stop, named_ms, reason}, name) do
    {retry_after, reset_ms} = waits
    asked = retry_after |> asked(named_ms || reset_ms) |> at_least_a_ban(stop)

    case hold(asked, {exchange_id, credential}, scope, name) do
      {:ok, wait, why} ->
        stop = stop or why == :ban

        Events.emit(name, :rate_limited, %{retry_after_ms: wait}, %{
          exchange: exchange_id,
          credential: credential,
          axis: nil,
          http_status: status,
          stop: stop,
          signal: reason
        })

        {:error,
         Error.rate_limited(wait,
           exchange: exchange_id,
           http_status: status,
           stop: stop,
           message:
             "#{exchange_id}: HTTP #{status}, " <>
               if(reason, do: "#{reason}, ", else: "") <>
               describe(why, wait) <> if(stop, do: "; stop: do not retry", else: "")
         )}

      # Not recorded: the caller still learns what the reply asked, to hold off itself.
      {:error, %Error{type: :unavailable} = error} ->
        {:error, unrecorded(error, asked, status, stop)}

      error ->
        error
    end
  end

  # The wait a reply asks for: Retry-After first, then a wait it names in its body
  # (`{:ok, ms, why}`); `:backoff` when it names none.
  defp asked(retry_after, named_ms) do
    case {RetryAfter.parse(retry_after, cap_ms: @cap_ms), named_ms} do
      {{:ok, ms}, _} -> {:ok, ms, :retry_after}
      {{:stop, ms}, _} -> {:ok, ms, :ban}
      {:error, nil} -> :backoff
      {:error, named_ms} -> named(RetryAfter.parse(named_ms / 1000, cap_ms: @cap_ms))
    end
  end

  # A ban that names no usable wait holds for the shortest ban, not a backoff from 1 s:
  # requests sent into a ban lengthen it.
  defp at_least_a_ban(:backoff, true), do: {:ok, @unnamed_ban_ms, :unnamed_ban}
  defp at_least_a_ban(asked, _stop), do: asked

  defp named({:ok, ms}), do: {:ok, ms, :named}
  defp named({:stop, ms}), do: {:ok, ms, :ban}

  # Pauses `scope` (the credential's buckets, with the IP's for `{:credential, ip}`, or the
  # exchange's) for the wait asked, or for the backoff the limiter counts. Returns the
  # wait and where it came from.
  defp hold({:ok, ms, why}, credential, scope, name) do
    # The time asked, as long as `Process.sleep/1` takes (a header may ask for 1e308 s).
    paused = each(targets(credential, scope), &RateLimiter.pause(&1, min(ms, @max_ban_ms), name))
    with :ok <- paused, do: {:ok, min(ms, Native.bound(:max_ms)), why}
  end

  defp hold(:backoff, credential, scope, name), do: backoff(credential, scope, name)

  defp unrecorded(error, asked, status, stop) do
    {retry_after, stop} =
      case asked do
        {:ok, ms, why} -> {min(ms, Native.bound(:max_ms)), stop or why == :ban}
        :backoff -> {nil, stop}
      end

    %{
      error
      | message: "#{error.message}; the HTTP #{status} reply was not (wholly) recorded",
        retry_after: retry_after,
        http_status: status,
        stop: stop
    }
  end

  # A 429 that may be the IP's is counted for the IP's buckets, which it pauses (keys
  # sharing the IP share the count); the credential's are held as long.
  defp backoff({exchange_id, _} = credential, {:credential, ip}, name) do
    with {:ok, ms, why} <- backoff({exchange_id, ip}, :credential, name),
         :ok <- RateLimiter.pause(credential, ms, name),
         do: {:ok, ms, why}
  end

  defp backoff(credential, scope, name) do
    case RateLimiter.back_off(credential, scope, name) do
      ms when is_integer(ms) -> {:ok, ms, :backoff}
      error -> error
    end
  end

  defp targets({exchange_id, _credential}, :exchange), do: [exchange_id]
  defp targets(credential, :credential), do: [credential]
  defp targets({exchange_id, credential}, {:axis, axis}), do: [{exchange_id, credential, axis}]

  defp targets({exchange_id, _} = credential, {:credential, ip}),
    do: [credential, {exchange_id, ip}]

  # `call` on each item in turn, up to the first that is not `:ok`, which is returned.
  defp each(items, call) do
    Enum.reduce_while(items, :ok, fn item, :ok ->
      case call.(item) do
        :ok -> {:cont, :ok}
        error -> {:halt, error}
      end
    end)
  end

  defp describe(:retry_after, ms), do: "Retry-After #{ms} ms"

  defp describe(:ban, ms) do
    # `ms` is the time asked, as far as `retry_after` holds it.
    asked = if ms < Native.bound(:max_ms), do: "#{ms} ms", else: "#{ms} ms or more"
    "asked to wait #{asked}, longer than the #{@cap_ms} ms cap"
  end

  defp describe(:backoff, ms), do: "no usable Retry-After: backing off #{ms} ms"
  defp describe(:named, ms), do: "the reply asks to wait #{ms} ms"

  defp describe(:unnamed_ban, ms),
    do: "a ban that names no usable wait: pausing #{ms} ms, the shortest IP ban Binance documents"

  ## Header sync

  defp sync_all(exchange_id, credential, found, {axes, limits, definitions, ip}, name) do
    Enum.each(@default_header_limits, fn {header, _limit} ->
      if Map.has_key?(found, header), do: warn_if_defaulted(exchange_id, header)
    end)

    Enum.reduce_while(axes, :ok, fn {header, {axis, window_ms}}, :ok ->
      key = {exchange_id, if(header in @ip_counters, do: ip, else: credential), axis}
      counter = {window_ms, limits[header], definitions[axis]}

      case sync_one(header, key, counter, found, name) do
        {:error, %Error{}} = error -> {:halt, error}
        _synced_or_skipped -> {:cont, :ok}
      end
    end)
  end

  defp sync_one(header, key, {window_ms, exchange_limit, definition}, found, name) do
    case @families do
      %{^header => {limit_name, remaining_name, reset_name, reset_kind}} ->
        with {:ok, limit} when limit > 0 <- number(found[limit_name]),
             {:ok, remaining} <- number(found[remaining_name]),
             %{capacity: capacity, refill_per_sec: refill} <- definition(definition, key, name) do
          budget = if window_ms, do: min(capacity + refill * window_ms / 1000, limit), else: limit
          left = reset_left(found[reset_name], reset_kind, window_ms || @max_window_ms)
          sync(key, budget - (limit - min(remaining, limit)), left, name)
        end

      _used_counter ->
        now = System.os_time(:millisecond)

        with {:ok, used} <- number(found[header]),
             false <- ended_window?(found["date"], window_ms, now),
             %{capacity: capacity, refill_per_sec: refill} <- definition(definition, key, name) do
          budget = capacity + refill * window_ms / 1000
          budget = if exchange_limit, do: min(budget, exchange_limit), else: budget
          left = window_ms - rem(now, window_ms)
          sync(key, budget - used, left, name)
        end
    end
  end

  # Another Binance market than spot whose limit of a used counter is Binance spot's
  # default, no profile, configuration or `put_header_limits/2` naming its own: said once
  # per header in the VM's life (a few terms kept, whatever the ids), as it may be higher
  # than the market's own. The first replies read at once take a lock (on this node), so
  # that only one of them says it.
  defp warn_if_defaulted("binance", _header), do: :ok

  defp warn_if_defaulted(exchange_id, header) do
    warned = {__MODULE__, :defaulted, header}

    unless :persistent_term.get(warned, false) or own_limit?(exchange_id, header) do
      :global.trans({warned, self()}, fn -> warn_once(warned, exchange_id, header) end, [node()])
    end

    :ok
  end

  defp warn_once(warned, exchange_id, header) do
    unless :persistent_term.get(warned, false) do
      :persistent_term.put(warned, true)

      Logger.warning(
        "#{exchange_id}: #{header} is held to Binance spot's limit " <>
          "(#{@default_header_limits[header]}), none being set for this exchange id: " <>
          "load its exchangeInfo (Limits.from_binance_exchange_info/2, exchange: " <>
          "#{inspect(exchange_id)}), use its profile's id, or set it (put_header_limits/2)"
      )
    end
  end

  defp own_limit?(exchange_id, header) do
    Map.has_key?(Exchange.header_limits(exchange_id), header) or
      Map.has_key?(header_limits(exchange_id), header) or
      Map.has_key?(Application.get_env(:bourse, :header_limits) || %{}, header)
  end

  # Whether a reply's `Date` puts it in a window of the counter that has ended: its
  # `used` was counted there, and the exchange has forgotten that window (a reply made
  # just before the boundary and read just after it would otherwise hold the bucket
  # through the whole new window). `Date` has whole seconds, never later than when the
  # reply was made, so a reply made in the current window is never taken for an old one.
  # Without a readable `Date`, a reading read early in a window (its first second, its
  # first tenth when shorter) may be from the window before: it is not applied.
  defp ended_window?(date, window_ms, now) do
    case RetryAfter.http_date_ms(date) do
      {:ok, made} -> div(made, window_ms) < div(now, window_ms)
      :error -> rem(now, window_ms) < min(1_000, div(window_ms, 10))
    end
  end

  # The bucket's definition: given, or read from the table (`nil` when it holds none).
  defp definition(nil, key, name) do
    case RateLimiter.inspect_key(key, name) do
      %{limit: limit} -> limit
      other -> other
    end
  end

  defp definition(given, _key, _name), do: given

  defp sync(key, allowance, left, name) do
    # The core's bound on amounts; allowances beyond it mean nothing anyway.
    max_amount = Native.bound(:max_amount)
    allowance = allowance |> max(-max_amount) |> min(max_amount)
    RateLimiter.sync(key, allowance, left, name)
  end

  # The wait until the first reset a limit family read (`axes`) names, capped at its window
  # when known as its syncs are (`nil` for none): what a 429 waits without a `Retry-After`
  # or a wait named in its body.
  defp reset_named(found, axes) do
    Enum.find_value(@families, fn {family, {_limit, _remaining, reset_name, kind}} ->
      with {_axis, window_ms} <- axes[family],
           left when left > 0 <- reset_left(found[reset_name], kind, window_ms || @max_window_ms) do
        left
      else
        _ -> nil
      end
    end)
  end

  defp reset_left(nil, _kind, _max), do: 0

  defp reset_left(text, kind, max) do
    now = System.os_time(:millisecond)

    left =
      case {number(text), kind} do
        {{:ok, epoch_ms}, :epoch_ms} -> epoch_ms - now
        {{:ok, ms}, :ms_left} -> ms
        {{:ok, epoch_ms}, :seconds_or_epoch} when epoch_ms >= 1.0e12 -> epoch_ms - now
        {{:ok, seconds}, :seconds_or_epoch} when seconds >= 1.0e9 -> seconds * 1000 - now
        {{:ok, seconds}, :seconds_or_epoch} -> seconds * 1000
        _unusable -> 0
      end

    left |> round() |> max(0) |> min(max)
  end

  # Counts and times as exchanges send them: unsigned decimals; one of more than 15 digits
  # is beyond any count or time an exchange sends (and parsing it whole would cost), so
  # taken as 1.0e15, which holds a bucket as long as the largest does.
  defp number(text) when is_binary(text) do
    case Regex.run(~r/\A\s*(\d+)(\.\d{1,9})?\s*\z/, text) do
      [_, int | _frac] when byte_size(int) > 15 -> {:ok, @beyond_any_count}
      [_, int] -> {:ok, String.to_integer(int)}
      [_, int, frac] -> {:ok, String.to_float(int <> frac)}
      nil -> :error
    end
  end

  defp number(_missing), do: :error

  ## Headers

  defp axes do
    case Application.get_env(:bourse, :header_axes) do
      nil ->
        {:ok, @default_axes}

      overrides when is_map(overrides) ->
        Enum.reduce_while(overrides, {:ok, @default_axes}, &axis/2)

      other ->
        invalid("config :bourse, :header_axes must be a map, got #{Error.describe(other)}")
    end
  end

  defp axis({header, setting}, {:ok, axes}) when is_binary(header) do
    header = String.downcase(header)
    known = Map.get(@default_axes, header)

    case {setting, known} do
      {nil, _} ->
        {:cont, {:ok, Map.delete(axes, header)}}

      {axis, {_, window}} when is_binary(axis) ->
        {:cont, {:ok, Map.put(axes, header, {axis, window})}}

      {{axis, window}, _} when is_binary(axis) and is_integer(window) and window > 0 ->
        {:cont, {:ok, Map.put(axes, header, {axis, window})}}

      {{axis, nil}, _} when is_binary(axis) and is_map_key(@families, header) ->
        {:cont, {:ok, Map.put(axes, header, {axis, nil})}}

      _ ->
        {:halt, bad_axis(header, setting)}
    end
  end

  defp axis({header, setting}, _acc), do: {:halt, bad_axis(header, setting)}

  defp bad_axis(header, setting) do
    invalid(
      "config :bourse, :header_axes: #{Error.describe(header)} => #{Error.describe(setting)} is not " <>
        "an axis, {axis, window_ms} or nil (a new used-counter header needs a window)"
    )
  end

  # The lower-case header names the axes read.
  defp wanted(axes) do
    Enum.reduce(axes, MapSet.new(["retry-after", "date"]), fn
      {header, _}, names ->
        case @families do
          %{^header => {limit, remaining, reset, _}} ->
            Enum.into([limit, remaining, reset], names)

          _ ->
            MapSet.put(names, header)
        end
    end)
  end

  # `{%{lower-case name => [value]}, malformed}` of the wanted headers: every value of a
  # repeated header, and the first malformed entry described (`nil` for none). A malformed
  # entry is left out and the others read, up to an improper tail.
  defp collect(headers, wanted) when is_map(headers),
    do: pairs(Map.to_list(headers), wanted, %{}, nil)

  defp collect(headers, wanted) when is_list(headers), do: pairs(headers, wanted, %{}, nil)

  defp collect(headers, _wanted),
    do: {%{}, "headers must be a list of {name, value} or a map, got #{Error.describe(headers)}"}

  defp pairs([], _wanted, found, malformed), do: {found, malformed}

  # The value of a header that is not read is not judged (a map, say); a malformed entry
  # is described and left out, so that the reply's status is acted on all the same.
  defp pairs([{name, value} = header | rest], wanted, found, malformed) do
    with {:ok, name} <- text(name),
         name = String.downcase(name),
         {:ok, values} <- if(MapSet.member?(wanted, name), do: values(value), else: {:ok, []}) do
      found = Enum.reduce(values, found, fn value, found -> add(found, name, value) end)
      pairs(rest, wanted, found, malformed)
    else
      :error -> pairs(rest, wanted, found, malformed || bad_header(header))
    end
  end

  defp pairs([other | rest], wanted, found, malformed),
    do: pairs(rest, wanted, found, malformed || bad_header(other))

  defp pairs(_improper, _wanted, found, malformed),
    do: {found, malformed || "headers must be a proper list"}

  defp add(found, name, value), do: Map.update(found, name, [value], &[value | &1])

  defp bad_header(header) do
    got =
      case header do
        {name, value} -> "{#{Error.describe(name)}, #{Error.describe(value)}}"
        other -> Error.describe(other)
      end

    "headers must be {name, value}: binaries or charlists, a value also a number " <>
      "or a list of them, got #{got}"
  end

  # A list of values, but for a charlist (character codes alone), one value: :httpc gives
  # values as charlists.
  defp values(values) when is_list(values) do
    if charlist?(values), do: one_value(values), else: values(values, [])
  end

  defp values(value), do: one_value(value)

  defp one_value(value) do
    with {:ok, text} <- value(value), do: {:ok, [text]}
  end

  defp values([], texts), do: {:ok, texts}

  defp values([value | rest], texts) do
    with {:ok, text} <- value(value), do: values(rest, [text | texts])
  end

  defp values(_improper, _texts), do: :error

  defp charlist?([]), do: true
  defp charlist?([code | rest]) when is_integer(code) and code in 0..0x10FFFF, do: charlist?(rest)
  defp charlist?(_other), do: false

  # A count or a number of seconds as a decoder may give it is read as its text would be.
  defp value(value) when is_integer(value), do: {:ok, Integer.to_string(value)}
  defp value(value) when is_float(value), do: {:ok, Float.to_string(value)}
  defp value(value), do: text(value)

  # One value per header: of a repeated one's, the most cautious reading (the longest
  # Retry-After, the latest Date, the largest count used or limit, the smallest remaining,
  # the latest reset), an unusable value only when no other is usable.
  defp cautious(found),
    do: Map.new(found, fn {name, values} -> {name, cautious(name, values)} end)

  defp cautious(_name, [value]), do: value
  defp cautious(name, values), do: Enum.max_by(values, &caution(name, &1))

  # `{1, rank}` of a usable value, the most cautious ranking highest; `{0, 0}` otherwise.
  defp caution("retry-after", value) do
    case RetryAfter.parse(value) do
      {_ok_or_stop, ms} -> {1, ms}
      :error -> {0, 0}
    end
  end

  defp caution("date", value) do
    case RetryAfter.http_date_ms(value) do
      {:ok, ms} -> {1, ms}
      :error -> {0, 0}
    end
  end

  defp caution(name, value) when is_map_key(@reset_kinds, name),
    do: {1, reset_left(value, @reset_kinds[name], @max_window_ms)}

  defp caution(name, value) do
    case number(value) do
      {:ok, n} when name in @remaining_names -> {1, -n}
      {:ok, n} -> {1, n}
      :error -> {0, 0}
    end
  end

  defp text(text) when is_binary(text), do: {:ok, String.trim(text)}

  defp text(chars) when is_list(chars) do
    case :unicode.characters_to_binary(chars) do
      text when is_binary(text) -> {:ok, String.trim(text)}
      _ -> :error
    end
  rescue
    ArgumentError -> :error
  end

  defp text(_other), do: :error

  defp invalid(message), do: {:error, Error.invalid(message)}
end
