defmodule Bourse.RateLimiter.Backend.Connection do
  @moduledoc """
  The process that owns one stream to a `bourse_daemon`: a Unix socket to the `--stdio`
  daemon that `Bourse.RateLimiter.Backend.Port` runs as a port, or the socket of
  `Bourse.RateLimiter.Backend.Daemon` (OTP's `:socket` both, no port in between).

  Callers encode and frame their request (with an `id`) in their own process, after noting
  its route (the `id` and an alias of the call) in this process's table. A caller with no
  other request in flight writes its frame to the socket itself and, while the daemon
  answers within microseconds, polls for its own answer: that costs less than being woken
  (`SocketStream`, "Who writes, who reads"). Otherwise it hands the frame to this process,
  which writes every frame it was handed meanwhile in one write (one system call, one
  wake-up of the daemon for many requests), reads the answers (many per read), finds each
  one's `id` without decoding it, takes its route from the table and sends it there; the
  caller decodes it (an admitted check's answer, the most common, it knows by its bytes).
  Encoding and decoding thus run in parallel in the callers. One reader at a time, and a
  caller only ever takes its own answer off the socket, whole.

  Frames never interleave: one writer at a time, a caller only when nothing else is in
  flight, this process the rest. What the socket takes only in part (the daemon is behind
  with its input) is written first, whole, when it has room; frames that find the socket
  full are tried again every millisecond, each until its caller's deadline; a socket that
  takes nothing more for the callers' timeout is closed (and reopened).

  Whoever takes a route from the table answers its caller: this process with the answer or
  the failure of the stream, or the caller itself when it gives up at its deadline. A caller
  giving up whose route this process took already takes the answer sent right after (it
  may have paid); one that took its route itself deactivates its alias, so an answer that
  comes later goes nowhere. Such an answer, if it paid, is asked back of the daemon
  (`give_back`, docs/PROTOCOL.md, "Deadlines"): the daemon gives back what it sent past
  the request's last moment to run. The route of a caller that died goes with its answer,
  or, if it died before its request was written, with the routes this process answers
  `:unavailable` a second past their caller's deadline (it looks every timeout, or every
  100 ms when the timeout is shorter). A caller still waiting looks every 200 ms
  whether this process lives: if it was killed, the caller answers `:unavailable` then.

  Each request carries its caller's deadline on the daemon's clock (docs/PROTOCOL.md,
  "Deadlines"), placed with the offset between that clock and this one that the hellos
  of the stream proved: a request the daemon reads too late to answer in time (it was
  stopped with the request in its input) does nothing, so a caller told `:unavailable`
  never pays.

  When the stream breaks, every caller waiting gets
  `{:error, %Bourse.Error{type: :unavailable}}` at once, and so does every call until the
  stream is back; a caller waits at most its timeout, never longer (unless the connection
  was handing it its answer at that moment: then it takes that answer, sent right after):

    * a port is reopened at once, with `--assume-busy-at-start` (docs/CONTRACT.md, P6: the new table
      admits no more than a fresh limiter that assumed every bucket busy at start);
    * a socket is reconnected with backoff (50 ms, doubling up to 2 s).

  The process is linked to its limiter. When the limiter ends (a crash, or a stop, as
  when its supervisor restarts it with its siblings), it keeps serving for a grace period
  of 5 s, for a limiter started again under that name to adopt it (`attach/3` with the
  previous handle), then stops: the port's table, and the pauses it holds, survive the
  end of the limiter process as the NIF table does. The pauses also outlive this process
  by the grace period, should it be killed.
  """

  use GenServer

  require Logger

  alias Bourse.{Error, Native}
  alias Bourse.RateLimiter.CallDeadline
  alias Bourse.RateLimiter.Backend.Connection.{PortStream, SocketStream}

  @enforce_keys [:pid, :table, :pauses, :owner_prefix, :timeout, :config]
  defstruct @enforce_keys ++ [booking_slack_ms: nil, daemon: "bourse_daemon"]

  @typedoc """
  A limiter's handle: the connection process and its table (the current stream, the
  requests in flight), the pauses it asked of the daemon (`remember_pause/3`; a table of
  their own, so that the table of requests tells a caller alone in flight), the prefix
  that makes booking owners unique among every client of
  the daemon, how long a caller waits for an answer, the booking slack its waiters name
  (`nil`: the daemon's own), which daemon it is, for messages, and a digest of its target,
  secrets and whether its hellos name its start (a limiter started again under the name
  adopts the connection only with the same ones).
  """
  @type t :: %__MODULE__{
          pid: pid(),
          table: :ets.tid(),
          pauses: :ets.tid(),
          owner_prefix: String.t(),
          timeout: pos_integer(),
          booking_slack_ms: non_neg_integer() | nil,
          daemon: String.t(),
          config: binary()
        }

  @typedoc "What to connect to: the daemon binary with its arguments, or a server address."
  @type target ::
          {:port, Path.t(), [String.t()]}
          | {:socket, {:tcp, :inet.ip_address() | charlist(), :inet.port_number()}}
          | {:socket, {:unix, Path.t(), non_neg_integer() | nil}}

  @protocol_version 1
  @first_backoff_ms 50
  @max_backoff_ms 2_000
  @orphan_grace_ms 5_000
  # Requests sent later (`send_later/2`) kept while the stream is down.
  @max_later 10_000
  @min_route_sweep_ms 100
  # A route still there this long past its caller's deadline is a dead caller's.
  @dead_route_ms 1_000
  # A caller whose route the connection took as it gave up waits this long at most for the
  # answer the connection sends right after.
  @handover_ms 100
  # An answer this late is slow: meanwhile the caller judges its input (`request/3`), and
  # an `:unavailable` one answers the later requests of its call (`CallDeadline`).
  @slow_ms 50
  # A caller still waiting looks this often whether the connection lives: one killed
  # leaves its callers' routes to no one.
  @liveness_ms 200
  # The daemon's `:unavailable` answers (its store could not answer) are logged at most
  # once in this long.
  @store_warning_every_ms 10_000
  @owner_key {__MODULE__, :owner}
  @digest_key {__MODULE__, :digest_key}

  # `%{"id" => id, "ok" => true, "result" => "admitted"}` as the daemon writes it: a map of
  # three keys, the id first, then binaries and the atom `true` (SMALL_ATOM_UTF8_EXT).
  @admitted_head <<131, ?t, 3::32, ?m, 2::32, "id">>
  @admitted_tail <<?m, 2::32, "ok", 119, 4, "true", ?m, 6::32, "result", ?m, 8::32, "admitted">>

  @doc """
  Returns a handle on a connection to `target` for the calling limiter process: the
  `previous` handle if its connection is alive and connected to the same target with the
  same secrets (it is adopted: linked to the caller), else a new connection.

  Options: `:timeout` (ms a caller waits for an answer), `:assume_busy_at_start` (a
  port's daemon is started with `--assume-busy-at-start`; always when it replaces a
  previous one, unless `:table_outlives_daemon`), `:busy_start` (each hello names how long
  ago the connection started, and the daemon counts the buckets new to it as busy since;
  default: `:assume_busy_at_start` as given), `:table_outlives_daemon` (the daemon's buckets live
  in Redis: a daemon started again finds them, and is started as the first one was),
  `:booking_slack_ms` (sent with every waiting check), `:env` (the port's environment:
  secrets never go on its command line), `:secret` (what a socket proves when the
  daemon asks), `:restart` (it replaces a previous connection) and `:retry_refusals` (it
  replaces one of the same target and secrets: a daemon that refuses the secret does not
  fail it, as it fails a first start).
  """
  @spec attach(t() | nil, target(), keyword()) :: {:ok, t()} | {:error, term()}
  def attach(%__MODULE__{pid: pid} = previous, target, opts) do
    # Read first: a connection that cannot be adopted ends, and its tables with it.
    pauses = remembered_pauses(previous)

    timeout = Keyword.fetch!(opts, :timeout)
    config = config_digest(target, opts)

    if adopt(pid, config, timeout) == :ok do
      {:ok,
       %{previous | timeout: timeout, booking_slack_ms: Keyword.get(opts, :booking_slack_ms)}}
    else
      busy = opts[:assume_busy_at_start] == true or not table_outlives_daemon?(opts)
      # The pauses asked of the previous daemon are asked of the new one, as of a daemon
      # restarted under the same connection. Only with the same target and secrets does it
      # keep trying a store that refuses it: other ones are a new configuration, refused at
      # start if wrong.
      opts =
        Keyword.merge(opts,
          assume_busy_at_start: busy,
          busy_start: busy_start?(opts),
          restart: true,
          retry_refusals: previous.config == config,
          pauses: pauses
        )

      attach(nil, target, opts)
    end
  end

  def attach(nil, target, opts) do
    timeout = Keyword.fetch!(opts, :timeout)
    config = config_digest(target, opts)

    init_arg =
      {target, self(), Keyword.get(opts, :assume_busy_at_start, false), timeout,
       [config: config, busy_start: busy_start?(opts)] ++
         Keyword.take(opts, [
           :env,
           :secret,
           :restart,
           :retry_refusals,
           :table_outlives_daemon,
           :pauses
         ])}

    with {:ok, pid} <- GenServer.start(__MODULE__, init_arg) do
      {table, pauses} = GenServer.call(pid, :tables)

      {:ok,
       %__MODULE__{
         pid: pid,
         table: table,
         pauses: pauses,
         owner_prefix: owner_prefix(),
         timeout: timeout,
         booking_slack_ms: Keyword.get(opts, :booking_slack_ms),
         daemon: transport(target).describe(target),
         config: config
       }}
    end
  end

  # Pids are only unique within one VM: the prefix tells this connection's owners apart
  # from every other client's of a daemon or Redis (the OS pid, and random bytes for other
  # connections, hosts and reused OS pids). It stays with the connection, through its
  # streams opened again: a booking in Redis is claimed through a daemon started again.
  defp owner_prefix, do: "#{System.pid()}.#{Base.url_encode64(:rand.bytes(6))}."

  # The pauses a connection remembers (`remember_pause/3`); none once it is gone.
  defp remembered_pauses(%__MODULE__{pauses: table}) do
    :ets.tab2list(table)
  rescue
    ArgumentError -> []
  end

  defp adopt(pid, config, timeout) do
    GenServer.call(pid, {:adopt, self(), config, timeout})
  catch
    :exit, _ -> :gone
  end

  # What a connection is to and with: its target, its secrets (`:env`, `:secret`) and
  # whether its hellos name its start (`busy_start?/1`), as an HMAC-SHA256 under a key of
  # this VM's, so that no secret travels in a message or stays in a handle, nor can be
  # guessed from it.
  defp config_digest(target, opts) do
    data = :erlang.term_to_binary({target, opts[:env], opts[:secret], busy_start?(opts)})
    :crypto.mac(:hmac, :sha256, digest_key(), data)
  end

  # Made once per VM. Two limiters making it at once may each use their own: a connection
  # so described is not adopted, and is replaced, as one of another configuration is.
  defp digest_key do
    case :persistent_term.get(@digest_key, nil) do
      nil ->
        key = :crypto.strong_rand_bytes(32)
        :persistent_term.put(@digest_key, key)
        key

      key ->
        key
    end
  end

  @doc """
  Sends one request (a map, see `encode/2`) and returns the daemon's answer, decoded, or
  `{:error, message}` for a request too large for the daemon, or
  `{:error, %Bourse.Error{type: :unavailable}}`.

  `judge`, if given, is run once when no answer came within #{@slow_ms} ms: an error it
  returns (the request's input, judged in the caller, is malformed) answers at once, so
  that a daemon stopped or slow does not keep a malformed call waiting for its timeout.
  """
  @spec request(t(), map(), (() -> Error.t() | nil) | nil) ::
          map() | {:error, String.t() | Error.t()}
  def request(%__MODULE__{} = handle, request, judge \\ nil) do
    id = System.unique_integer([:positive])
    now_us = System.monotonic_time(:microsecond)
    now_ms = div(now_us, 1000)

    case CallDeadline.deadline(handle.table, now_ms + handle.timeout) do
      {:answered, answer} -> answer
      deadline -> publish(handle, request, {id, deadline, judge}, {now_us, now_ms})
    end
  end

  defp publish(handle, request, {id, deadline, _judge} = call, {now_us, now_ms}) do
    case :ets.lookup(handle.table, :stream) do
      [{:stream, nil, _transport, _max, down, _offset}] ->
        {:error, Error.unavailable(down)}

      [{:stream, _stream, _transport, _max, _down, _offset}] when deadline <= now_ms ->
        {:error, Error.unavailable(did_not_answer(handle.daemon, handle.timeout))}

      [{:stream, stream, transport, max, _down, offset}] ->
        payload = encode(id, with_deadline(request, deadline - now_ms, now_us, offset))

        case byte_size(payload) do
          size when size > max ->
            {:error,
             "the request is #{size} bytes encoded, more than the daemon accepts " <>
               "(#{max}, its --max-frame-bytes)"}

          size ->
            frame = PortStream.frame(payload, size)
            answer = handle |> call(call, {stream, transport, frame}) |> answer(id)

            if System.monotonic_time(:millisecond) - now_ms >= @slow_ms,
              do: CallDeadline.slow(handle.table, answer),
              else: answer
        end
    end
  rescue
    # The table went with its process.
    ArgumentError -> {:error, gone()}
  end

  # The moment this caller stops waiting, on the daemon's clock (docs/PROTOCOL.md,
  # "Deadlines"): the daemon runs the request only until a quarter of the timeout before it.
  defp with_deadline(request, _timeout, _now_us, nil), do: request

  defp with_deadline(request, timeout, now_us, offset_us),
    do:
      Map.merge(request, %{deadline_us: now_us + timeout * 1000 + offset_us, timeout_ms: timeout})

  # The caller notes its route (the id and an alias of this call) for whoever reads the
  # answer: the connection, which sends it there, or the caller itself, alone in flight
  # (`SocketStream.solo/5`). Whoever takes the route from the table answers: the
  # connection with the answer (or the failure of the stream), or the caller that gives up
  # or read its answer itself; once the alias is gone, nothing more arrives.
  defp call(handle, {id, deadline, judge}, {stream, _transport, frame}) do
    reply_to = :erlang.alias([:reply])
    :ets.insert(handle.table, {id, {reply_to, deadline}})
    route = {id, reply_to, deadline}

    case SocketStream.solo(stream, handle.table, handle.pid, id, frame) do
      # The real answer, though the stream broke meanwhile and the connection sent why.
      {:answer, answer} ->
        give_up(handle, route, nil)
        answer

      :written ->
        await(handle, route, judge)

      :shared ->
        send(handle.pid, {:write, stream, id, frame})
        await(handle, route, judge)

      {:error, reason} ->
        write_failed(handle, route, stream, reason, judge)
    end
  end

  # A stream fails a write when it closed: the connection is told, the stream may still
  # look alive to it (the daemon closed a socket, after a refusal, say). While it does, the
  # connection will close it and answer this call's route with why; once it has, the
  # caller reads why.
  defp write_failed(handle, route, stream, reason, judge) do
    send(handle.pid, {:write_failed, stream, reason})

    case :ets.lookup(handle.table, :stream) do
      [{:stream, ^stream, _transport, _max, _down, _offset}] ->
        await(handle, route, judge)

      [{:stream, _other, _transport, _max, down, _offset}] ->
        give_up(handle, route, {:error, Error.unavailable(down)})
    end
  end

  # What the connection answers the route, or nothing by the deadline. With a `judge`
  # (`request/3`), an answer slow to come has the input judged meanwhile: a malformed one
  # answers at once.
  defp await(handle, {_id, reply_to, deadline} = route, judge) do
    left = max(deadline - System.monotonic_time(:millisecond), 0)

    receive do
      {^reply_to, answer} -> answer
    after
      min(if(judge, do: @slow_ms, else: @liveness_ms), left) -> waited(handle, route, judge)
    end
  end

  defp waited(handle, {_id, reply_to, deadline} = route, nil) do
    cond do
      System.monotonic_time(:millisecond) >= deadline ->
        send(handle.pid, :unanswered)

        give_up(
          handle,
          route,
          {:error, Error.unavailable(did_not_answer(handle.daemon, handle.timeout))}
        )

      Process.alive?(handle.pid) ->
        await(handle, route, nil)

      # Whatever it sent before it ended has arrived.
      true ->
        receive do
          {^reply_to, answer} -> answer
        after
          0 -> {:error, gone()}
        end
    end
  end

  defp waited(handle, route, judge) do
    case judge.() do
      nil -> await(handle, route, nil)
      %Error{} = error -> give_up(handle, route, {:error, error})
    end
  end

  # The caller stops waiting, with `error` as its answer, unless the connection took its
  # route first: then the answer (or the stream's failure) is sent right after, and is
  # taken, for it may have paid. An answer that comes once the alias is gone goes nowhere.
  defp give_up(handle, {id, reply_to, _deadline}, error) do
    wait = if :ets.take(handle.table, id) == [], do: @handover_ms, else: 0

    answer =
      receive do
        {^reply_to, answer} -> answer
      after
        wait -> error
      end

    :erlang.unalias(reply_to)

    receive do
      {^reply_to, answer} -> answer
    after
      0 -> answer
    end
  end

  defp did_not_answer(daemon, timeout), do: "#{daemon} did not answer within #{timeout} ms"

  @doc false
  # The answer to request `id` as the caller got it: as the daemon wrote it, unless the
  # connection had to decode it to find its id. The most common one, a check admitted, is
  # known by its bytes after the id (the connection routed it here by that id), with
  # nothing decoded.
  @spec answer(binary() | map() | {:error, term()}, integer()) :: map() | {:error, term()}
  def answer(<<@admitted_head, rest::binary>>, _id)
      when byte_size(rest) > byte_size(@admitted_tail) and
             binary_part(rest, byte_size(rest), -byte_size(@admitted_tail)) == @admitted_tail,
      do: %{"ok" => true, "result" => "admitted"}

  def answer(frame, id) when is_binary(frame) do
    case decode(frame) do
      {:ok, %{"id" => ^id} = answer} -> answer
      _ -> {:error, Error.unavailable(not_protocol())}
    end
  end

  def answer(answer, _id), do: answer

  @doc """
  Sends `request` without a deadline and without waiting for its answer, which is dropped
  (id 0): the daemon runs it whenever it reads it. While the stream is down, or if it
  breaks before the request is written, the request waits for the next stream, once
  however often it is sent meanwhile (at most #{@max_later} such requests wait; further
  ones are dropped).
  """
  @spec send_later(t(), map()) :: :ok
  def send_later(%__MODULE__{pid: pid}, request) do
    GenServer.cast(pid, {:send_later, request})
  end

  @doc """
  Notes that the daemon answered a call `:unavailable` with `message` (its store, Redis,
  could not answer in time): the connection logs it as a warning, at most once every
  #{div(@store_warning_every_ms, 1000)} s.
  """
  @spec store_unavailable(t(), String.t()) :: :ok
  def store_unavailable(%__MODULE__{pid: pid}, message) do
    send(pid, {:store_unavailable, message})
    :ok
  end

  defp not_protocol,
    do: "the daemon sent something that is not a protocol #{@protocol_version} answer term"

  defp gone, do: Error.unavailable("the connection to bourse_daemon is gone")

  @doc """
  Remembers that the daemon was asked to pause `target` (as a request names it) for `ms`
  from now, to ask it again of a daemon whose in-memory table is new (a port restarted
  after a crash, a shared daemon restarted): pauses, unlike spent tokens, are not covered
  by `--assume-busy-at-start`. Overlapping pauses keep the later end. Past as many as a
  table holds in force (`:max_pauses`), a new one is remembered as a pause of its whole
  exchange, as the table itself holds it.
  """
  @spec remember_pause(t(), term(), non_neg_integer()) :: :ok
  def remember_pause(%__MODULE__{pauses: table}, target, ms) do
    # Ends are kept negated: `update_counter/4` lowers a counter to a threshold, not raises it.
    until = System.monotonic_time(:millisecond) + ms

    target =
      case target do
        %{exchange: exchange} = target ->
          if :ets.info(table, :size) < Native.bound(:max_pauses),
            do: target,
            else: %{exchange: exchange}

        other ->
          other
      end

    :ets.update_counter(table, target, {2, 0, -until, -until}, {target, -until})

    :ok
  rescue
    # The table went with its process.
    ArgumentError -> :ok
  end

  @doc """
  The last moment (monotonic ms) the daemon may have lost what it held for the limiter's
  callers, their bookings: the stream to it broke, or it answered a hello with a new
  table. `nil` when it never did, or the connection is gone with its limiter (whose
  stop `Bourse.RateLimiter.wait_for_capacity/5` judges as such).
  """
  @spec store_lost_at(t()) :: integer() | nil
  def store_lost_at(%__MODULE__{table: table}) do
    case :ets.lookup(table, :store_lost_at) do
      [{:store_lost_at, ms}] -> ms
      [] -> nil
    end
  rescue
    ArgumentError -> nil
  end

  @doc """
  Forgets the remembered pauses a reset ended: every one (`:all`), those of every target
  of an exchange (`{:exchange, exchange}`: the exchange, its credentials and their keys),
  or that of one target, as a request names it; `:ok`.
  """
  @spec forget_pauses(t(), :all | {:exchange, term()} | map()) :: :ok
  def forget_pauses(%__MODULE__{pauses: table}, ended) do
    case ended do
      :all ->
        :ets.delete_all_objects(table)

      {:exchange, exchange} ->
        of_exchange = [{:==, {:map_get, :exchange, :"$1"}, exchange}]
        :ets.select_delete(table, [{{:"$1", :_}, of_exchange, [true]}])

      target ->
        :ets.delete(table, target)
    end

    :ok
  rescue
    ArgumentError -> :ok
  end

  @doc """
  The booking owner the daemon knows `owner` (a pid, or `{pid, integer}`) by. The last one
  rendered is kept in the calling process's dictionary (rendering a pid costs more than
  the rest of a request's terms).
  """
  @spec owner(t(), pid() | {pid(), integer()}) :: String.t()
  def owner(%__MODULE__{owner_prefix: prefix}, owner) do
    case Process.get(@owner_key) do
      {^prefix, ^owner, rendered} ->
        rendered

      _other ->
        rendered = prefix <> rendered(owner)
        Process.put(@owner_key, {prefix, owner, rendered})
        rendered
    end
  end

  defp rendered({pid, number}), do: rendered(pid) <> "#" <> Integer.to_string(number)
  defp rendered(pid), do: List.to_string(:erlang.pid_to_list(pid))

  ## The process

  @doc false
  # A request in the external term format (docs/PROTOCOL.md, "Codecs"): the map with its
  # `id`, as the daemon reads a JSON object. `nil` is JSON's null.
  @spec encode(integer(), map()) :: binary()
  def encode(id, request), do: :erlang.term_to_binary(Map.put(request, :id, id))

  @impl true
  def init({target, limiter, assume_busy, timeout, extra}) do
    Process.flag(:trap_exit, true)

    state = %{
      target: target,
      config: Keyword.fetch!(extra, :config),
      transport: transport(target),
      timeout: timeout,
      table: :ets.new(__MODULE__, [:public, read_concurrency: true, write_concurrency: true]),
      pauses: remembering(Keyword.get(extra, :pauses, [])),
      assume_busy: assume_busy,
      # With the limiter's assume_busy_at_start: its start (monotonic µs), which each hello
      # names, so that the daemon counts the buckets new to it as busy since then.
      busy_start: if(Keyword.get(extra, :busy_start), do: System.monotonic_time(:microsecond)),
      stream: nil,
      partial: [],
      pending: [],
      # Requests sent later, newest first, that wait for the next stream, and their encoded
      # terms (each waits once).
      later: [],
      kept_later: MapSet.new(),
      # The ids of paid answers read with no caller waiting, to ask back (`ask_back/2`).
      unclaimed: [],
      unsent: nil,
      retry_timer: nil,
      down_reason: "not connected yet",
      backoff_ms: @first_backoff_ms,
      connected_before: false,
      # The daemon's in-memory table, as its last hello named it (none with Redis).
      daemon_table: nil,
      limiter: limiter,
      orphan_timer: nil,
      silence_probe: nil,
      # The stream and its frame limit while it is silent (`silenced/2`).
      silenced: nil,
      clock_offset_us: nil,
      store_warned_at: nil,
      env: Keyword.get(extra, :env, []),
      secret: Keyword.get(extra, :secret),
      restart: Keyword.get(extra, :restart, false),
      retry_refusals: Keyword.get(extra, :retry_refusals, false),
      table_outlives_daemon: table_outlives_daemon?(extra)
    }

    publish(state, nil, nil)
    drop_late_routes_later(state)

    case open(state) do
      {:ok, state} ->
        Process.link(limiter)
        {:ok, state}

      # A daemon that refuses this limiter's configuration (its secret) at its first start
      # will not take it later either; a port that cannot start is a configuration error.
      # A restart with the same configuration (after a crash: a secret or a Redis password
      # changed since, say) retries, as a connection that breaks does, rather than fail
      # its supervisor.
      {:error, {:misconfigured, _message} = reason} when not state.retry_refusals ->
        {:stop, reason}

      {:error, reason} ->
        if state.retry_refusals or state.transport.start_without_it?() do
          Logger.warning("#{describe(state)}: #{reason_text(reason)}; retrying")
          Process.link(limiter)
          {:ok, down(state, reason)}
        else
          {:stop, reason}
        end
    end
  end

  # A crash report shows neither the secrets (the shared secret, the port's environment)
  # nor requests or answers, which hold API keys (OTP 25 formats gen_server crash reports
  # with format_status/1).
  @doc false
  def format_status(status) do
    status
    |> Map.replace_lazy(:state, &redact_state/1)
    |> Map.replace_lazy(:message, &redact_message/1)
  end

  defp redact_state(%{} = state) do
    %{
      state
      | secret: state.secret && "[redacted]",
        env: for({name, _value} <- state.env, do: {name, ~c"[redacted]"}),
        pending: "#{length(state.pending)} frames",
        later: "#{MapSet.size(state.kept_later)} frames",
        kept_later: "[redacted]",
        unsent: state.unsent && "[redacted]",
        partial: "[redacted]"
    }
  end

  defp redact_message({:write, stream, id, _frame}), do: {:write, stream, id, "[redacted]"}

  defp redact_message({:"$gen_cast", {:send_later, _}}),
    do: {:"$gen_cast", {:send_later, "[redacted]"}}

  defp redact_message({from, {:data, _data}}), do: {from, {:data, "[redacted]"}}
  defp redact_message({:tcp, socket, _data}), do: {:tcp, socket, "[redacted]"}
  defp redact_message(message), do: message

  @impl true
  def handle_call(:tables, _from, state), do: {:reply, {state.table, state.pauses}, state}

  def handle_call({:adopt, limiter, config, timeout}, _from, %{config: config} = state) do
    Process.link(limiter)
    if state.orphan_timer, do: Process.cancel_timer(state.orphan_timer)
    {:reply, :ok, %{state | limiter: limiter, orphan_timer: nil, timeout: timeout}}
  end

  def handle_call({:adopt, _limiter, _config, _timeout}, _from, %{limiter: nil} = state) do
    {:stop, :normal, :other_target, state}
  end

  def handle_call({:adopt, _limiter, _config, _timeout}, _from, state),
    do: {:reply, :other_target, state}

  # Any process can call or cast to this one: what is not its own is ignored, as the
  # limiter process ignores it.
  def handle_call(request, _from, state) do
    unexpected("call", request, state)
    {:reply, {:error, Error.invalid("not a connection request")}, state}
  end

  @impl true
  def handle_cast({:send_later, request}, state) do
    frame = encode(0, request)

    case state do
      %{stream: nil} ->
        {:noreply, keep_later(state, [frame])}

      _up ->
        later = {:later, PortStream.frame(frame, byte_size(frame))}
        {:noreply, write_pending(%{state | pending: [later | state.pending]})}
    end
  end

  def handle_cast(request, state) do
    unexpected("cast", request, state)
    {:noreply, state}
  end

  defp unexpected(kind, message, state),
    do:
      Logger.warning(
        "#{describe(state)} ignored an unexpected #{kind}: #{Error.describe(message)}"
      )

  @impl true
  # Crashed or stopped (a supervisor restarts a limiter with its siblings by stopping it):
  # a limiter started again under its name may adopt the connection within the grace.
  def handle_info({:EXIT, limiter, _reason}, %{limiter: limiter} = state),
    do: {:noreply, orphaned(state)}

  def handle_info(:reopen, %{stream: nil} = state), do: {:noreply, reopen(state)}

  # The daemon closes connections idle for longer than its idle timeout. The hello is written
  # with the callers' frames, and dropped as theirs are when the stream is busy (a stream too
  # busy to take it is not idle).
  def handle_info({:keepalive, stream, idle_ms}, %{stream: stream} = state),
    do: {:noreply, state |> write_hello() |> keepalive(idle_ms)}

  # A caller got no answer within its timeout. A connection to a daemon's socket may have
  # gone silent for good (a proxy or firewall that lost the flow and never closes it): a
  # hello goes out, and if the connection reads no answer within a timeout (at least 1 s)
  # either, it is made again. (A port's daemon is watched by its port.)
  def handle_info(
        :unanswered,
        %{stream: stream, target: {:socket, _}, silence_probe: nil} = state
      )
      when stream != nil do
    probe = make_ref()
    Process.send_after(self(), {:silence_probe, probe}, silence_wait_ms(state))
    {:noreply, write_hello(%{state | silence_probe: probe})}
  end

  # Only the probe still unanswered counts: an earlier one's hello was answered. The
  # connection is made again once no caller waits on it: a stopped daemon that resumes may
  # still run a request written on it until its last moment to run, so its caller waits
  # for the answer (or, past its deadline, the connection asks it back) as it would have.
  # New calls meanwhile are answered `:unavailable`, unwritten.
  def handle_info({:silence_probe, probe}, %{silence_probe: probe} = state) do
    reason = "the daemon answered nothing, not even a hello, for #{silence_wait_ms(state)} ms"

    now = System.monotonic_time(:millisecond)

    case last_deadline(state.table) do
      deadline when is_integer(deadline) and deadline >= now ->
        Process.send_after(self(), {:silence_probe, probe}, deadline - now + 1)
        {:noreply, silenced(state, reason)}

      _none_waits ->
        {:noreply, reconnect(broken(%{state | silence_probe: nil}, reason))}
    end
  end

  # A caller's frame that the socket took in part: the rest goes first.
  def handle_info({:unsent, stream, rest}, %{stream: stream} = state),
    do: {:noreply, write_pending(take_unsent(state, rest))}

  # A caller wrote its request and left the reading, or stopped reading, with answers still
  # expected.
  def handle_info({:read, stream}, %{stream: stream} = state) do
    :ok = state.transport.read_for(stream, state.table)
    {:noreply, state}
  end

  def handle_info(:orphaned, %{limiter: nil} = state), do: {:stop, :normal, state}

  def handle_info({:store_unavailable, message}, state) do
    now = System.monotonic_time(:millisecond)

    if state.store_warned_at == nil or now - state.store_warned_at >= @store_warning_every_ms do
      Logger.warning("#{describe(state)}: #{message}")
      {:noreply, %{state | store_warned_at: now}}
    else
      {:noreply, state}
    end
  end

  # The routes of callers killed between noting them and writing: no answer comes for them.
  # (A live caller takes its own route at its deadline; one that found it taken waits for
  # what this process sends there.) And the rows of callers killed as they wrote or read
  # the socket themselves.
  def handle_info(:drop_late_routes, state) do
    now = System.monotonic_time(:millisecond)
    dead_by = now - @dead_route_ms
    late = [{{:"$1", {:_, :"$2"}}, [{:is_integer, :"$1"}, {:<, :"$2", dead_by}], [:"$1"]}]
    error = {:error, Error.unavailable(did_not_answer(describe(state), state.timeout))}

    answer_routes(state.table, :ets.select(state.table, late), error)

    :ets.select_delete(state.pauses, [{{:_, :"$1"}, [{:>, :"$1", -now}], [true]}])

    for {solo, pid} <- :ets.match_object(state.table, {{:solo, :_}, :_}),
        not Process.alive?(pid),
        do: :ets.delete(state.table, solo)

    # A caller killed once it wrote its request alone, before it left the reading to this
    # process, left its answer to no one: read now, so that callers alone read their own
    # again.
    if state.stream, do: :ok = state.transport.read_for(state.stream, state.table)
    drop_late_routes_later(state)
    {:noreply, state}
  end

  def handle_info({:write, stream, id, frame}, %{stream: stream} = state),
    do:
      {:noreply,
       write_pending(%{state | pending: more_frames(stream, [{id, frame} | state.pending])})}

  # A frame for a stream that broke since: its caller is told at once.
  def handle_info({:write, _stream, id, _frame}, state) do
    answer_routes(state.table, [id], {:error, Error.unavailable(unavailable(state))})
    {:noreply, state}
  end

  def handle_info({:write_pending, stream}, %{stream: stream} = state),
    do: {:noreply, write_pending(%{state | retry_timer: nil})}

  def handle_info({:write_failed, stream, reason}, %{stream: stream} = state),
    do: {:noreply, reconnect(broken(state, cannot_write(reason)))}

  # Answers and the end of the stream; anything else (exits of ports already replaced,
  # stale timers, messages of closed sockets) is dropped.
  def handle_info(message, %{stream: stream} = state) when stream != nil do
    case state.transport.received(message, stream) do
      {:data, data} ->
        case state.transport.answers(state.partial, data) do
          {:error, answers, reason} ->
            incoming_then_broken(answers, state, reason)

          {answers, partial} ->
            {:noreply, state} = incoming(answers, %{state | partial: partial})
            {:noreply, state |> settled(stream, length(answers)) |> ask_back(stream)}
        end

      {:down, reason} ->
        {:noreply, reconnect(broken(state, reason))}

      :other ->
        {:noreply, state}
    end
  end

  def handle_info(_message, state), do: {:noreply, state}

  # Unless an answer broke the stream already.
  defp settled(%{stream: stream} = state, stream, count) do
    case state.transport.settled(stream, count, state.partial) do
      :ok -> state
      {:error, reason} -> reopen_later(broken(state, reason))
    end
  end

  defp settled(state, _stream, _count), do: state

  # Every frame given to this process that is in its mailbox already.
  defp more_frames(stream, frames) do
    receive do
      {:write, ^stream, id, frame} -> more_frames(stream, [{id, frame} | frames])
    after
      0 -> frames
    end
  end

  # The frames given to this process, in one write; a stream busy with earlier requests is
  # tried again every millisecond, with the frames of the callers still waiting. What a
  # socket took only in part goes first, whole; a socket that takes nothing more of it for
  # the callers' timeout is closed.
  defp write_pending(%{pending: [], unsent: nil} = state), do: state
  defp write_pending(%{retry_timer: timer} = state) when timer != nil, do: state

  defp write_pending(state) do
    state = unsent_of_caller(state)
    frames = Enum.map(state.pending, &elem(&1, 1))
    data = if state.unsent, do: [elem(state.unsent, 0) | frames], else: frames

    case state.transport.write_nowait(state.stream, state.table, data, length(frames)) do
      :ok ->
        written(%{state | pending: [], unsent: nil})

      {:partial, rest} ->
        state |> Map.merge(%{pending: [], unsent: {rest, now_ms()}}) |> written() |> retry_later()

      :busy ->
        busy(state)

      # A caller is writing its own, for a few microseconds.
      :wait ->
        send(self(), {:write_pending, state.stream})
        %{state | retry_timer: :posted}

      # A caller sends the rest of its frame before it drops its row: one that looked dead
      # handing it over may have handed it over since this write looked for it.
      {:error, :writer_killed} ->
        case unsent_of_caller(state) do
          %{unsent: nil} -> reconnect(broken(state, cannot_write(:writer_killed)))
          handed_over -> write_pending(handed_over)
        end

      {:error, reason} ->
        reconnect(broken(state, cannot_write(reason)))
    end
  end

  # Why a write failed, in words, with the reason as the socket or port gave it.
  defp cannot_write(reason) when reason in [:epipe, :closed, :econnreset, :enotconn],
    do: "cannot write: the daemon closed the connection (#{inspect(reason)})"

  defp cannot_write(:writer_killed),
    do: "cannot write: a caller was killed while writing (:writer_killed)"

  defp cannot_write(reason), do: "cannot write: #{inspect(reason)}"

  # A caller's frame the socket took in part goes first (a caller that dies once it handed
  # it over looks dead to `write_nowait/4`).
  defp unsent_of_caller(%{stream: stream} = state) do
    receive do
      {:unsent, ^stream, rest} -> take_unsent(state, rest)
    after
      0 -> state
    end
  end

  defp take_unsent(state, rest) do
    :ok = state.transport.unsent(state.stream)
    %{state | unsent: {rest, now_ms()}}
  end

  defp written(state) do
    :ok = state.transport.read_for(state.stream, state.table)
    state
  end

  defp busy(state) do
    now = now_ms()

    case state.unsent do
      {_rest, since} when since + state.timeout < now ->
        reconnect(broken(state, "it took no input for #{state.timeout} ms"))

      _none_or_recent ->
        withdraw_late(state)
    end
  end

  defp withdraw_late(state) do
    pending =
      Enum.filter(state.pending, &(not callers?(&1) or :ets.member(state.table, elem(&1, 0))))

    retry_later(%{state | pending: pending})
  end

  # A caller's frame, rather than this process's own (a hello, a pause asked again, a
  # give_back, a request sent later), which stays until written.
  defp callers?({id, _frame}), do: is_integer(id) and id > 0

  defp retry_later(state) do
    timer = Process.send_after(self(), {:write_pending, state.stream}, 1)
    %{state | retry_timer: timer}
  end

  defp now_ms, do: System.monotonic_time(:millisecond)

  # Every timeout, and no more often than every @min_route_sweep_ms (each look scans the table).
  defp drop_late_routes_later(state),
    do: Process.send_after(self(), :drop_late_routes, max(state.timeout, @min_route_sweep_ms))

  defp orphaned(state) do
    timer = Process.send_after(self(), :orphaned, @orphan_grace_ms)
    %{state | limiter: nil, orphan_timer: timer}
  end

  # The answers before something that is no answer, then the stream is broken (unless one
  # of them broke it already).
  defp incoming_then_broken(answers, %{stream: stream} = state, reason) do
    case incoming(answers, state) do
      {:noreply, %{stream: ^stream} = state} -> {:noreply, reopen_later(broken(state, reason))}
      already_broken -> already_broken
    end
  end

  defp incoming([], state), do: {:noreply, state}

  # Any answer shows the connection is not silent.
  defp incoming([answer | answers], state) do
    case answered(heard(state), answer) do
      {:ok, state} -> incoming(answers, state)
      {:error, reason} -> {:noreply, reopen_later(broken(state, reason))}
    end
  end

  defp answered(state, frame) do
    case answer_id(frame) do
      # A keepalive's hello (callers' ids are positive): what it tells of the daemon's clock.
      {:ok, 0, answer} ->
        {:ok, observed_clock(state, answer)}

      {:ok, id, answer} ->
        case :ets.take(state.table, id) do
          [{^id, {reply_to, _deadline}}] ->
            send(reply_to, {reply_to, answer})
            {:ok, state}

          [] ->
            dropped(state)
            {:ok, unclaimed(state, id, answer)}
        end

      # Without an id, about the connection: the daemon refuses it (past its
      # --max-connections) and closes it next. Its callers learn why.
      {:unmatched, %{"error" => %{"type" => "unavailable", "message" => message}}}
      when is_binary(message) ->
        {:error, "the daemon refused the connection: #{String.slice(message, 0, 300)}"}

      {:unmatched, _answer} ->
        dropped(state)
        {:ok, state}

      :error ->
        {:error, not_protocol()}
    end
  end

  # The stream, hidden from new callers while it is silent (`silenced/2`).
  defp silenced(%{silenced: nil} = state, reason) do
    [{:stream, stream, _transport, max_frame_bytes, _down, _offset}] =
      :ets.lookup(state.table, :stream)

    state = %{state | down_reason: reason, silenced: {stream, max_frame_bytes}}
    publish(state, nil, nil)
    state
  end

  defp silenced(state, _reason), do: state

  defp heard(%{silenced: {stream, max_frame_bytes}} = state) do
    :ets.update_element(state.table, :stream, [{2, stream}, {4, max_frame_bytes}])
    %{state | silence_probe: nil, silenced: nil}
  end

  defp heard(state), do: %{state | silence_probe: nil}

  # The latest deadline of the callers waiting, if any wait.
  defp last_deadline(table) do
    table
    |> :ets.select([{{:"$1", {:_, :"$2"}}, [{:is_integer, :"$1"}], [:"$2"]}])
    |> Enum.max(fn -> nil end)
  end

  # Takes the routes of `ids` still in `table` and sends each caller `answer`: whoever takes
  # a route answers it, so a caller that finds its route gone waits for what comes.
  defp answer_routes(table, ids, answer) do
    for id <- ids,
        {^id, {reply_to, _deadline}} <- :ets.take(table, id),
        do: send(reply_to, {reply_to, answer})

    :ok
  end

  # An answer to a caller that gave up already, or an error without an id. Not shown:
  # answers hold keys, and keys hold API keys.
  defp dropped(state),
    do: Logger.debug("#{describe(state)}: dropped an answer no caller waits for")

  # A request whose caller gave up (and was told `:unavailable`) may have paid: it is to be
  # asked back once the answers read with it are handled (`ask_back/2`).
  defp unclaimed(state, id, answer) when id > 0 do
    case answer(answer, id) do
      %{"ok" => true} -> %{state | unclaimed: [id | state.unclaimed]}
      _unpaid -> state
    end
  end

  defp unclaimed(state, _id, _answer), do: state

  # What the unclaimed answers read from `stream` paid is asked back, in one write: the
  # daemon gives it back if it sent the answer past the request's last moment to run.
  # Their answers (id 0, as a keepalive's hello) tell nothing a caller needs. A stream
  # broken since took the daemon's memory of them with it.
  defp ask_back(%{stream: stream, unclaimed: [_ | _] = ids} = state, stream) do
    frames =
      for id <- Enum.reverse(ids) do
        give_back = encode(0, %{op: "give_back", of: id})
        {{:give_back, id}, PortStream.frame(give_back, byte_size(give_back))}
      end

    write_pending(%{state | unclaimed: [], pending: frames ++ state.pending})
  end

  defp ask_back(state, _stream), do: %{state | unclaimed: []}

  # The daemon read `clock_us` on its clock before this moment: its clock is at least that
  # far ahead of this one. The tightest such bound since the stream opened is kept, so a
  # deadline sent on the daemon's clock falls no later than the moment it stands for.
  defp observed_clock(state, answer) do
    case decoded_hello(answer) do
      %{"clock_us" => clock_us} when is_integer(clock_us) ->
        offset = clock_us - System.monotonic_time(:microsecond)
        offset = if state.clock_offset_us, do: max(offset, state.clock_offset_us), else: offset
        :ets.update_element(state.table, :stream, {6, offset})
        %{state | clock_offset_us: offset}

      _ ->
        state
    end
  end

  defp decoded_hello(frame) when is_binary(frame) do
    case decode(frame) do
      {:ok, hello} -> hello
      :error -> nil
    end
  end

  defp decoded_hello(hello), do: hello

  @doc false
  # Every answer of the daemon is a map whose first key is its id, an integer as
  # `:erlang.term_to_binary/1` wrote it: read from there, the answer is left for its caller
  # to decode. Anything else is decoded here.
  @spec answer_id(binary()) :: {:ok, integer(), binary() | map()} | {:unmatched, map()} | :error
  def answer_id(<<131, ?t, _arity::32, ?m, 2::32, "id", id::binary>> = frame) do
    case id do
      <<?a, id, _::binary>> ->
        {:ok, id, frame}

      <<?b, id::signed-32, _::binary>> ->
        {:ok, id, frame}

      <<?n, n, 0, id::binary-size(n), _::binary>> ->
        {:ok, :binary.decode_unsigned(id, :little), frame}

      _ ->
        answer_id_decoded(frame)
    end
  end

  def answer_id(frame), do: answer_id_decoded(frame)

  defp answer_id_decoded(frame) do
    case decode(frame) do
      {:ok, %{"id" => id} = answer} when is_integer(id) -> {:ok, id, answer}
      {:ok, answer} -> {:unmatched, answer}
      :error -> :error
    end
  end

  @doc false
  # An answer term: `[:safe]` makes no atom (the daemon writes none but `nil`, `true` and
  # `false`) and no fun.
  @spec decode(binary()) :: {:ok, map()} | :error
  def decode(frame) do
    case :erlang.binary_to_term(frame, [:safe]) do
      %{} = answer -> {:ok, answer}
      _ -> :error
    end
  rescue
    ArgumentError -> :error
  end

  # The stream is gone: new calls fail at once, the stream is closed (a caller writing to it
  # from now on fails), then every caller in flight is failed.
  defp broken(state, reason) do
    Logger.warning("#{describe(state)}: #{reason}")
    state = note_store_lost(%{state | down_reason: reason})
    error = {:error, Error.unavailable(publish(state, nil, nil))}
    state.transport.close(state.stream)

    routes = :ets.select(state.table, [{{:"$1", :_}, [{:is_integer, :"$1"}], [:"$1"]}])
    answer_routes(state.table, routes, error)

    if is_reference(state.retry_timer), do: Process.cancel_timer(state.retry_timer)
    state = keep_later(state, for({:later, [_size, frame]} <- state.pending, do: frame))

    %{
      state
      | stream: nil,
        partial: [],
        pending: [],
        unclaimed: [],
        unsent: nil,
        retry_timer: nil,
        silence_probe: nil,
        silenced: nil
    }
  end

  # Requests sent later (encoded) that found no stream wait for the next one, each once
  # (a caller that retries while the stream is down sends the same), up to @max_later.
  defp keep_later(state, frames) do
    Enum.reduce(frames, state, fn frame, state ->
      if MapSet.size(state.kept_later) >= @max_later or MapSet.member?(state.kept_later, frame) do
        state
      else
        %{
          state
          | later: [{:later, PortStream.frame(frame, byte_size(frame))} | state.later],
            kept_later: MapSet.put(state.kept_later, frame)
        }
      end
    end)
  end

  # Written to a new stream before callers can write theirs.
  defp send_kept_later(state) do
    pending = state.later ++ state.pending
    state = %{state | later: [], kept_later: MapSet.new()}
    write_pending(%{state | pending: pending})
  end

  # What callers read before they write: the stream and the daemon's frame limit, or `nil`
  # and why it is down.
  defp publish(state, stream, max_frame_bytes) do
    down = unavailable(state)

    :ets.insert(
      state.table,
      {:stream, stream, state.transport, max_frame_bytes, down, state.clock_offset_us}
    )

    down
  end

  defp unavailable(state), do: "#{describe(state)} is unavailable: #{state.down_reason}"

  # The stream broke (the daemon may come back with a new table), or a hello named a new
  # table: what the daemon held for callers (bookings) may be gone (`store_lost_at/1`).
  defp note_store_lost(state) do
    :ets.insert(state.table, {:store_lost_at, System.monotonic_time(:millisecond)})
    state
  end

  # A port is reopened at once; a socket after its backoff.
  defp reconnect(state) do
    case state.transport.reopen() do
      :at_once -> reopen(state)
      :after_backoff -> reopen_later(state)
    end
  end

  defp reopen(state) do
    case open(state) do
      {:ok, state} -> state
      {:error, reason} -> down(state, reason)
    end
  end

  # Still down, for `reason`: callers are told so; try again later.
  defp down(state, reason) do
    state = %{state | down_reason: reason_text(reason)}
    publish(state, nil, nil)
    reopen_later(state)
  end

  # Tries again after the backoff, which doubles for the next time.
  defp reopen_later(state) do
    Process.send_after(self(), :reopen, state.backoff_ms)
    %{state | backoff_ms: min(state.backoff_ms * 2, @max_backoff_ms)}
  end

  ## The stream

  defp transport({:port, _executable, _args}), do: PortStream
  defp transport({:socket, _address}), do: SocketStream

  defp describe(state), do: state.transport.describe(state.target)

  defp reason_text({:refused, message}), do: "it refused its configuration: #{message}"
  defp reason_text({:misconfigured, message}), do: message
  defp reason_text(reason), do: reason

  defp open(state) do
    settings = Map.take(state, [:assume_busy, :busy_start, :env, :secret, :timeout])

    with {:ok, stream, hello} <- state.transport.open(state.target, settings) do
      cond do
        hello["assume_busy_at_start"] != false or not state.connected_before ->
          :ok

        hello["table"] != state.daemon_table ->
          Logger.warning(
            "#{describe(state)}: reconnected to a daemon that restarted without " <>
              "--assume-busy-at-start: its buckets started full while the exchange " <>
              "still counts the previous run"
          )

        true ->
          :ok
      end

      # A connection that replaces another meets a new table at its first hello too.
      new_table? =
        (state.connected_before or state.restart) and
          hello["table"] not in [nil, state.daemon_table]

      state = connected(state, stream, hello)
      state = if new_table?, do: state |> note_store_lost() |> pauses_again(), else: state

      case send_kept_later(state) do
        %{stream: ^stream} = state ->
          publish(state, stream, hello["max_frame_bytes"])
          {:ok, keepalive(state, hello["idle_timeout_ms"])}

        # The writes before callers' broke the stream: it is down, or made again, already.
        made_again_or_down ->
          {:ok, made_again_or_down}
      end
    end
  end

  # The table outlives this process by the grace period, killed or not: a limiter started
  # again meanwhile asks its pauses of its new daemon (`attach/3`).
  defp remembering(pauses) do
    table = :ets.new(__MODULE__, [:public, {:write_concurrency, true}, {:heir, keeper(), nil}])
    :ets.insert(table, pauses)
    table
  end

  # Inherits this process's tables (the pauses) when it ends, and keeps them for the grace
  # period.
  defp keeper do
    connection = self()

    spawn(fn ->
      ref = Process.monitor(connection)

      receive do
        {:DOWN, ^ref, :process, _pid, _reason} -> Process.sleep(@orphan_grace_ms)
      end
    end)
  end

  # The pauses in force asked of the previous table, asked again of the new one before any
  # caller's request (their answers, id 0, go to no one).
  defp pauses_again(state) do
    now = System.monotonic_time(:millisecond)

    frames =
      for {target, negated_end} <- :ets.tab2list(state.pauses),
          -negated_end > now do
        pause = encode(0, %{op: "pause", target: target, ms: -negated_end - now})
        {0, PortStream.frame(pause, byte_size(pause))}
      end

    write_pending(%{state | pending: frames ++ state.pending})
  end

  # A hello with the callers' frames, its id 0 (callers' ids are positive); dropped as theirs
  # are when the stream is busy.
  defp write_hello(state) do
    hello = encode(0, %{op: "hello"})
    frame = {0, PortStream.frame(hello, byte_size(hello))}
    write_pending(%{state | pending: [frame | state.pending]})
  end

  defp silence_wait_ms(state), do: max(state.timeout, 1_000)

  # A hello every third of the daemon's idle timeout keeps a quiet connection open.
  defp keepalive(state, idle_ms) when is_integer(idle_ms) and idle_ms > 0 do
    Process.send_after(self(), {:keepalive, state.stream, idle_ms}, max(div(idle_ms, 3), 1))
    state
  end

  defp keepalive(state, _idle_ms), do: state

  # From now on a port is restarted with --assume-busy-at-start: its table would be new
  # (unless its buckets live in Redis).
  defp connected(state, stream, hello) do
    if state.connected_before, do: Logger.info("#{describe(state)}: connected again")
    state = observed_clock(%{state | clock_offset_us: nil}, hello)

    %{
      state
      | stream: stream,
        partial: state.transport.no_partial(),
        backoff_ms: @first_backoff_ms,
        connected_before: true,
        daemon_table: hello["table"],
        assume_busy: state.assume_busy == true or not state.table_outlives_daemon
    }
  end

  defp table_outlives_daemon?(opts), do: Keyword.get(opts, :table_outlives_daemon, false) == true

  # Whether the hellos name the connection's start: `:busy_start`, by default the limiter's
  # `:assume_busy_at_start`.
  defp busy_start?(opts),
    do: Keyword.get(opts, :busy_start, Keyword.get(opts, :assume_busy_at_start) == true)

  @doc false
  # The first frame of a stream, in JSON (every connection starts so): its answer and every
  # frame after it are in the external term format. With the limiter's busy start
  # (monotonic µs), it names how long ago that was.
  @spec hello_request(integer() | nil) :: binary()
  def hello_request(nil), do: ~s({"id":0,"op":"hello","codec":"etf"})

  def hello_request(busy_start) do
    ago = max(System.monotonic_time(:microsecond) - busy_start, 0)
    ~s({"id":0,"op":"hello","codec":"etf","busy_since_us_ago":#{ago}})
  end

  @doc false
  # The daemon's hello answer, if it speaks this protocol; or why it refused to start
  # (`{:refused, message}`: its flags, which `attach/3` answers as invalid parameters).
  @spec hello(binary()) :: {:ok, map()} | {:error, String.t() | {:refused, String.t()}}
  def hello(frame) do
    case decode(frame) do
      {:ok, %{"protocol" => @protocol_version, "max_frame_bytes" => max} = hello}
      when is_integer(max) ->
        {:ok, hello}

      # A port whose daemon refused its configuration answers why, then exits.
      {:ok, %{"ok" => false, "error" => %{"message" => message}}} when is_binary(message) ->
        {:error, {:refused, String.slice(message, 0, 500)}}

      _ ->
        {:error,
         "not a bourse_daemon speaking protocol #{@protocol_version} in the external term " <>
           "format: its answer to hello was #{byte_size(frame)} bytes of something else"}
    end
  end
end
