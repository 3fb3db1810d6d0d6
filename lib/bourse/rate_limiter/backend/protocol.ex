defmodule Bourse.RateLimiter.Backend.Protocol do
  @moduledoc """
  The backend callbacks over `bourse_daemon`'s JSON protocol (docs/PROTOCOL.md, version
  1), shared by `Bourse.RateLimiter.Backend.Port` and `Bourse.RateLimiter.Backend.Daemon`:

      use Bourse.RateLimiter.Backend.Protocol

  defines every callback of `Bourse.RateLimiter.Backend` but `attach/2`, over a
  `Bourse.RateLimiter.Backend.Connection` handle.

  The caller's process checks the shape of every term before anything is sent (keys,
  `:public`, limit maps, `nil`, lists, binaries that JSON can carry) and answers malformed
  input with `{:error, message}`, as the NIF does. Numbers travel as they are: the daemon
  judges their ranges (`cost: -1`, `capacity: 1.0e308`) and its message comes back the same
  way. Booking owners are the calling pids, rendered as strings.

  ## Codec

  JSON, encoded and decoded with `:jiffy` (Debian's `erlang-jiffy`): the daemon speaks one
  documented protocol to every client (other VMs, Python, `nc`), so the port uses it too
  and both backends share this translation and the daemon's own tests. `:jiffy` is a
  maintained, NIF-backed library; a JSON codec written here would be one more thing to get
  wrong. (The external term format would be native on this side but need a second decoder
  in the daemon, for the port alone.)
  """

  alias Bourse.Error
  alias Bourse.RateLimiter.Backend.Connection

  @max_key_part_bytes 1024
  @max_checks 1024
  @max_busiest 10_000
  @info_fields ~w(tokens borrowed debt bookings booked_cost next_ready_ms pause_ms)a
  @stats_fields ~w(admitted claimed delayed booked over_budget lapsed paused debited invalid buckets bookings)a

  @doc false
  defmacro __using__(_opts) do
    quote do
      @behaviour Bourse.RateLimiter.Backend

      alias Bourse.RateLimiter.Backend.Protocol

      @impl true
      defdelegate check_one(handle, owner, key, limit, cost, max_wait), to: Protocol
      @impl true
      defdelegate check_many(handle, owner, checks, max_wait), to: Protocol
      @impl true
      defdelegate record(handle, key, cost), to: Protocol
      @impl true
      defdelegate borrowed(handle, key), to: Protocol
      @impl true
      defdelegate sync(handle, key, allowance, window_left_ms), to: Protocol
      @impl true
      defdelegate reset(handle, key), to: Protocol
      @impl true
      defdelegate reset_exchange(handle, exchange), to: Protocol
      @impl true
      defdelegate reset_all(handle), to: Protocol
      @impl true
      defdelegate pause(handle, target, ms), to: Protocol
      @impl true
      defdelegate inspect(handle, key), to: Protocol
      @impl true
      defdelegate stats(handle), to: Protocol
      @impl true
      defdelegate busiest(handle, count), to: Protocol
      @impl true
      defdelegate sweep(handle), to: Protocol
    end
  end

  @type handle :: Connection.t()
  @type error :: {:error, String.t() | Error.t()}

  ## The callbacks

  @doc "`check_rate/4` and `wait_for_capacity/5` on one bucket."
  @spec check_one(handle(), pid(), term(), term(), term(), pos_integer() | nil) ::
          Bourse.RateLimiter.Backend.check_answer() | error()
  def check_one(handle, owner, key, limit, cost, max_wait) do
    with {:ok, key} <- key(key),
         {:ok, limit} <- limit(limit),
         {:ok, cost} <- number(cost, "cost") do
      %{op: "check", key: key, limit: limit, cost: cost}
      |> owned_by(handle, owner, max_wait)
      |> run(handle, &outcome/1)
    end
  end

  @doc "`check_rates/3`: all or nothing over several buckets."
  @spec check_many(handle(), pid(), term(), pos_integer() | nil) ::
          Bourse.RateLimiter.Backend.check_answer() | error()
  def check_many(handle, owner, checks, max_wait) do
    with {:ok, checks} <- checks(checks, 0, []) do
      %{op: "check_many", checks: checks}
      |> owned_by(handle, owner, max_wait)
      |> run(handle, &outcome/1)
    end
  end

  @doc "`record_request/3`."
  @spec record(handle(), term(), term()) :: :ok | error()
  def record(handle, key, cost) do
    with {:ok, key} <- key(key), {:ok, cost} <- number(cost, "cost") do
      run(%{op: "record", key: key, cost: cost}, handle, &done/1)
    end
  end

  @doc "`get_cost/3`: the tokens borrowed from the key's bucket."
  @spec borrowed(handle(), term()) :: number() | error()
  def borrowed(handle, key) do
    with {:ok, key} <- key(key) do
      run(%{op: "get_cost", key: key}, handle, &field(&1, "borrowed"))
    end
  end

  @doc "Lowers the key's tokens to what the exchange still allows; returns the tokens taken."
  @spec sync(handle(), term(), term(), term()) :: number() | error()
  def sync(handle, key, allowance, window_left_ms) do
    with {:ok, key} <- key(key),
         {:ok, allowance} <- number(allowance, "allowance"),
         {:ok, window_left_ms} <- integer(window_left_ms, "window_left_ms") do
      %{op: "sync", key: key, allowance: allowance, window_left_ms: window_left_ms}
      |> run(handle, &field(&1, "taken"))
    end
  end

  @doc "`reset/2`."
  @spec reset(handle(), term()) :: :ok | error()
  def reset(handle, key) do
    with {:ok, key} <- key(key), do: run(%{op: "reset", key: key}, handle, &done/1)
  end

  @doc "`reset_exchange/2`."
  @spec reset_exchange(handle(), term()) :: :ok | error()
  def reset_exchange(handle, exchange) do
    with {:ok, exchange} <- part(exchange, "exchange_id") do
      run(%{op: "reset_exchange", exchange: exchange}, handle, &done/1)
    end
  end

  @doc "`reset_all/1`."
  @spec reset_all(handle()) :: :ok | error()
  def reset_all(handle), do: run(%{op: "reset_all"}, handle, &done/1)

  @doc "`pause/3`: a key, `{exchange_id, credential_key}` or an exchange id."
  @spec pause(handle(), term(), term()) :: :ok | error()
  def pause(handle, target, ms) do
    with {:ok, target} <- pause_target(target),
         {:ok, ms} <- integer(ms, "pause (milliseconds)") do
      run(%{op: "pause", target: target, ms: ms}, handle, &done/1)
    end
  end

  @doc "A snapshot of one key, or `nil` when the table does not hold it."
  @spec inspect(handle(), term()) :: map() | nil | error()
  def inspect(handle, key) do
    with {:ok, key} <- key(key) do
      run(%{op: "inspect", key: key}, handle, fn answer ->
        with {:ok, info} <- Map.fetch(answer, "info"), do: info(info)
      end)
    end
  end

  @doc "The daemon's counters since it started, and its live buckets and bookings."
  @spec stats(handle()) :: map() | error()
  def stats(handle) do
    run(%{op: "stats"}, handle, fn answer ->
      with {:ok, stats} <- Map.fetch(answer, "stats"), do: atom_keys(stats, @stats_fields)
    end)
  end

  @doc "The `count` keys with the most tokens borrowed (at most #{@max_busiest})."
  @spec busiest(handle(), term()) :: [{tuple(), map()}] | error()
  def busiest(_handle, 0), do: []

  def busiest(handle, count) when is_integer(count) and count > 0 do
    run(%{op: "busiest", count: min(count, @max_busiest)}, handle, fn
      %{"keys" => rows} when is_list(rows) ->
        for %{"key" => key, "info" => info} <- rows, do: {key_term(key), info(info)}

      _answer ->
        :error
    end)
  end

  def busiest(_handle, count),
    do: {:error, "count must be a non-negative integer, got #{describe(count)}"}

  @doc "Drops idle full buckets now; returns how many."
  @spec sweep(handle()) :: non_neg_integer() | error()
  def sweep(handle), do: run(%{op: "sweep"}, handle, &field(&1, "dropped"))

  ## Sending

  # Sends `request` and shapes a successful answer with `shape`.
  defp run(request, handle, shape) do
    case Connection.request(handle, request) do
      %{"ok" => true} = answer ->
        case shape.(answer) do
          :error -> {:error, unexpected(answer)}
          shaped -> shaped
        end

      %{"ok" => false, "error" => %{"type" => "unavailable", "message" => message}} ->
        {:error, Error.unavailable(message)}

      %{"ok" => false, "error" => %{"message" => message}} when is_binary(message) ->
        {:error, message}

      %{} = other ->
        {:error, unexpected(other)}

      {:error, _} = error ->
        error
    end
  end

  # Names the fields of a malformed answer, not their values: answers hold API keys.
  defp unexpected(%{} = answer),
    do: Error.unavailable("unexpected answer with fields #{Kernel.inspect(Map.keys(answer))}")

  # The booking owner, and `max_wait_ms` for a waiter (a probe has none).
  defp owned_by(request, handle, owner, max_wait) do
    request = Map.put(request, :owner, Connection.owner(handle, owner))
    if max_wait, do: Map.put(request, :max_wait_ms, max_wait), else: request
  end

  ## Answers

  defp outcome(%{"result" => result} = answer) do
    case {result, answer["ms"]} do
      {"admitted", _} -> :ok
      {"claimed", _} -> :ok
      {"delay", ms} when is_integer(ms) -> {:delay, ms}
      {"booked", ms} when is_integer(ms) -> {:booked, ms}
      {"over_budget", ms} when is_integer(ms) -> {:over_budget, ms}
      _ -> :error
    end
  end

  defp outcome(_answer), do: :error

  defp done(_answer), do: :ok

  defp field(answer, name) do
    case answer do
      %{^name => value} when is_number(value) -> value
      _ -> :error
    end
  end

  defp info(nil), do: nil

  defp info(%{"limit" => limit} = info) do
    info
    |> atom_keys(@info_fields)
    |> Map.put(
      :limit,
      limit && %{capacity: limit["capacity"], refill_per_sec: limit["refill_per_sec"]}
    )
  end

  defp info(_info), do: :error

  defp atom_keys(map, fields) when is_map(map),
    do: Map.new(fields, &{&1, Map.get(map, Atom.to_string(&1))})

  defp atom_keys(_other, _fields), do: :error

  defp key_term(%{"exchange" => exchange, "credential" => credential, "axis" => axis}),
    do: {exchange, credential || :public, axis}

  ## Requests: shapes are checked here, ranges by the daemon

  defp key({exchange, credential, axis}) do
    with {:ok, exchange} <- part(exchange, "exchange_id"),
         {:ok, credential} <- credential(credential),
         {:ok, axis} <- part(axis, "bucket_axis") do
      {:ok, %{exchange: exchange, credential: credential, axis: axis}}
    end
  end

  defp key({exchange, credential}), do: key({exchange, credential, "request"})

  defp key(other) do
    {:error,
     "key must be {exchange_id, credential_key, bucket_axis} or {exchange_id, credential_key}, " <>
       "got #{shape(other)}"}
  end

  # A credential is an API key: messages show what kind of term it is, never its contents.
  defp credential(:public), do: {:ok, :null}

  defp credential(credential),
    do: part(credential, "credential_key (a binary or :public)", &shape/1)

  defp part(value, what, show \\ &describe/1)

  defp part(value, what, show) when is_binary(value) do
    cond do
      byte_size(value) > @max_key_part_bytes ->
        {:error, "#{what} is longer than #{@max_key_part_bytes} bytes"}

      not String.valid?(value) ->
        {:error, "#{what} must be valid UTF-8 for the daemon, got #{show.(value)}"}

      true ->
        {:ok, value}
    end
  end

  defp part(value, what, show), do: {:error, "#{what} must be a binary, got #{show.(value)}"}

  defp limit(nil), do: {:ok, :null}

  defp limit(%{capacity: capacity, refill_per_sec: refill} = limit) when map_size(limit) == 2 do
    with {:ok, capacity} <- number(capacity, "capacity"),
         {:ok, refill} <- number(refill, "refill_per_sec") do
      {:ok, %{capacity: capacity, refill_per_sec: refill}}
    end
  end

  defp limit(%{requests: requests, period: period} = limit) when map_size(limit) == 2 do
    with {:ok, requests} <- number(requests, "requests"),
         {:ok, period} <- number(period, "period") do
      {:ok, %{requests: requests, period: period}}
    end
  end

  defp limit(%{requests: requests} = limit) when map_size(limit) == 1 do
    with {:ok, requests} <- number(requests, "requests"), do: {:ok, %{requests: requests}}
  end

  defp limit(other) do
    {:error,
     "limit must be %{capacity: c, refill_per_sec: r}, %{requests: n, period: ms}, " <>
       "%{requests: n} or nil, got #{describe(other)}"}
  end

  defp checks([], _count, acc), do: {:ok, Enum.reverse(acc)}

  defp checks([_ | _], @max_checks, _acc),
    do: {:error, "at most #{@max_checks} checks in one call"}

  defp checks([{key, limit, cost} | rest], count, acc) do
    with {:ok, key} <- key(key),
         {:ok, limit} <- limit(limit),
         {:ok, cost} <- number(cost, "cost") do
      checks(rest, count + 1, [%{key: key, limit: limit, cost: cost} | acc])
    end
  end

  defp checks([other | _], _count, _acc),
    do: {:error, "each check must be {key, limit, cost}, got #{shape(other)}"}

  defp checks(_improper, _count, _acc),
    do: {:error, "checks must be a proper list of {key, limit, cost}"}

  defp pause_target(exchange) when is_binary(exchange) do
    with {:ok, exchange} <- part(exchange, "exchange_id"), do: {:ok, %{exchange: exchange}}
  end

  defp pause_target({exchange, credential}) do
    with {:ok, exchange} <- part(exchange, "exchange_id"),
         {:ok, credential} <- credential(credential) do
      {:ok, %{exchange: exchange, credential: credential}}
    end
  end

  defp pause_target({_, _, _} = key), do: key(key)

  defp pause_target(other) do
    {:error,
     "pause target must be a key, {exchange_id, credential_key} or an exchange id, " <>
       "got #{shape(other)}"}
  end

  defp number(value, _what) when is_number(value), do: {:ok, value}
  defp number(value, what), do: {:error, "#{what} must be a number, got #{describe(value)}"}

  defp integer(value, _what) when is_integer(value), do: {:ok, value}

  defp integer(value, what),
    do: {:error, "#{what} must be a non-negative integer, got #{describe(value)}"}

  defp describe(term), do: Kernel.inspect(term, limit: 8, printable_limit: 64)

  # What kind of term it is, for terms that may hold an API key.
  defp shape(term) when is_tuple(term), do: "a tuple of #{tuple_size(term)} elements"
  defp shape(term) when is_list(term), do: "a list"
  defp shape(term) when is_binary(term), do: "a binary"
  defp shape(term) when is_atom(term), do: "an atom"
  defp shape(term) when is_number(term), do: "a number"
  defp shape(term) when is_map(term), do: "a map"
  defp shape(_term), do: "a function, pid, port or reference"
end
