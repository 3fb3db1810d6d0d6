defmodule Bourse.RateLimiter do
  @moduledoc """
  Per-credential, weighted token-bucket rate limiter for exchange API requests.

  Each `{exchange_id, credential_key, bucket_axis}` key holds a bucket of `capacity`
  tokens refilling at `refill_per_sec`. A request of cost `c` is admitted when the bucket
  holds `c`; otherwise the answer is how long to wait. Costs above the capacity are
  limited, not exempt: they wait until that much has accrued, then leave the bucket empty.

  ## Keys

    * `exchange_id` – a binary such as `"binance"`;
    * `credential_key` – the API key (a binary), or `:public` for the shared pool of
      unauthenticated requests;
    * `bucket_axis` – the counter the exchange keeps (`"request"`, `"ip"`, `"uid"`,
      `"order_weight"`, ...). `{exchange_id, credential_key}` means axis `"request"`.

  ## Limits

    * `%{capacity: c, refill_per_sec: r}`;
    * `%{requests: n, period: ms}` – the same as `%{capacity: n, refill_per_sec: n / (ms / 1000)}`;
    * `%{requests: n}` – a period of one second;
    * `nil` – no limit: validated, then `:ok` without recording anything.

  See `Bourse.RateLimiter.Limits` to size buckets from an exchange's published limits.

  ## Probes and waiters

  `check_rate/4` and `check_rates/3` without `:max_wait_ms` are *probes*: a delay pays
  nothing and reserves nothing. `wait_for_capacity/5` and `check_rates/3` with
  `:max_wait_ms` are *waiters*: a delay within the budget *books* the cost at once, so
  later callers queue behind it and cheap traffic cannot starve a heavy call. The same
  process coming back with the same checks at the ready time is admitted against its
  booking without a second charge. A booking not claimed within `:booking_slack_ms` of its
  ready time lapses; its cost stays paid.

  ## Usage

      children = [{Bourse.RateLimiter, name: MyApp.Limiter}]
      Supervisor.start_link(children, strategy: :one_for_one)

      key = {"okx", api_key, "request"}

      case Bourse.RateLimiter.check_rate(key, %{capacity: 1, refill_per_sec: 9.09}, 1, MyApp.Limiter) do
        :ok -> make_request()
        {:delay, ms} -> Process.sleep(ms) && make_request()
      end

  Local callers reach the bucket table from their own process (no mailbox on the hot
  path). `{:global, _}`, `{:via, _, _}` and `{name, node}` names on other nodes go through
  the limiter process.

  ## Observing

  `inspect_key/2` shows one bucket, `stats/1` the limiter's counters, `busiest/2` (and
  `mix bourse.top`) the keys closest to their limits. Refusals, bookings, waits, lapses
  and pauses are emitted as events (`Bourse.RateLimiter.Events`) to an `:on_event`
  callback and to `:telemetry` when it is loaded. API keys never appear in any of them:
  a credential is shown as its fingerprint (`Bourse.Fingerprint`).

  ## Errors

  Malformed input (keys, limits, costs, options, names) is answered with
  `{:error, %Bourse.Error{type: :invalid_parameters, message: ...}}` naming what is wrong;
  nothing is paid and nothing crashes.
  """

  use GenServer

  alias Bourse.Error
  alias Bourse.RateLimiter.{Backend, Events, Feedback}

  @default __MODULE__
  @max_busiest 10_000

  @typedoc "Rate limiter key: `{exchange_id, api_key | :public, bucket_axis}`."
  @type key ::
          {String.t(), String.t() | :public, String.t()} | {String.t(), String.t() | :public}

  @typedoc "Token-bucket configuration."
  @type rate_limit ::
          %{capacity: number(), refill_per_sec: number()}
          | %{requests: number(), period: pos_integer()}
          | %{requests: number()}

  @typedoc "A single bucket check: `{key, rate_limit, cost}`."
  @type bucket_check :: {key(), rate_limit() | nil, number()}

  @typedoc "What `pause/3` holds: a full key, `{exchange_id, credential_key}` or an exchange id."
  @type pause_target :: key() | String.t()

  @type error :: {:error, Error.t()}

  @typedoc "A snapshot of one key: see `inspect_key/2`."
  @type key_info :: %{
          limit: %{capacity: float(), refill_per_sec: float()} | nil,
          tokens: float(),
          borrowed: float(),
          debt: float(),
          bookings: non_neg_integer(),
          booked_cost: float(),
          next_ready_ms: non_neg_integer() | nil,
          pause_ms: pos_integer() | nil
        }

  @backends %{nif: Backend.NIF, port: Backend.Port, daemon: Backend.Daemon, redis: Backend.Redis}

  ## Checks

  @doc """
  Checks if a request of `cost` can be made now.

  Returns `:ok` (paid) or `{:delay, ms}`: nothing paid; come back in `ms` milliseconds.
  """
  @spec check_rate(key(), rate_limit() | nil, number(), GenServer.name()) ::
          :ok | {:delay, pos_integer()} | error()
  def check_rate(key, limit, cost \\ 1, name \\ @default) do
    # The hot path: a direct call to the backend, no argument list built for `apply/3`.
    answer =
      case route(name) do
        {backend, handle, _events} ->
          backend.check_one(handle, self(), key, limit, cost, nil)

        elsewhere ->
          elsewhere(elsewhere, name, {:run, :check_one, [self(), key, limit, cost, nil]})
      end

    case answer do
      :ok -> :ok
      other -> observe(other, name, nil, fn -> %{key: key, cost: cost} end)
    end
  end

  @doc """
  Checks several buckets at once: all of them pay, or none does.

  Repeated checks of one key are charged once at their combined cost; two checks of one
  key with different definitions are `:invalid_parameters`. Returns `:ok`, or
  `{:delay, ms}` for the longest wait.

  With `max_wait_ms: budget` the caller is a waiter: a delay within the budget is booked
  (see the moduledoc) and the caller must come back after `ms`; a longer delay books
  nothing.
  """
  @spec check_rates([bucket_check()], GenServer.name() | keyword(), keyword()) ::
          :ok | {:delay, pos_integer()} | error()
  def check_rates(checks, name_or_opts \\ @default, opts \\ [])

  def check_rates(checks, opts, []) when is_list(opts), do: check_rates(checks, @default, opts)

  def check_rates(checks, name, opts) do
    with {:ok, max_wait} <- max_wait_option(opts, nil, name) do
      case run(name, :check_many, [self(), checks, max_wait]) do
        :ok -> :ok
        other -> observe(other, name, max_wait, fn -> Events.checks_metadata(checks) end)
      end
    end
  end

  # Emits the event a check's answer calls for (never for `:ok`) and shapes the answer.
  defp observe(answer, name, max_wait, metadata) do
    case answer do
      {:delay, ms} = delay ->
        if max_wait == nil, do: refused(name, ms, :delay, nil, metadata)
        delay

      {:booked, ms} ->
        Events.emit(name, :booked, %{delay_ms: ms}, metadata)
        {:delay, ms}

      {:over_budget, ms} ->
        refused(name, ms, :over_budget, max_wait, metadata)
        {:delay, ms}

      other ->
        answer(other)
    end
  end

  defp refused(name, ms, reason, max_wait, metadata) do
    Events.emit(name, :refused, %{delay_ms: ms}, fn ->
      Map.merge(metadata.(), %{reason: reason, max_wait_ms: max_wait})
    end)
  end

  @doc """
  Blocks the caller until the request is admitted, then returns `:ok`.

  The cost is booked at once (first come, first served); the caller sleeps in its own
  process, then claims the booking. When the wait would exceed `:max_wait_ms` (default
  `Bourse.Defaults.rate_limit_max_wait_ms/0`) it returns at once, paying nothing:
  `{:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: ms}}`.
  """
  @spec wait_for_capacity(
          key(),
          rate_limit() | nil,
          number(),
          GenServer.name() | keyword(),
          keyword()
        ) ::
          :ok | error()
  def wait_for_capacity(key, limit, cost \\ 1, name_or_opts \\ @default, opts \\ [])

  def wait_for_capacity(key, limit, cost, opts, []) when is_list(opts),
    do: wait_for_capacity(key, limit, cost, @default, opts)

  def wait_for_capacity(key, limit, cost, name, opts) do
    with {:ok, max_wait} <-
           max_wait_option(opts, Bourse.Defaults.rate_limit_max_wait_ms(), name) do
      await(name, [self(), key, limit, cost, max_wait], nil)
    end
  end

  # `since`: when the caller first slept (monotonic ms), `nil` until it does.
  defp await(name, [_owner, key, _limit, cost, max_wait] = args, since) do
    metadata = fn -> %{key: key, cost: cost} end

    case run(name, :check_one, args) do
      :ok when since == nil ->
        :ok

      :ok ->
        waited_ms = System.monotonic_time(:millisecond) - since
        Events.emit(name, :admitted_after_wait, %{waited_ms: waited_ms}, metadata)
        :ok

      {wait, ms} when wait in [:booked, :delay] ->
        if wait == :booked, do: Events.emit(name, :booked, %{delay_ms: ms}, metadata)
        since = since || System.monotonic_time(:millisecond)
        Process.sleep(ms)
        await(name, args, since)

      {:over_budget, ms} ->
        refused(name, ms, :over_budget, max_wait, metadata)

        {:error,
         Error.rate_limited(ms,
           exchange: exchange_of(key),
           message: "waiting would take #{ms} ms, more than max_wait_ms allows"
         )}

      other ->
        answer(other)
    end
  end

  ## Bookkeeping

  @doc """
  Tokens currently borrowed from the bucket: `capacity - tokens` after refill, larger
  than the capacity while in debt, `0` for an unknown key. `period` is ignored.
  """
  @spec get_cost(key(), term(), GenServer.name()) :: number() | error()
  def get_cost(key, _period, name \\ @default) do
    name |> run(:borrowed, [key]) |> answer()
  end

  @doc """
  Debits `cost` without checking: usage spent elsewhere. The bucket may go into debt; on
  a key without a definition yet, the debt waits for the key's first check.
  """
  @spec record_request(key(), number(), GenServer.name()) :: :ok | error()
  def record_request(key, cost \\ 1, name \\ @default) do
    name |> run(:record, [key, cost]) |> answer()
  end

  @doc "Forgets a key: it is as new, and its bookings are dropped."
  @spec reset(key(), GenServer.name()) :: :ok | error()
  def reset(key, name \\ @default), do: name |> run(:reset, [key]) |> answer()

  @doc "Forgets every key of one exchange; other exchanges are untouched."
  @spec reset_exchange(String.t(), GenServer.name()) :: :ok | error()
  def reset_exchange(exchange_id, name \\ @default),
    do: name |> run(:reset_exchange, [exchange_id]) |> answer()

  @doc "Forgets every key."
  @spec reset_all(GenServer.name()) :: :ok | error()
  def reset_all(name \\ @default), do: name |> run(:reset_all, []) |> answer()

  @doc """
  Holds every bucket of `target` for `ms` milliseconds, for every caller at once: probes
  answer the remaining pause, waiters book behind it. `target` is a full key,
  `{exchange_id, credential_key}` (every axis of that credential) or an exchange id.
  Overlapping pauses keep the later end.
  """
  @spec pause(pause_target(), non_neg_integer(), GenServer.name()) :: :ok | error()
  def pause(target, ms, name \\ @default) do
    with :ok <- name |> run(:pause, [target, ms]) |> answer() do
      Events.emit(name, :paused, %{ms: ms}, fn -> Events.describe_target(target) end)
    end
  end

  ## Observing

  @doc """
  Counters since the limiter's bucket table was created (they survive a restart of the
  limiter's process), and what it holds now:

    * `:admitted` – checks paid at once;
    * `:claimed` – waiters admitted against their booking;
    * `:delayed` – probes answered `{:delay, ms}`, and waiters that came back early;
    * `:booked` – waiters that booked their cost;
    * `:over_budget` – waiters refused because the wait exceeded `:max_wait_ms`;
    * `:lapsed` – bookings not claimed in time (counted when next looked at: at the
      latest by the next sweep);
    * `:paused` – answers held back by a pause;
    * `:debited` – `record_request/3` calls;
    * `:invalid` – calls refused as malformed (`:invalid_parameters`); with the port,
      daemon and Redis backends, terms that cannot even be sent to the daemon (a
      charlist credential, say) are refused before it and not counted;
    * `:event_failures` – `:on_event` callbacks that raised;
    * `:buckets`, `:bookings` – live buckets and bookings now.
  """
  @spec stats(GenServer.name()) :: %{atom() => non_neg_integer()} | error()
  def stats(name \\ @default) do
    case route(name) do
      {backend, handle, events} -> stats(backend, handle, events)
      elsewhere -> elsewhere(elsewhere, name, :stats)
    end
    |> answer()
  end

  defp stats(backend, handle, events) do
    case backend.stats(handle) do
      %{} = stats -> Map.merge(stats, Events.counts(events), fn _, table, own -> table + own end)
      error -> error
    end
  end

  @doc """
  The `count` (1 to #{@max_busiest}) busiest keys – most tokens borrowed, or holding
  bookings – busiest first. Each row has the fields of `inspect_key/2` and the key as
  `:exchange`, `:credential` (its fingerprint, `Bourse.Fingerprint.of/1`) and `:axis`.
  `mix bourse.top` prints them as a table.
  """
  @spec busiest(pos_integer(), GenServer.name()) :: [map()] | error()
  def busiest(count \\ 10, name \\ @default)

  def busiest(count, name) when is_integer(count) and count in 1..@max_busiest do
    with rows when is_list(rows) <- name |> run(:busiest, [count]) |> answer() do
      Enum.map(rows, fn {key, info} -> Map.merge(info, Events.describe_key(key)) end)
    end
  end

  def busiest(count, name) do
    count_invalid(name)

    {:error,
     Error.invalid("count must be an integer from 1 to #{@max_busiest}, got #{inspect(count)}")}
  end

  ## Exchange feedback

  @doc """
  The one call an adapter makes after every response from `exchange_id` made with
  `credential_key`. `headers` are `{name, value}` pairs or a map of name to value or list
  of values; names are case-insensitive; names and values may be binaries or charlists
  (as `:httpc` returns them). Options: `body:` the reply's body, a binary or the decoded
  JSON (map or list), for the rate-limit signals exchanges put there
  (`Bourse.RateLimiter.BodySignal`); `limits:` the credential's bucket definitions by
  axis (`%{"ip" => %{capacity: 480, refill_per_sec: 72}}`), which spares header sync a
  read of each definition from the table. Like `check_rates/3`, the name may be left out
  before the options: `observe_response("bybit", key, 200, headers, body: body)`.

  Used-weight headers (Binance `x-mbx-used-weight-1m`, Bybit `x-bapi-limit*`, generic
  `x-ratelimit-*`, ...) bring the bucket of the matching axis in line with what the
  exchange counted, within the exchange's own limit for that counter. After a 429, or a
  rate-limit signal in the body (Bybit `retCode` 10006 on an HTTP 200, ...), every bucket
  of the credential is paused for every caller (after a 418, an IP ban, or an IP-wide
  signal: every bucket of the exchange), for `Retry-After`, the wait the reply names, or
  an exponential backoff, and the answer is
  `{:error, %Bourse.Error{type: :rate_limit_exceeded, http_status: status, retry_after: ms}}`,
  with `stop: true` when retrying is pointless. Otherwise `:ok`. The rules are in
  `Bourse.RateLimiter.Feedback`.
  """
  @spec observe_response(
          String.t(),
          String.t() | :public,
          100..599,
          Feedback.headers(),
          GenServer.name() | keyword(),
          keyword()
        ) ::
          :ok | error()
  def observe_response(
        exchange_id,
        credential_key,
        status,
        headers,
        name_or_opts \\ @default,
        opts \\ []
      )

  def observe_response(exchange_id, credential_key, status, headers, opts, []) when is_list(opts),
    do: Feedback.observe_response(exchange_id, credential_key, status, headers, @default, opts)

  def observe_response(exchange_id, credential_key, status, headers, name, opts),
    do: Feedback.observe_response(exchange_id, credential_key, status, headers, name, opts)

  @doc """
  Brings `key`'s bucket in line with an exchange that allows only `allowance` more cost
  until its window ends in `window_left_ms`: the tokens are lowered so that they plus the
  refill until then fit the allowance; they are never raised. A key without a definition
  is left alone. Returns the tokens taken. `observe_response/6` calls it for the headers
  it knows; call it directly for others.
  """
  @spec sync(key(), number(), non_neg_integer(), GenServer.name()) :: number() | error()
  def sync(key, allowance, window_left_ms, name \\ @default),
    do: name |> run(:sync, [key, allowance, window_left_ms]) |> answer()

  @doc """
  A snapshot of one key, or `nil` when the limiter holds nothing for it (never seen, or
  dropped by the sweep once full and idle, when it behaves as a new full bucket):

    * `:limit` – the bucket definition `%{capacity: c, refill_per_sec: r}`; `nil` for a
      key that only has `record_request/3` debt;
    * `:tokens` – tokens now, negative while in debt;
    * `:borrowed` – what `get_cost/3` answers;
    * `:debt` – how far below zero the bucket is (or the pending debt of a key without a
      definition);
    * `:bookings`, `:booked_cost` – how many waiters' bookings the key holds, and their
      total cost;
    * `:next_ready_ms` – milliseconds until the earliest booking is ready (`nil` without
      bookings);
    * `:pause_ms` – milliseconds left of a pause covering the key (`nil` when none).
  """
  @spec inspect_key(key(), GenServer.name()) :: key_info() | nil | error()
  def inspect_key(key, name \\ @default), do: name |> run(:inspect, [key]) |> answer()

  ## Supervision

  @doc """
  A child specification; the child id is the limiter's name.
  """
  @spec child_spec(keyword()) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{id: Keyword.get(opts, :name, @default), start: {__MODULE__, :start_link, [opts]}}
  end

  @doc """
  Starts a limiter.

  Options:

    * `:name` – a `GenServer.name()`, default `Bourse.RateLimiter`;
    * `:backend` – where the buckets live:
      * `:nif` (default) – in this VM, behind a NIF;
      * `:port` – in a `bourse_daemon` process run as an Erlang port
        (`Bourse.RateLimiter.Backend.Port`);
      * `{:daemon, address}` or `{:daemon, address, opts}` – in a `bourse_daemon` server
        shared with other OS processes and programs, at `"127.0.0.1:PORT"` or
        `{:unix, path}` (`Bourse.RateLimiter.Backend.Daemon`);
      * `{:redis, url}` or `{:redis, url, opts}` – in Redis, shared by limiters on every
        machine using that server (`Bourse.RateLimiter.Backend.Redis`);
    * `:assume_busy_at_start` – buckets first seen within their fill time after start
      begin as if they had been empty at start (default `false`);
    * `:booking_slack_ms` – how long a booking may be claimed after its ready time
      (default `Bourse.Defaults.booking_slack_ms/0`);
    * `:sweep_interval_ms` – how often full idle buckets are dropped (default 1000);
    * `:on_event` – a function `fn event, measurements, metadata -> ... end` or
      `{module, function, extra_args}` called with every event the limiter emits (see
      `Bourse.RateLimiter.Events`).

  The bucket table outlives a crash of the limiter's process: the restarted process,
  started with the same name, re-attaches to it, so spent tokens stay spent.
  """
  @spec start_link(keyword()) :: GenServer.on_start() | error()
  def start_link(opts \\ []) do
    with {:ok, config} <- config(opts) do
      GenServer.start_link(__MODULE__, config, name: config.name)
    end
  end

  @impl true
  def init(config) do
    slot = {__MODULE__, config.name}

    {previous, previous_events} =
      case :persistent_term.get(slot, nil) do
        {backend, handle, events} when backend == config.backend -> {handle, events}
        _ -> {nil, nil}
      end

    case config.backend.attach(previous, Map.to_list(config)) do
      {:ok, handle} ->
        events = Events.new(config.name, config.on_event, previous_events)
        # What callers read on every check: `route/1`.
        entry = {config.backend, handle, events}
        if :persistent_term.get(slot, nil) !== entry, do: :persistent_term.put(slot, entry)
        schedule_sweep(config)

        {:ok,
         Map.merge(config, %{
           handle: handle,
           events: events,
           lapsed: lapsed(config.backend, handle, events)
         })}

      {:error, reason} ->
        {:stop, reason}
    end
  end

  @impl true
  def handle_call({:run, fun, args}, _from, state) do
    {:reply, apply(state.backend, fun, [state.handle | args]), state}
  catch
    # Should a caller's request crash this process, its crash report must not show the
    # caller's key (an API key) in the stacktrace's arguments.
    kind, reason -> :erlang.raise(kind, reason, without_arguments(__STACKTRACE__))
  end

  def handle_call(:stats, _from, state) do
    {:reply, stats(state.backend, state.handle, state.events), state}
  end

  # Events and counts of callers that reach this limiter through its process.
  @impl true
  def handle_cast({:emit, event, measurements, metadata}, state) do
    Events.dispatch(state.events, event, measurements, metadata)
    {:noreply, state}
  end

  def handle_cast(:count_invalid, state) do
    Events.count_invalid(state.events)
    {:noreply, state}
  end

  # A crash report does not show the arguments of the last request either (OTP 25 formats
  # gen_server crash reports with format_status/1).
  @doc false
  def format_status(status), do: Map.replace_lazy(status, :message, &redact_request/1)

  defp redact_request({:"$gen_call", from, request}),
    do: {:"$gen_call", from, redact_request(request)}

  defp redact_request({:run, fun, args}) when is_list(args), do: {:run, fun, length(args)}
  defp redact_request(request), do: request

  defp without_arguments(stacktrace) do
    Enum.map(stacktrace, fn
      {module, fun, args, location} when is_list(args) -> {module, fun, length(args), location}
      entry -> entry
    end)
  end

  @impl true
  def handle_info(:sweep, state) do
    state.backend.sweep(state.handle)
    schedule_sweep(state)
    {:noreply, report_lapses(state)}
  end

  # The table counts lapsed bookings when it next looks at them (the sweep looks at all);
  # the difference since the last sweep is one `:lapsed` event.
  defp report_lapses(%{lapsed: before} = state) do
    case lapsed(state.backend, state.handle, state.events) do
      now when is_integer(now) and is_integer(before) and now > before ->
        Events.dispatch(state.events, :lapsed, %{count: now - before}, %{})
        %{state | lapsed: now}

      now ->
        %{state | lapsed: now || before}
    end
  end

  # The table's lapse counter, read only when someone listens.
  defp lapsed(backend, handle, events) do
    with true <- Events.listening?(events),
         %{lapsed: lapsed} <- backend.stats(handle) do
      lapsed
    else
      _ -> nil
    end
  end

  defp schedule_sweep(config), do: Process.send_after(self(), :sweep, config.sweep_interval_ms)

  defp config(opts) do
    with true <- Keyword.keyword?(opts) || {:error, "options must be a keyword list"},
         {:ok, name} <- name_option(Keyword.get(opts, :name, @default)),
         {:ok, backend, backend_opts} <- backend_option(Keyword.get(opts, :backend, :nif)),
         {:ok, busy} <- boolean_option(opts, :assume_busy_at_start, false),
         {:ok, slack} <-
           integer_option(opts, :booking_slack_ms, Bourse.Defaults.booking_slack_ms(), 0),
         {:ok, sweep} <- integer_option(opts, :sweep_interval_ms, 1000, 1),
         {:ok, on_event} <- on_event_option(Keyword.get(opts, :on_event)) do
      {:ok,
       %{
         name: name,
         backend: backend,
         backend_opts: backend_opts,
         assume_busy_at_start: busy,
         booking_slack_ms: slack,
         sweep_interval_ms: sweep,
         on_event: on_event
       }}
    else
      {:error, message} -> {:error, Error.invalid(message)}
    end
  end

  defp name_option(name) when is_atom(name) and not is_nil(name), do: {:ok, name}
  defp name_option({:global, _} = name), do: {:ok, name}
  defp name_option({:via, module, _} = name) when is_atom(module), do: {:ok, name}

  defp name_option(other),
    do:
      {:error,
       "name must be an atom, {:global, term} or {:via, module, term}, got #{inspect(other)}"}

  defp backend_option({:daemon, address}), do: backend_option({:daemon, address, []})

  defp backend_option({:daemon, address, opts}) do
    with {:ok, daemon_opts} <- @backends.daemon.options(address, opts),
         do: {:ok, @backends.daemon, daemon_opts}
  end

  defp backend_option({:redis, url}), do: backend_option({:redis, url, []})

  defp backend_option({:redis, url, opts}) do
    with {:ok, redis_opts} <- @backends.redis.options(url, opts),
         do: {:ok, @backends.redis, redis_opts}
  end

  defp backend_option(backend) do
    case @backends do
      %{^backend => module} when backend not in [:daemon, :redis] ->
        {:ok, module, []}

      _ ->
        {:error,
         "unknown backend #{inspect(backend)}; expected :nif, :port, {:daemon, address}, " <>
           "{:daemon, address, opts}, {:redis, url} or {:redis, url, opts}"}
    end
  end

  defp on_event_option(on_event) do
    if is_nil(on_event) or Events.callback?(on_event),
      do: {:ok, on_event},
      else:
        {:error,
         "on_event must be a 3-arity function or {module, function, extra_args}, " <>
           "got #{inspect(on_event)}"}
  end

  defp boolean_option(opts, key, default) do
    case Keyword.get(opts, key, default) do
      value when is_boolean(value) -> {:ok, value}
      other -> {:error, "#{key} must be a boolean, got #{inspect(other)}"}
    end
  end

  defp integer_option(opts, key, default, min) do
    case Keyword.get(opts, key, default) do
      value when is_integer(value) and value >= min -> {:ok, value}
      other -> {:error, "#{key} must be an integer >= #{min}, got #{inspect(other)}"}
    end
  end

  defp max_wait_option(opts, default, name) do
    with {:error, _} = error <- max_wait_option(opts, default) do
      count_invalid(name)
      error
    end
  end

  defp max_wait_option(opts, default) do
    cond do
      not Keyword.keyword?(opts) ->
        {:error, Error.invalid("options must be a keyword list, got #{inspect(opts)}")}

      Keyword.keys(opts) -- [:max_wait_ms] != [] ->
        {:error,
         Error.invalid("unknown options #{inspect(Keyword.keys(opts) -- [:max_wait_ms])}")}

      true ->
        case Keyword.get(opts, :max_wait_ms, default) do
          # nil (a probe) only where the default is nil: check_rates without a budget.
          ms when (is_integer(ms) and ms > 0) or (is_nil(ms) and is_nil(default)) ->
            {:ok, ms}

          other ->
            {:error,
             Error.invalid("max_wait_ms must be a positive integer, got #{inspect(other)}")}
        end
    end
  end

  ## Routing: local names reach the table directly; other names go through the process.

  defp run(name, fun, args) do
    case route(name) do
      {backend, handle, _events} -> apply(backend, fun, [handle | args])
      elsewhere -> elsewhere(elsewhere, name, {:run, fun, args})
    end
  end

  defp elsewhere({:remote, server}, _name, request), do: GenServer.call(server, request)
  defp elsewhere(:noproc, name, _request), do: exit({:noproc, {__MODULE__, :run, [name]}})

  defp elsewhere(:invalid, name, _request),
    do: {:error, Error.invalid("not a limiter name: #{describe_name(name)}")}

  # A binary in the name's place may well be an API key: never show it.
  defp describe_name(name) when is_binary(name), do: "a binary (#{byte_size(name)} bytes)"
  defp describe_name(name), do: inspect(name)

  @doc false
  # Where the events of the limiter `name` go from this process: its sink for a local
  # limiter, `{:remote, server}` for one reached through its process, or `nil`.
  @spec events(GenServer.name()) :: Events.t() | {:remote, GenServer.server()} | nil
  def events(name) do
    case route(name) do
      {_backend, _handle, events} -> events
      {:remote, server} -> {:remote, server}
      _ -> nil
    end
  end

  defp count_invalid(name) do
    case events(name) do
      {:remote, server} -> GenServer.cast(server, :count_invalid)
      nil -> :ok
      events -> Events.count_invalid(events)
    end
  end

  # The `:persistent_term` entry of a local limiter, `{backend, handle, events}`.
  defp route(name) when is_atom(name) and not is_nil(name),
    do: :persistent_term.get({__MODULE__, name}, :noproc)

  defp route({:global, _} = name), do: {:remote, name}
  defp route({:via, module, _} = name) when is_atom(module), do: {:remote, name}

  defp route({name, node} = server) when is_atom(name) and is_atom(node) do
    if node == node(), do: route(name), else: {:remote, server}
  end

  defp route(pid) when is_pid(pid), do: {:remote, pid}
  defp route(_), do: :invalid

  defp answer({:error, message}) when is_binary(message), do: {:error, Error.invalid(message)}
  defp answer({wait, ms}) when wait in [:booked, :over_budget], do: {:delay, ms}
  defp answer(answer), do: answer

  defp exchange_of(key) when is_tuple(key) and tuple_size(key) in [2, 3], do: elem(key, 0)
  defp exchange_of(_), do: nil
end
