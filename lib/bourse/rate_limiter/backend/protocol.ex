defmodule Bourse.RateLimiter.Backend.Protocol do
  @moduledoc """
  The backend callbacks over `bourse_daemon`'s protocol (docs/PROTOCOL.md, version 1),
  shared by `Bourse.RateLimiter.Backend.Port` and `Bourse.RateLimiter.Backend.Daemon`:

      use Bourse.RateLimiter.Backend.Protocol

  defines every callback of `Bourse.RateLimiter.Backend` but `attach/2`, over a
  `Bourse.RateLimiter.Backend.Connection` handle.

  The caller's process only turns terms into the protocol's requests: key tuples into key
  maps, limit maps into maps with binary keys, numbers (of any size) and UTF-8 binaries as
  they are, and any other term as its shape alone (`%{"$term": "tuple", arity: 4}`,
  docs/PROTOCOL.md, "Values"); a binary that is not UTF-8 is such a term, since the
  daemon's requests hold UTF-8 strings, as JSON does (`%{"$term": "binary", size: 2}`),
  and so is one longer than a key part may be, which would not fit the daemon's frames.
  The daemon judges everything with `bourse_core`'s rules, as the NIF does, and its error
  comes back as `{:error, %Bourse.Error{type: :invalid_parameters}}` with the same message
  and exchange. Booking owners are the calling pids (`{pid, n}` once a process forfeited its
  bookings), rendered as strings. A call the daemon
  cannot answer (`:unavailable`) or take (a request larger than its frames), or whose
  answer has not come within 50 ms, is judged by the core in the caller, on a scratch NIF
  table: malformed input gets the NIF's `:invalid_parameters` error whatever the state of
  the daemon, without waiting for its timeout. Well-formed checks that
  need no bucket (every limit `nil`, or none) are answered `:ok` by the core in the caller,
  without the daemon.

  ## Codec

  Erlang's external term format (docs/PROTOCOL.md, "Codecs"), chosen by the connection's
  first `hello`: requests are `:erlang.term_to_binary/1` of these maps, answers are read
  with `:erlang.binary_to_term(answer, [:safe])`. Both are built into the VM, so the
  backends need no library at all (also in a release), and the daemon reads the terms into
  the same requests as JSON, with the same rules and errors. JSON stays the protocol of
  every other client (Python, `nc`, other languages).
  """

  alias Bourse.{Error, Native}
  alias Bourse.RateLimiter.Backend.{Connection, NIF}
  @limit_keys [:capacity, :refill_per_sec, :requests, :period]
  @info_fields ~w(tokens borrowed debt bookings booked_cost next_ready_ms pause_ms)a
  @stats_fields ~w(admitted claimed delayed booked over_budget lapsed paused debited invalid buckets bookings)a

  @doc false
  defmacro __using__(_opts) do
    quote do
      @behaviour Bourse.RateLimiter.Backend

      alias Bourse.RateLimiter.Backend.Protocol

      @impl true
      defdelegate check_rate(handle, owner, key, limit, cost, max_wait), to: Protocol
      @impl true
      defdelegate check_rates(handle, owner, checks, max_wait), to: Protocol
      @impl true
      defdelegate unbook(handle, owner, checks), to: Protocol
      @impl true
      defdelegate record_request(handle, key, cost), to: Protocol
      @impl true
      defdelegate get_cost(handle, key), to: Protocol
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
      defdelegate back_off(handle, credential, scope), to: Protocol
      @impl true
      defdelegate reset_backoff(handle, credential), to: Protocol
      @impl true
      defdelegate inspect(handle, key), to: Protocol
      @impl true
      defdelegate stats(handle), to: Protocol
      @impl true
      defdelegate busiest(handle, count), to: Protocol
      @impl true
      defdelegate sweep(handle), to: Protocol
      @impl true
      defdelegate store_lost_at(handle), to: Bourse.RateLimiter.Backend.Connection
    end
  end

  @type handle :: Connection.t()
  @type error :: {:error, String.t() | Error.t()}

  ## The callbacks

  @doc "`check_rate/4` and `wait_for_capacity/5` on one bucket."
  @spec check_rate(
          handle(),
          Bourse.RateLimiter.Backend.owner(),
          term(),
          term(),
          term(),
          pos_integer() | nil
        ) ::
          Bourse.RateLimiter.Backend.check_answer() | error()
  def check_rate(handle, owner, key, limit, cost, max_wait) do
    with :send <- limitless(limit == nil, :check_rate, [owner, key, limit, cost, max_wait]) do
      send_check(handle, owner, key, limit, cost, max_wait)
    end
  end

  defp send_check(handle, owner, key, limit, cost, max_wait) do
    request =
      %{
        op: "check",
        key: key(key),
        limit: limit(limit),
        cost: value(cost),
        owner: Connection.owner(handle, owner)
      }
      |> waiting(max_wait, handle)

    run(request, handle, &outcome/1, {:check_rate, [owner, key, limit, cost, max_wait]})
  end

  @doc "`check_rates/3`: all or nothing over several buckets."
  @spec check_rates(handle(), Bourse.RateLimiter.Backend.owner(), term(), pos_integer() | nil) ::
          Bourse.RateLimiter.Backend.check_answer() | error()
  def check_rates(handle, owner, checks, max_wait) do
    with :send <- limitless(limitless?(checks), :check_rates, [owner, checks, max_wait]) do
      send_checks(handle, owner, checks, max_wait)
    end
  end

  defp send_checks(handle, owner, checks, max_wait) do
    request =
      %{op: "check_many", checks: checks(checks), owner: Connection.owner(handle, owner)}
      |> waiting(max_wait, handle)

    run(request, handle, &outcome/1, {:check_rates, [owner, checks, max_wait]})
  end

  @doc """
  Gives back `owner`'s booking of `checks` (`unbook`, docs/PROTOCOL.md): sent by the
  connection without a deadline, its answer not awaited.
  """
  @spec unbook(handle(), Bourse.RateLimiter.Backend.owner(), term()) :: :ok
  def unbook(handle, owner, checks) do
    if limitless?(checks),
      do: :ok,
      else:
        Connection.send_later(handle, %{
          op: "unbook",
          checks: checks(checks),
          owner: Connection.owner(handle, owner)
        })
  end

  @doc "`record_request/3`."
  @spec record_request(handle(), term(), term()) :: :ok | error()
  def record_request(handle, key, cost) do
    run(
      %{op: "record", key: key(key), cost: value(cost)},
      handle,
      &done/1,
      {:record_request, [key, cost]}
    )
  end

  @doc "`get_cost/3`: the tokens borrowed from the key's bucket."
  @spec get_cost(handle(), term()) :: number() | error()
  def get_cost(handle, key) do
    run(%{op: "get_cost", key: key(key)}, handle, &field(&1, "borrowed"), {:get_cost, [key]})
  end

  @doc "Lowers the key's tokens to what the exchange still allows; returns the tokens taken."
  @spec sync(handle(), term(), term(), term()) :: number() | error()
  def sync(handle, key, allowance, window_left_ms) do
    request = %{
      op: "sync",
      key: key(key),
      allowance: value(allowance),
      window_left_ms: value(window_left_ms)
    }

    run(request, handle, &field(&1, "taken"), {:sync, [key, allowance, window_left_ms]})
  end

  @doc "`reset/2`."
  @spec reset(handle(), term()) :: :ok | error()
  def reset(handle, key) do
    request = %{op: "reset", key: key(key)}
    request |> run(handle, &done/1, {:reset, [key]}) |> forgetting(handle, request.key)
  end

  @doc "`reset_exchange/2`."
  @spec reset_exchange(handle(), term()) :: :ok | error()
  def reset_exchange(handle, exchange) do
    sent = value(exchange)

    %{op: "reset_exchange", exchange: sent}
    |> run(handle, &done/1, {:reset_exchange, [exchange]})
    |> forgetting(handle, {:exchange, sent})
  end

  @doc "`reset_all/1`."
  @spec reset_all(handle()) :: :ok | error()
  def reset_all(handle),
    do: %{op: "reset_all"} |> run(handle, &done/1) |> forgetting(handle, :all)

  @doc "Counts a limited reply for `{exchange_id, credential_key}` and pauses `scope` for the backoff."
  @spec back_off(handle(), term(), term()) :: pos_integer() | error()
  def back_off(handle, credential, scope) do
    request = %{op: "back_off", credential: backoff_credential(credential), scope: scope(scope)}

    request
    |> run(handle, &field(&1, "ms"), {:back_off, [credential, scope]})
    |> remembered(handle, backoff_target(credential, scope), nil)
  end

  # What a backoff pauses; well-formed once the daemon took it.
  defp backoff_target({exchange, _credential}, :exchange), do: exchange
  defp backoff_target(credential, _scope), do: credential

  @doc "Forgets the backoff count of `{exchange_id, credential_key}`."
  @spec reset_backoff(handle(), term()) :: :ok | error()
  def reset_backoff(handle, credential) do
    request = %{op: "reset_backoff", credential: backoff_credential(credential)}

    run(request, handle, &done/1, {:reset_backoff, [credential]})
  end

  @doc "`pause/3`: a key, `{exchange_id, credential_key}` or an exchange id."
  @spec pause(handle(), term(), term()) :: :ok | error()
  def pause(handle, target, ms) do
    %{op: "pause", target: pause_target(target), ms: value(ms)}
    |> run(handle, &done/1, {:pause, [target, ms]})
    |> remembered(handle, target, ms)
  end

  # The pauses a reset ended (`Connection.forget_pauses/2`) are not asked again of a new
  # table.
  defp forgetting(:ok, handle, ended), do: Connection.forget_pauses(handle, ended)
  defp forgetting(answer, _handle, _ended), do: answer

  # A pause the daemon took, or may have (it did not answer), is remembered, to be given
  # again to a daemon whose in-memory table is new (`Connection.remember_pause/3`). `asked`
  # is the pause's length, `nil` for a backoff's: its answer says it, and an unanswered
  # one pauses at least its first step.
  defp remembered(answer, handle, target, asked) do
    ms =
      case answer do
        :ok -> asked
        ms when is_integer(ms) -> ms
        {:error, %Error{type: :unavailable}} -> asked || Native.bound(:first_backoff_ms)
        {:error, _refused} -> nil
      end

    if ms, do: Connection.remember_pause(handle, pause_target(target), ms)
    answer
  end

  @doc "A snapshot of one key, or `nil` when the table does not hold it."
  @spec inspect(handle(), term()) :: map() | nil | error()
  def inspect(handle, key) do
    shape = fn answer -> with {:ok, info} <- Map.fetch(answer, "info"), do: info(info) end

    run(%{op: "inspect", key: key(key)}, handle, shape, {:inspect, [key]})
  end

  @doc "The daemon's counters since it started, and its live buckets and bookings."
  @spec stats(handle()) :: map() | error()
  def stats(handle) do
    run(%{op: "stats"}, handle, fn answer ->
      with {:ok, stats} <- Map.fetch(answer, "stats"), do: atom_keys(stats, @stats_fields)
    end)
  end

  @doc """
  The `count` keys with the most tokens borrowed, each as its `inspect/2` fields with its
  key's fields (the daemon shows credentials as fingerprints already).
  """
  @spec busiest(handle(), term()) :: [map()] | error()
  def busiest(handle, count) do
    shape = fn
      %{"keys" => rows} when is_list(rows) ->
        rows = for %{"key" => key, "info" => info} <- rows, do: row(key, info(info))
        if Enum.member?(rows, :error), do: :error, else: rows

      _answer ->
        :error
    end

    run(%{op: "busiest", count: value(count)}, handle, shape, {:busiest, [count]})
  end

  @doc """
  Nothing, and 0: a daemon sweeps its table on its own schedule (`--sweep-interval-ms`,
  which a port is started with from the limiter's `:sweep_interval_ms`), and Redis drops
  keys by their TTL. Limiters sharing one daemon would otherwise each sweep all of it.
  """
  @spec sweep(handle()) :: 0
  def sweep(_handle), do: 0

  ## Sending

  # Sends `request` and shapes a successful answer with `shape`; the daemon's errors come
  # back as it wrote them. `call` (`{callback, args}`, `nil` for a call without input) is
  # the same call for `NIF`, to judge its input when the daemon did not (`judged/2`).
  defp run(request, handle, shape, call \\ nil) do
    request |> answer(handle, shape, call) |> judged(call)
  end

  defp answer(request, handle, shape, call) do
    case Connection.request(handle, request, call && fn -> invalid(call) end) do
      %{"ok" => true} = answer ->
        case shape.(answer) do
          :error -> {:error, unexpected(answer)}
          shaped -> shaped
        end

      %{"ok" => false, "error" => %{"type" => "unavailable", "message" => message}} ->
        Connection.store_unavailable(handle, message)
        {:error, Error.unavailable(message)}

      %{"ok" => false, "error" => %{"type" => "invalid_parameters", "message" => message} = error}
      when is_binary(message) ->
        {:error, %Error{type: :invalid_parameters, message: message, exchange: error["exchange"]}}

      %{"ok" => false, "error" => %{"message" => message}} when is_binary(message) ->
        {:error, message}

      %{} = other ->
        {:error, unexpected(other)}

      {:error, _} = error ->
        error
    end
  end

  # An error of a call the daemon did not judge (it is unavailable, or the request is too
  # large for its frames: Connection.request's plain-string error): the core's
  # `:invalid_parameters` for the same call (`invalid/1`), or else `error` as it is. Run
  # only on these failures, and on answers slow to come (Connection.request/3).
  defp judged({:error, %Error{type: :unavailable}} = error, {_callback, _args} = call),
    do: judge(error, call)

  defp judged({:error, message} = error, {_callback, _args} = call) when is_binary(message),
    do: judge(error, call)

  defp judged(answer, _call), do: answer

  defp judge(error, call) do
    case invalid(call) do
      nil -> error
      invalid -> {:error, invalid}
    end
  end

  # The core's `:invalid_parameters` error for the call, judged by `NIF` on a scratch table
  # thrown away after, or nil.
  defp invalid({callback, args}) do
    case apply(NIF, callback, [Native.new_table(false, 0) | args]) do
      {:error, %Error{type: :invalid_parameters} = invalid} -> invalid
      _answer -> nil
    end
  end

  # Names the fields of a malformed answer, not their values: answers hold API keys.
  defp unexpected(%{} = answer),
    do: Error.unavailable("unexpected answer with fields #{Kernel.inspect(Map.keys(answer))}")

  # `max_wait_ms` for a waiter (a probe has none), with the limiter's booking slack.
  defp waiting(request, nil, _handle), do: request

  defp waiting(request, max_wait, %Connection{booking_slack_ms: nil}),
    do: Map.put(request, :max_wait_ms, value(max_wait))

  defp waiting(request, max_wait, %Connection{booking_slack_ms: slack}),
    do: Map.merge(request, %{max_wait_ms: value(max_wait), booking_slack_ms: slack})

  ## Answers

  defp outcome(%{"result" => "admitted"}), do: :ok

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

  defp row(%{"exchange" => exchange, "credential" => credential, "axis" => axis}, %{} = info),
    do: Map.merge(info, %{exchange: exchange, credential: credential || :public, axis: axis})

  defp row(_key, _info), do: :error

  ## Requests: terms in the wire format; the daemon judges them (bourse_core's rules)

  # Checks without a limit (or none) need no bucket: the core judges them in the caller, on
  # a table of its own that they leave as it is, so that they answer `:ok` whatever the
  # state of the daemon or its store. Malformed ones go to the daemon, which counts them in
  # its `stats.invalid` (and is judged for, when it cannot answer).
  defp limitless(false, _callback, _args), do: :send

  defp limitless(true, callback, args) do
    case apply(NIF, callback, [limitless_table() | args]) do
      :ok -> :ok
      _invalid -> :send
    end
  end

  defp limitless?([]), do: true
  defp limitless?([{_key, nil, _cost} | checks]), do: limitless?(checks)
  defp limitless?(_checks), do: false

  defp limitless_table do
    with nil <- :persistent_term.get({__MODULE__, :limitless_table}, nil) do
      table = Native.new_table(false, 0)
      :persistent_term.put({__MODULE__, :limitless_table}, table)
      table
    end
  end

  # A key tuple as the daemon's key object; anything else as its value (the daemon names
  # its shape).
  defp key({exchange, credential, axis}),
    do: %{exchange: value(exchange), credential: credential(credential), axis: value(axis)}

  defp key({exchange, credential}),
    do: %{exchange: value(exchange), credential: credential(credential)}

  defp key(other), do: value(other)

  # `:public` is the daemon's null (`nil`); `nil` is a value like any other.
  defp credential(:public), do: nil
  defp credential(nil), do: %{"$term": "nil"}
  defp credential(credential), do: value(credential)

  # A limit map of at most 2 keys with its keys: the limit's own atom keys by name, any
  # other by a placeholder of its index, so that none collide and the daemon sees the map's
  # size and which limit keys it has. A larger map, which the core refuses by its size
  # alone, as its value; `nil` as null.
  defp limit(nil), do: nil

  # The common shape, as the general clause below writes it, without walking the map.
  defp limit(%{capacity: capacity, refill_per_sec: refill} = limit)
       when map_size(limit) == 2 and is_number(capacity) and is_number(refill),
       do: %{"capacity" => capacity, "refill_per_sec" => refill}

  # (A struct too: its `__struct__` is one of its keys, as the NIF counts it.)
  defp limit(%{} = limit) when map_size(limit) <= 2 do
    limit
    |> Map.to_list()
    |> Enum.with_index()
    |> Map.new(fn
      {{key, value}, _i} when key in @limit_keys -> {Atom.to_string(key), value(value)}
      {{_key, value}, i} -> {"$key#{i}", value(value)}
    end)
  end

  defp limit(other), do: value(other)

  # A proper list of at most the core's `MAX_CHECKS` checks, each `{key, limit, cost}` as an object;
  # anything else as its value.
  defp checks(checks) when is_list(checks) do
    case bounded_length(checks, 0) do
      length when is_integer(length) -> Enum.map(checks, &check/1)
      _ -> value(checks)
    end
  end

  defp checks(other), do: value(other)

  defp check({key, limit, cost}), do: %{key: key(key), limit: limit(limit), cost: value(cost)}

  # Another tuple that starts with a key: its shape, and the key's exchange for the error.
  defp check(other)
       when tuple_size(other) > 0 and is_tuple(elem(other, 0)) and
              tuple_size(elem(other, 0)) in [2, 3],
       do: Map.put(value(other), :exchange, value(elem(elem(other, 0), 0)))

  defp check(other), do: value(other)

  defp pause_target(exchange) when is_binary(exchange), do: %{exchange: value(exchange)}

  defp pause_target({exchange, credential}),
    do: %{exchange: value(exchange), credential: credential(credential)}

  defp pause_target({_, _, _} = key), do: key(key)
  defp pause_target(other), do: value(other)

  defp backoff_credential({exchange, credential}),
    do: %{exchange: value(exchange), credential: credential(credential)}

  defp backoff_credential(other), do: value(other)

  # A scope is one of two atoms. A binary is none, even one spelt as a scope's name: it
  # travels as a placeholder of its size, which the daemon describes as the NIF does.
  defp scope(scope) when scope in [:credential, :exchange], do: Atom.to_string(scope)
  defp scope(other) when is_binary(other), do: :binary.copy("?", byte_size(other))
  defp scope(other), do: value(other)

  # A scalar as JSON holds it; any other term as its shape alone (`%{"$term": kind, ...}`,
  # docs/PROTOCOL.md): the daemon needs no more to name what is wrong, and never more than
  # the kind and size of a value that may be an API key travels. A binary travels whole
  # only if it could be a key part (UTF-8, within the core's bound): a longer one, refused
  # whatever it holds, goes by its size, so that it is refused as the NIF refuses it rather
  # than as a request too large for the daemon's frames.
  defp value(value) when is_binary(value) do
    if byte_size(value) <= Native.bound(:max_key_part_bytes) and utf8?(value),
      do: value,
      else: %{"$term": "binary", size: byte_size(value)}
  end

  defp value(value) when is_number(value) or is_boolean(value), do: value
  defp value(nil), do: nil
  defp value(value) when is_atom(value), do: %{"$term": "atom"}
  defp value(value) when is_bitstring(value), do: %{"$term": "bitstring"}
  defp value(value) when is_tuple(value), do: %{"$term": "tuple", arity: tuple_size(value)}
  defp value(value) when is_map(value), do: %{"$term": "map", size: map_size(value)}
  defp value(value) when is_pid(value), do: %{"$term": "pid"}
  defp value(value) when is_port(value), do: %{"$term": "port"}
  defp value(value) when is_reference(value), do: %{"$term": "reference"}
  defp value(value) when is_function(value), do: %{"$term": "function"}

  defp value(value) when is_list(value) do
    case bounded_length(value, 0) do
      :improper -> %{"$term": "improper_list"}
      :long -> %{"$term": "list"}
      length -> %{"$term": "list", len: length}
    end
  end

  # `String.valid?/1` in C, not a call per character: a valid binary comes back as itself.
  defp utf8?(binary), do: is_binary(:unicode.characters_to_binary(binary))

  # A list's length up to the core's `MAX_CHECKS` + 1 (`:long` past it), or `:improper`;
  # never walks further.
  defp bounded_length(list, length), do: bounded_length(list, length, Native.bound(:max_checks))

  defp bounded_length(_list, length, max) when length > max, do: :long
  defp bounded_length([], length, _max), do: length
  defp bounded_length([_ | tail], length, max), do: bounded_length(tail, length + 1, max)
  defp bounded_length(_tail, _length, _max), do: :improper
end
