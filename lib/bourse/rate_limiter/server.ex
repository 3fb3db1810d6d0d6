defmodule Bourse.RateLimiter.Server do
  @moduledoc """
  The process of a limiter (`Bourse.RateLimiter.start_link/1`).

  It attaches its backend's bucket table (taking over the one its previous incarnation
  left after a crash, docs/CONTRACT.md, P6), publishes it for local callers (`Bourse.RateLimiter.Router`),
  runs the periodic sweep and reports lapsed bookings, receives the events of callers on
  other nodes, and answers calls that arrive while it starts (before its table is
  published).

  Once it has ended (stopped, or crashed), its name answers like one never started. Its
  table stays published for 5 s, for a limiter started again under that name
  (by a supervisor's restart) to take over; then it is withdrawn, and nothing of it is
  left. Unexpected messages are logged and ignored.
  """

  use GenServer

  require Logger

  alias Bourse.Error
  alias Bourse.RateLimiter.{Events, Options, Router}

  # How long the table of a limiter that ended waits for a successor to take it over, as
  # long as the port's connection (Bourse.RateLimiter.Backend.Connection) waits.
  @takeover_ms 5_000

  # The backend callbacks a caller may ask the process to run for it, by how many
  # arguments they take besides the handle.
  @callbacks for {fun, arity} <- Bourse.RateLimiter.Backend.behaviour_info(:callbacks),
                 fun in [
                   :check_rate,
                   :check_rates,
                   :record_request,
                   :get_cost,
                   :sync,
                   :reset,
                   :reset_exchange,
                   :reset_all,
                   :pause,
                   :back_off,
                   :reset_backoff,
                   :inspect,
                   :busiest
                 ],
                 into: %{},
                 do: {fun, arity - 1}

  @doc """
  Starts the limiter process for a checked configuration (`Options.start/1`). A failure to
  start is `{:error, %Bourse.Error{}}`, and the caller, though linked, lives on.
  """
  @spec start_link(Options.config()) :: GenServer.on_start() | {:error, Error.t()}
  def start_link(config) do
    ref = make_ref()

    # A failed init sends its error, then exits :normal (which spares the linked caller):
    # the error arrives before gen_server's `{:error, :normal}`.
    case GenServer.start_link(__MODULE__, {config, self(), ref}, name: config.name) do
      {:error, :normal} ->
        receive do
          {^ref, error} -> {:error, error}
        after
          0 -> {:error, :normal}
        end

      started ->
        started
    end
  end

  @doc """
  Counters of the limiter whose table is `handle` on `backend` and whose sink is
  `events`: the table's and those kept beside it (`Bourse.RateLimiter.stats/1`).
  """
  @spec stats(module(), term(), Events.t()) :: map() | {:error, term()}
  def stats(backend, handle, events) do
    case backend.stats(handle) do
      %{} = stats -> Map.merge(stats, Events.counts(events), fn _, table, own -> table + own end)
      error -> error
    end
  end

  @impl true
  def init({config, starter, ref}) do
    {previous, previous_events, config} =
      case Router.published(config.name) do
        {backend, handle, events, _pid} when backend == config.backend ->
          {handle, events, config}

        # Within 5 s of a limiter of another backend: its table cannot be taken over, and
        # the exchange still counts what it spent.
        {_backend, _handle, _events, _pid} ->
          {nil, nil, %{config | assume_busy_at_start: true}}

        nil ->
          {nil, nil, config}
      end

    case attach(config, previous) do
      {:ok, handle} ->
        events = Events.new(config.name, config.on_event, previous_events)
        Router.publish(config.name, {config.backend, handle, events, self()})
        Router.withdraw_when_down(config.name, self(), @takeover_ms)
        schedule_sweep(config)

        {:ok,
         Map.merge(config, %{
           handle: handle,
           events: events,
           lapsed: lapsed(config.backend, handle, events)
         })}

      {:error, error} ->
        send(starter, {ref, error})
        {:stop, :normal}
    end
  end

  # Every failure to start is a `%Bourse.Error{}`.
  defp attach(config, previous) do
    case config.backend.attach(previous, Map.to_list(config)) do
      {:ok, handle} -> {:ok, handle}
      {:error, %Error{} = error} -> {:error, error}
      {:error, reason} -> {:error, cannot_start(config, reason)}
    end
  rescue
    exception -> {:error, cannot_start(config, Exception.message(exception))}
  end

  # A daemon that refused its flags was given options it cannot take.
  defp cannot_start(config, {:refused, message}) do
    Error.invalid(
      "cannot start the limiter's #{inspect(config.backend)} backend: " <>
        "bourse_daemon refused its configuration: #{message}"
    )
  end

  defp cannot_start(config, {:misconfigured, message}) do
    Error.invalid("cannot start the limiter's #{inspect(config.backend)} backend: #{message}")
  end

  defp cannot_start(config, reason) do
    reason = if is_binary(reason), do: reason, else: Error.describe(reason)
    Error.unavailable("cannot start the limiter's #{inspect(config.backend)} backend: #{reason}")
  end

  @impl true
  def handle_call({:run, fun, args}, _from, state)
      when is_map_key(@callbacks, fun) and is_list(args) and
             length(args) == :erlang.map_get(fun, @callbacks) do
    entry = {state.backend, state.handle, state.events, self()}
    {:reply, Bourse.RateLimiter.run_entry(entry, fun, args), state}
  rescue
    # Callers send arguments already checked: these were made by hand. Shown by shape only,
    # since they may hold an API key.
    exception ->
      unexpected("call", {:run, fun, args}, state, " (#{inspect(exception.__struct__)})")
      {:reply, {:error, Error.invalid("not a limiter request")}, state}
  catch
    # Should a caller's request stop this process, its crash report must not show the
    # caller's key (an API key) in the stacktrace's arguments.
    kind, reason -> :erlang.raise(kind, reason, without_arguments(__STACKTRACE__))
  end

  def handle_call(:stats, _from, state) do
    {:reply, stats(state.backend, state.handle, state.events), state}
  end

  def handle_call(request, _from, state) do
    unexpected("call", request, state)
    {:reply, {:error, Error.invalid("not a limiter request")}, state}
  end

  # Events and counts of callers that reach this limiter through its process.
  @impl true
  def handle_cast({:emit, event, measurements, metadata}, state)
      when is_atom(event) and is_map(measurements) and is_map(metadata) do
    Events.dispatch(state.events, event, measurements, metadata)
    {:noreply, state}
  end

  def handle_cast(:count_invalid, state) do
    Events.count_invalid(state.events)
    {:noreply, state}
  end

  def handle_cast(request, state) do
    unexpected("cast", request, state)
    {:noreply, state}
  end

  @impl true
  def handle_info(:sweep, state) do
    state.backend.sweep(state.handle)
    schedule_sweep(state)
    {:noreply, report_lapses(state)}
  end

  def handle_info(message, state) do
    unexpected("message", message, state)
    {:noreply, state}
  end

  # A crash report does not show the arguments of the last request either, nor the
  # backend's secrets (OTP 25 formats gen_server crash reports with format_status/1).
  @doc false
  def format_status(status) do
    status
    |> Map.replace_lazy(:message, &redact_request/1)
    |> Map.replace_lazy(:state, &redact_secrets/1)
  end

  defp redact_secrets(%{backend_opts: opts} = state) when is_list(opts),
    do: %{state | backend_opts: for({key, value} <- opts, do: {key, redact(key, value)})}

  defp redact_secrets(state), do: state

  defp redact(:password, password) when is_binary(password), do: "[redacted]"
  defp redact(_key, value), do: value

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

  # Shown by shape only: a message may hold an API key.
  defp unexpected(kind, message, state, why \\ "") do
    Logger.warning(
      "Bourse.RateLimiter #{inspect(state.name)} ignored an unexpected #{kind}: " <>
        describe_message(message) <> why
    )
  end

  defp describe_message(message) when is_tuple(message) and tuple_size(message) > 0 do
    case elem(message, 0) do
      tag when is_atom(tag) -> "#{Error.describe(message)} tagged #{inspect(tag)}"
      _ -> Error.describe(message)
    end
  end

  defp describe_message(message), do: Error.describe(message)

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
end
