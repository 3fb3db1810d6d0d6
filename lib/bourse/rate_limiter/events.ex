defmodule Bourse.RateLimiter.Events do
  @moduledoc """
  Events a limiter emits, for metrics and alerts.

  Every event is named `[:bourse, :rate_limiter, event]` and goes:

    * to the `:on_event` callback given to `Bourse.RateLimiter.start_link/1`, if any: a
      function `fn event, measurements, metadata -> ... end` or `{module, function,
      extra_args}` (called as `apply(module, function, [event, measurements, metadata |
      extra_args])`). It runs in the process that caused the event (the caller of the
      check, or the limiter's process for `:lapsed` and for callers on other nodes), so it
      must be quick. A callback that raises does not break the caller: the first failure
      is logged, later ones only counted (`:event_failures` in `Bourse.RateLimiter.stats/1`);
    * to `:telemetry.execute/3`, when the `:telemetry` application's module is loadable
      when the limiter starts (`:bourse` does not depend on it).

  The `:ok` answer of a check never emits: only refusals, bookings, waits and pauses do,
  so the hot path costs the same with or without listeners. An event costs its caller
  about 1–2 µs besides the callback itself (the credential's SHA-256 fingerprint and the
  metadata map; `mix run bench/counters.exs` measures it), and nothing when no one
  listens beyond a `:persistent_term` look-up.

  ## Metadata

  Every event's metadata has `:limiter` (the limiter's name). Events about a key add:

    * `:exchange` – the exchange id;
    * `:credential` – the credential's fingerprint (`Bourse.Fingerprint.of/1`,
      `"key:1a2b3c4d"`) or `:public`: **never the API key itself**;
    * `:axis` – the bucket axis;
    * `:cost` – the cost asked for.

  For `Bourse.RateLimiter.check_rates/3`, `:exchange`, `:credential` and `:axis` are the
  value every check shares (`nil` where they differ), `:cost` is the total and `:checks`
  lists each check as `%{exchange, credential, axis, cost}`.

  ## Events

  | event | when | measurements | metadata (besides the above) |
  | --- | --- | --- | --- |
  | `:refused` | a probe (`check_rate/4`, `check_rates` without `:max_wait_ms`) answered `{:delay, ms}`, or a waiter's wait exceeded its `:max_wait_ms` (nothing paid; a waiter back early for its own booking keeps it) | `delay_ms` | `reason`: `:delay` or `:over_budget`; `max_wait_ms` (`nil` for a probe) |
  | `:booked` | a waiter (`wait_for_capacity`, `check_rates` with `:max_wait_ms`) booked its cost | `delay_ms`: until the booking is ready | |
  | `:admitted_after_wait` | `wait_for_capacity` returned `:ok` after sleeping | `waited_ms`: from the call to the admission | |
  | `:lapsed` | bookings were not claimed within `:booking_slack_ms` of their ready time | `count`: bookings dropped (one per bucket of a multi-bucket booking) | only `:limiter` |
  | `:paused` | `Bourse.RateLimiter.pause/3` was called, or `Bourse.RateLimiter.observe_response/6` paused buckets after a limited reply (it also emits `:rate_limited`) | `ms` | `exchange`; `credential` (`nil` for a whole exchange); `axis` (`nil` unless a full key): the target asked for, also when a full pause table held its whole exchange instead |
  | `:rate_limited` | `Bourse.RateLimiter.observe_response/6` saw a 429, a 418 or a rate-limit signal in the body, and paused the credential (the exchange, for a 418 or an IP-wide signal) | `retry_after_ms`: the pause | `http_status`; `stop` (`true`: a ban, do not retry); `signal`: what the body or status said (`"Bybit retCode 10006 (too many visits)"`), `nil` for a plain 429 or 418; `axis` is `nil` |

  Lapses are counted inside the bucket table when a lapsed booking is dropped: by the
  next check of its key, or with its bucket by the sweep (once the bucket is full and
  idle; a sweep never drops the lapsed bookings of a bucket it keeps, since when they
  leave shapes what the others give back). The limiter's process reads the counter every
  `:sweep_interval_ms` (default 1 s) and emits the difference, so a `:lapsed` event comes
  at most that long after the lapse was counted (on a shared daemon, which sweeps on its
  own `--sweep-interval-ms`, as well). With the buckets in Redis (`backend: {:redis,
  url}`) the sweep does not look at every key: a lapse is counted, and reported, after
  its key is next checked.
  A waiter coming back early to `check_rates` (a `{:delay, ms}` on its own booking) and
  the extra sleeps of `wait_for_capacity` behind a pause emit nothing: the wait shows in
  `:admitted_after_wait`.
  """

  require Logger

  alias Bourse.Fingerprint
  alias Bourse.RateLimiter.{CallDeadline, Router}

  @typedoc "An event's last name segment, e.g. `:refused`."
  @type event :: atom()

  @typedoc "The `:on_event` option of `Bourse.RateLimiter.start_link/1`."
  @type callback :: (list(atom()), map(), map() -> term()) | {module(), atom(), list()}

  @enforce_keys [:limiter, :on_event, :telemetry, :counters]
  defstruct @enforce_keys

  @typedoc false
  @opaque t :: %__MODULE__{
            limiter: GenServer.name(),
            on_event: callback() | nil,
            telemetry: module() | nil,
            counters: :atomics.atomics_ref()
          }

  # Counters kept beside the bucket table's own, for what never reaches the table, and the
  # last moment a pause was noted through the limiter, or it started (monotonic ms).
  @invalid 1
  @failures 2
  @noted_at 3

  @doc """
  Emits `[:bourse, :rate_limiter, event]` from the limiter `name`.

  `metadata` is a map, or a zero-arity function returning one (called only when someone
  listens). A `:key` entry (`{exchange, credential, axis}` or `{exchange, credential}`)
  is replaced by `:exchange`, `:credential` (its fingerprint) and `:axis`; a binary
  `:credential` is fingerprinted. `:limiter` is added. Returns `:ok`, also when no
  limiter runs under `name`.

      Events.emit(MyApp.Limiter, :rate_limited, %{retry_after_ms: 2_000},
        %{key: {"binance", api_key, "ip"}, http_status: 429})
  """
  @spec emit(GenServer.name(), event(), map(), map() | (() -> map())) :: :ok
  def emit(name, event, measurements, metadata)
      when is_atom(event) and is_map(measurements) and
             (is_map(metadata) or is_function(metadata, 0)) do
    metadata = credential_shown(metadata)

    case Router.route(name) do
      {_backend, _handle, events, _pid} -> emit_to(events, event, measurements, metadata)
      {:remote, pid} -> emit_to({:remote, pid}, event, measurements, metadata)
      _none -> :ok
    end
  end

  @doc false
  # Emits to the sink a caller already holds: a local limiter's, `{:remote, pid}` for a
  # limiter reached through its process, or `nil` (no limiter: nothing is emitted).
  @spec emit_to(t() | {:remote, pid()} | nil, event(), map(), map() | (() -> map())) :: :ok
  def emit_to(%__MODULE__{} = events, event, measurements, metadata),
    do: dispatch(events, event, measurements, metadata)

  def emit_to({:remote, pid}, event, measurements, metadata),
    do: GenServer.cast(pid, {:emit, event, measurements, prepare(metadata)})

  def emit_to(nil, _event, _measurements, _metadata), do: :ok

  @doc false
  # The sink of a starting limiter; `previous` is its earlier incarnation's, whose
  # counters it keeps. A start counts as a pause noted: what was recorded while no limiter
  # ran under the name is not known.
  @spec new(GenServer.name(), callback() | nil, t() | nil) :: t()
  def new(limiter, on_event, previous) do
    counters =
      case previous do
        %__MODULE__{counters: counters} -> counters
        nil -> :atomics.new(3, signed: true)
      end

    # Monotonic times may be negative: a new table's 0 is no time. A first start comes
    # before any waiter's ask, even within the same millisecond.
    if previous == nil,
      do: :atomics.put(counters, @noted_at, System.monotonic_time(:millisecond) - 1),
      else: note_now(counters)

    %__MODULE__{
      limiter: limiter,
      on_event: on_event,
      telemetry: if(Code.ensure_loaded?(:telemetry), do: :telemetry),
      counters: counters
    }
  end

  @doc false
  # A pause was recorded through the limiter (`Bourse.RateLimiter.pause/3`, or a backoff),
  # or may have been (its store did not answer): a waiter whose store cannot answer its
  # claim is admitted on its booking only if no pause was noted since it asked
  # (`Bourse.RateLimiter.wait_for_capacity/5`).
  @spec note_pause(t() | {:remote, pid()} | nil) :: :ok
  def note_pause(%__MODULE__{counters: counters}), do: note_now(counters)
  def note_pause(_sink), do: :ok

  @doc false
  # The last moment a pause was noted through the limiter, or it started (monotonic ms);
  # `nil` for a limiter reached through its process.
  @spec noted_at(t() | {:remote, pid()} | nil) :: integer() | nil
  def noted_at(%__MODULE__{counters: counters}), do: :atomics.get(counters, @noted_at)
  def noted_at(_sink), do: nil

  defp note_now(counters),
    do: advance_to(counters, @noted_at, System.monotonic_time(:millisecond))

  defp advance_to(counters, index, value) do
    current = :atomics.get(counters, index)

    cond do
      value <= current -> :ok
      :atomics.compare_exchange(counters, index, current, value) == :ok -> :ok
      true -> advance_to(counters, index, value)
    end
  end

  @doc false
  @spec callback?(term()) :: boolean()
  def callback?(fun) when is_function(fun, 3), do: true

  def callback?({module, function, args})
      when is_atom(module) and is_atom(function) and is_list(args),
      do: true

  def callback?(_), do: false

  @doc false
  @spec listening?(t()) :: boolean()
  def listening?(%__MODULE__{on_event: nil, telemetry: nil}), do: false
  def listening?(%__MODULE__{}), do: true

  @doc false
  @spec dispatch(t(), event(), map(), map() | (() -> map())) :: :ok
  def dispatch(%__MODULE__{} = events, event, measurements, metadata) do
    if listening?(events) do
      name = [:bourse, :rate_limiter, event]
      metadata = metadata |> prepare() |> Map.put(:limiter, events.limiter)
      # The handlers' own calls keep their timeouts, within a call that shares one.
      CallDeadline.outside(fn ->
        if events.telemetry, do: apply(events.telemetry, :execute, [name, measurements, metadata])
        call(events, name, measurements, metadata)
      end)
    end

    :ok
  end

  @doc false
  # Metadata of a check over several keys: what the checks share, the total cost and
  # each check.
  @spec checks_metadata(list()) :: map()
  def checks_metadata(checks) do
    described =
      for {key, limit, cost} <- checks,
          limit != nil,
          do: key |> describe_key() |> Map.put(:cost, cost)

    shared = fn field ->
      case Enum.uniq_by(described, & &1[field]) do
        [one] -> one[field]
        _ -> nil
      end
    end

    %{
      exchange: shared.(:exchange),
      credential: shared.(:credential),
      axis: shared.(:axis),
      cost: described |> Enum.map(& &1.cost) |> Enum.sum(),
      checks: described
    }
  end

  @doc false
  # `exchange`, `credential` (fingerprint) and `axis` of a key.
  @spec describe_key(term()) :: map()
  def describe_key({exchange, credential}), do: describe_key({exchange, credential, "request"})

  def describe_key({exchange, credential, axis}),
    do: %{exchange: exchange, credential: Fingerprint.of(credential), axis: axis}

  def describe_key(other), do: %{key: Fingerprint.of(other)}

  @doc false
  # A pause target: a key, `{exchange, credential}` (every axis) or an exchange.
  @spec describe_target(term()) :: map()
  def describe_target({_exchange, _credential, _axis} = key), do: describe_key(key)

  def describe_target({exchange, credential}),
    do: %{exchange: exchange, credential: Fingerprint.of(credential), axis: nil}

  def describe_target(exchange), do: %{exchange: exchange, credential: nil, axis: nil}

  @doc false
  # Counts a call refused as malformed before it reached the bucket table.
  @spec count_invalid(t() | {:remote, pid()} | nil) :: :ok
  def count_invalid(%__MODULE__{counters: counters}), do: :atomics.add(counters, @invalid, 1)
  def count_invalid({:remote, pid}), do: GenServer.cast(pid, :count_invalid)
  def count_invalid(nil), do: :ok

  @doc false
  # What the Elixir side counted: malformed input refused before reaching the table, and
  # `:on_event` callbacks that raised.
  @spec counts(t()) :: %{invalid: non_neg_integer(), event_failures: non_neg_integer()}
  def counts(%__MODULE__{counters: counters}) do
    %{
      invalid: :atomics.get(counters, @invalid),
      event_failures: :atomics.get(counters, @failures)
    }
  end

  defp prepare(metadata) when is_function(metadata, 0), do: prepare(metadata.())

  # Metadata built here carries fingerprints already (`describe_key/1`, `describe_target/1`);
  # only a `:key` is left to describe.
  defp prepare(metadata) do
    case Map.pop(metadata, :key) do
      {nil, metadata} -> metadata
      {key, metadata} -> Map.merge(describe_key(key), metadata)
    end
  end

  # The `:credential` a caller of `emit/4` gave, as its fingerprint.
  defp credential_shown(metadata) when is_function(metadata, 0),
    do: fn -> credential_shown(metadata.()) end

  defp credential_shown(%{credential: credential} = metadata) when is_binary(credential),
    do: %{metadata | credential: Fingerprint.of(credential)}

  defp credential_shown(metadata), do: metadata

  defp call(%__MODULE__{on_event: nil}, _name, _measurements, _metadata), do: :ok

  defp call(%__MODULE__{on_event: on_event} = events, name, measurements, metadata) do
    case on_event do
      fun when is_function(fun, 3) -> fun.(name, measurements, metadata)
      {module, function, args} -> apply(module, function, [name, measurements, metadata | args])
    end
  catch
    kind, reason ->
      if :atomics.add_get(events.counters, @failures, 1) == 1 do
        Logger.error(
          "Bourse.RateLimiter #{inspect(events.limiter)}: the :on_event callback failed on " <>
            "#{inspect(name)}: #{Exception.format_banner(kind, reason)}. Later failures are " <>
            "only counted (:event_failures in Bourse.RateLimiter.stats/1)."
        )
      end
  end
end
