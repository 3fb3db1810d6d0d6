defmodule Bourse.RateLimiter.Backend.Connection.SocketStream do
  @moduledoc false
  # A connection to a `bourse_daemon` server on TCP or a Unix socket, through OTP's
  # `:socket` (no port between the VM and the socket): a JSON line asks for the external
  # term format, then every frame both ways (the hello's answer, the proof of the shared
  # secret over TCP, requests, answers) is a 4-byte big-endian length and a term, framed as
  # on a port (`PortStream`). Reconnected after a backoff; the limiter may start while the
  # daemon is not up yet. The socket of a daemon run as a port (`PortStream`) is read and
  # written here too.
  #
  # ## Who writes, who reads
  #
  # A stream is `{socket, counters, select, port}` (`t:t/0`). `counters` holds the answers
  # expected (requests written, counted by whoever wrote them, once written), who writes
  # and who reads the socket (no one: 0, the connection process: -1, or a caller: its
  # request's id), how many times in a row a caller polled in vain, and when the
  # connection last wrote callers' frames. One writer at a time, so frames never
  # interleave; one reader at a time, so no answer is read twice or cut in two:
  #
  #   * a caller that finds no other caller waiting, no answer expected, no one writing,
  #     and the connection writing no one's frames for @crowd_us, writes its request itself
  #     (`solo/5`); if no one reads, it also reads its own answer: it polls the socket for
  #     up to @solo_poll_us, which is faster than waiting to be woken when the daemon
  #     answers in a few microseconds. Its answer is the first (none was expected before
  #     it), and it takes only that one from the socket, whole (it peeks first). After
  #     @max_misses polls in vain (the daemon is slower: Redis behind it, say) callers poll
  #     only one time in @probe_every, until a poll finds its answer again;
  #   * every other request goes to the connection, which writes it and, unless a caller
  #     reads, reads until no answer is expected (`read_for/2`, `received/2`, `settled/3`).
  #
  # A caller that stops reading while answers are still expected tells the connection. A
  # caller killed while it reads or writes is noticed by the connection, which then reads
  # or writes instead (`solo_write/6` says why its frame is whole). A caller killed between
  # counting its request and writing it, or after taking its answer, before counting it,
  # leaves one answer counted too many: callers alone then go through the connection,
  # until the stream is reopened.

  @behaviour Bourse.RateLimiter.Backend.Connection.Transport

  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.PortStream

  @in_flight 1
  @reader 2
  @writer 3
  @misses 4
  @crowd 5
  @connection -1
  @max_misses 8
  @probe_every 64
  # Callers write alone only once the connection wrote no one's frames for this long: in a
  # crowd, a caller polling would hold a scheduler and the reading while its answer waits
  # behind the others'.
  @crowd_us 1_000
  # How long a caller alone polls for its answer before it leaves the reading to the
  # connection; and the largest request it writes itself (a small write to a socket with
  # nothing in flight goes whole).
  @solo_poll_us 100
  @solo_max_bytes 16 * 1024
  # What one look at the socket reads: most answers are far shorter.
  @peek_bytes 512
  # Reads in a row before the connection process sees to its other messages.
  @reads_per_turn 16
  # How often the connection looks whether a caller reading is still alive.
  @reader_check_ms 10

  @typedoc """
  An open stream: the socket, its counters (see the module's comment), the tag of the
  connection's reads, and the port of a daemon run as one (`PortStream`).
  """
  @type t :: {:socket.socket(), :atomics.atomics_ref(), reference(), port() | nil}

  @doc "A stream on `socket`, connected to the daemon run as `port`, if any."
  @spec stream(:socket.socket(), port() | nil) :: t()
  def stream(socket, port) do
    counters = :atomics.new(5, signed: true)
    :atomics.put(counters, @crowd, :erlang.monotonic_time(:microsecond) - 2 * @crowd_us)
    {socket, counters, make_ref(), port}
  end

  # Connecting and the handshake end within the backend's timeout in all, or
  # @min_handshake_ms when that is shorter (a timeout of a few ms is for requests, not for
  # a connection): a daemon that accepts and never answers (stopped, say) holds a limiter's
  # start about as long as a call.
  @min_handshake_ms 1_000
  @impl true
  def open({:socket, address}, settings) do
    deadline = System.monotonic_time(:millisecond) + max(settings.timeout, @min_handshake_ms)

    with {:ok, socket} <- connect(address, deadline) do
      case handshake(socket, address, settings, deadline) do
        {:ok, hello} ->
          {:ok, stream(socket, nil), hello}

        error ->
          :socket.close(socket)
          error
      end
    end
  end

  defp connect({:tcp, host, port}, deadline) do
    with {:ok, ip} <- resolve(host),
         family = if(tuple_size(ip) == 4, do: :inet, else: :inet6),
         {:ok, socket} <- tagged(:socket.open(family, :stream, :tcp), "cannot connect") do
      :socket.setopt(socket, {:tcp, :nodelay}, true)
      connected(socket, %{family: family, addr: ip, port: port}, deadline)
    end
  end

  defp connect({:unix, path, uid}, deadline) do
    with {:ok, socket} <- tagged(:socket.open(:local, :stream, :default), "cannot connect"),
         {:ok, socket} <-
           socket |> connected(%{family: :local, path: path}, deadline) |> not_a_socket(path) do
      run_by(socket, path, uid)
    end
  end

  # The user of the process listening at `path`, as Linux tells it (SO_PEERCRED: a pid,
  # a uid and a gid), must be the daemon's: another user could listen at the path first.
  defp run_by(socket, _path, nil), do: {:ok, socket}

  defp run_by(socket, path, uid) do
    case :socket.getopt_native(socket, {:socket, so_peercred()}, 12) do
      {:ok, <<_pid::native-32, ^uid::native-32, _gid::native-32>>} ->
        {:ok, socket}

      {:ok, <<_pid::native-32, other::native-32, _gid::native-32>>} ->
        :socket.close(socket)

        {:error,
         "cannot connect: #{path} is served by user #{other}, not the daemon's user #{uid}: " <>
           "another user may be listening there (give daemon_uid: #{other} if it is the daemon)"}

      error ->
        :socket.close(socket)
        tagged(error, "cannot tell which user serves #{path}")
    end
  end

  # Connecting to a file or folder is refused: say what it is.
  defp not_a_socket({:error, "cannot connect: connection refused"} = error, path) do
    case File.stat(path) do
      {:ok, %File.Stat{type: type}} when type in [:regular, :directory] ->
        what = if type == :regular, do: "a regular file", else: "a directory"
        {:error, "cannot connect: #{path} is #{what}, not a socket"}

      _ ->
        error
    end
  end

  defp not_a_socket(answer, _path), do: answer

  # SO_PEERCRED's number on Linux: 17 on most architectures, not all.
  defp so_peercred do
    case :erlang.system_info(:system_architecture) do
      ~c"powerpc" ++ _ -> 21
      ~c"mips" ++ _ -> 18
      ~c"sparc" ++ _ -> 0x40
      _other -> 17
    end
  end

  defp resolve(host) when is_tuple(host), do: {:ok, host}

  defp resolve(host) do
    with {:error, _} <- :inet.getaddr(host, :inet),
         {:error, reason} <- :inet.getaddr(host, :inet6),
         do: tagged({:error, reason}, "cannot resolve #{host}")
  end

  # Answers are read 64 KiB at a time.
  defp connected(socket, address, deadline) do
    case tagged(:socket.connect(socket, address, left(deadline)), "cannot connect") do
      :ok ->
        :socket.setopt(socket, {:otp, :rcvbuf}, 64 * 1024)
        {:ok, socket}

      error ->
        :socket.close(socket)
        error
    end
  end

  defp handshake(socket, address, settings, deadline) do
    hello = Connection.hello_request(settings.busy_start)

    with :ok <- send_all(socket, [hello, ?\n], deadline),
         {:ok, frame} <- recv_frame(socket, "no hello", deadline),
         {:ok, hello} <- Connection.hello(frame),
         :ok <- prove(socket, Map.get(hello, "auth"), settings.secret, address, deadline),
         do: {:ok, hello}
  end

  defp left(deadline), do: max(deadline - System.monotonic_time(:millisecond), 0)

  # A daemon reached over TCP asks for proof of the shared secret: the HMAC-SHA256 of the
  # nonce in its hello; and proves it in turn, over a challenge of ours. The secret itself
  # never travels. Every daemon serving TCP asks: one that does not is not a bourse_daemon
  # (a Unix socket's permissions stand for the proof).
  defp prove(_socket, nil, _secret, {:tcp, _host, _port}, _deadline) do
    {:error,
     "the peer did not ask for the shared secret, as every bourse_daemon serving TCP " <>
       "does: another program may be listening there"}
  end

  defp prove(_socket, nil, _secret, _unix, _deadline), do: :ok

  defp prove(_socket, %{}, nil, _address, _deadline) do
    {:error,
     {:misconfigured,
      "the daemon asks for its shared secret: set BOURSE_DAEMON_SECRET or the backend's " <>
        "secret_file: option"}}
  end

  defp prove(socket, %{"scheme" => "hmac-sha256", "nonce" => nonce}, secret, _address, deadline) do
    if nonce?(nonce) do
      prove_secret(socket, nonce, secret, deadline)
    else
      {:error,
       "the peer's nonce is not 64 hex digits, as every bourse_daemon's is: another " <>
         "program may be listening there"}
    end
  end

  defp prove(_socket, _auth, _secret, _address, _deadline),
    do: {:error, "the daemon asks for a proof this client does not know"}

  # A nonce is 64 hex digits: what the daemon proves, `daemon <challenge> <nonce>`, never is,
  # so a peer cannot have this client prove that for another client's challenge.
  defp nonce?(nonce),
    do:
      is_binary(nonce) and byte_size(nonce) == 64 and Base.decode16(nonce, case: :mixed) != :error

  defp prove_secret(socket, nonce, secret, deadline) do
    challenge = :crypto.strong_rand_bytes(32) |> Base.encode16(case: :lower)

    request =
      Connection.encode(0, %{op: "auth", proof: hmac(secret, nonce), challenge: challenge})

    expected = hmac(secret, "daemon #{challenge} #{nonce}")

    with :ok <- send_all(socket, PortStream.frame(request, byte_size(request)), deadline),
         {:ok, frame} <- recv_frame(socket, "no answer to auth", deadline) do
      case Connection.decode(frame) do
        {:ok, %{"ok" => true, "proof" => ^expected}} ->
          :ok

        {:ok, %{"ok" => true}} ->
          {:error,
           "the peer accepted the proof of the shared secret without proving it in turn: " <>
             "another program may be listening there"}

        {:ok, %{"ok" => false, "error" => %{"type" => "unauthorized"}}} ->
          {:error,
           {:misconfigured,
            "the daemon refused the proof of the shared secret (is it the same secret?)"}}

        _ ->
          {:error,
           "the peer's answer to the proof of the shared secret is not a bourse_daemon's: " <>
             "another program may be listening there"}
      end
    end
  end

  defp hmac(secret, message),
    do: :crypto.mac(:hmac, :sha256, secret, message) |> Base.encode16(case: :lower)

  defp send_all(socket, iodata, deadline),
    do: tagged(:socket.send(socket, iodata, left(deadline)), "cannot send")

  defp tagged({:error, reason}, what), do: {:error, "#{what}: #{format_error(reason)}"}
  defp tagged(ok, _what), do: ok

  defp format_error({reason, _rest}), do: format_error(reason)

  defp format_error(reason) when is_atom(reason) do
    case :inet.format_error(reason) do
      ~c"unknown POSIX error" ++ _ -> Atom.to_string(reason)
      text -> List.to_string(text)
    end
  end

  defp format_error(reason), do: inspect(reason)

  # One length-prefixed frame of the handshake, read exactly (what follows it stays in the
  # socket for the connection); a daemon that refuses the connection (at
  # its --max-connections) or does not know the codec answers a JSON line instead.
  defp recv_frame(socket, what, deadline) do
    with {:ok, header} <- recv(socket, 4, what, deadline) do
      case header do
        <<?{, _::binary>> -> json_line(socket, what, header, deadline)
        <<size::32>> when size > 1024 * 1024 -> {:error, "#{what}: #{not_a_daemon(header)}"}
        <<0::32>> -> {:ok, ""}
        <<size::32>> -> recv(socket, size, what, deadline)
      end
    end
  end

  # A first answer no bourse_daemon would send (its hello is far under 1 MiB): another
  # server (Redis answers "-ERR", HTTP "HTTP") listens there.
  defp not_a_daemon(header),
    do:
      "the peer's answer began with #{inspect(header)}, not a bourse_daemon frame; " <>
        "is a bourse_daemon listening there?"

  defp json_line(socket, what, line, deadline) do
    cond do
      String.contains?(line, "\n") or byte_size(line) > 1024 ->
        {:error, json_refusal(line)}

      true ->
        with {:ok, more} <- recv(socket, 0, what, deadline),
             do: json_line(socket, what, line <> more, deadline)
    end
  end

  # A daemon that finds the hello invalid (an older one, which lacks a field this limiter
  # sends) refuses the limiter's configuration; any other refusal (its connection limit) is
  # retried.
  defp json_refusal(line) do
    message = "the daemon answered in JSON: #{line |> String.slice(0, 300) |> String.trim()}"

    if String.contains?(line, ~s("type":"invalid_parameters")),
      do: {:misconfigured, message <> " (a bourse_daemon older than this library?)"},
      else: message
  end

  defp recv(socket, size, what, deadline),
    do: tagged(:socket.recv(socket, size, [], left(deadline)), what)

  ## A caller's request

  @doc """
  A caller's request, written by the caller itself when no other caller waits, no answer
  is expected and no one writes; then, if no one reads either, it polls for its answer:
  `{:answer, frame}`. Otherwise `:written` (the connection reads the answer),
  `{:error, reason}` (the stream is broken), or `:shared` (the connection is to write it).
  """
  @spec solo(t(), :ets.tid(), pid(), pos_integer(), iodata()) ::
          {:answer, binary()} | :written | :shared | {:error, term()}
  def solo({_socket, counters, _select, _port} = stream, table, connection, id, frame) do
    if alone?(table) and :atomics.get(counters, @in_flight) == 0 and
         :erlang.monotonic_time(:microsecond) - :atomics.get(counters, @crowd) > @crowd_us and
         IO.iodata_length(frame) <= @solo_max_bytes do
      :ets.insert(table, {{:solo, id}, self()})
      polls = poll?(counters) and take(counters, @reader, id)

      if take(counters, @writer, id) and :atomics.get(counters, @in_flight) == 0 do
        solo_write(stream, table, connection, id, frame, polls)
      else
        release(counters, @writer, id)
        done(stream, table, connection, id, polls)
        :shared
      end
    else
      :shared
    end
  end

  # No other caller waits: the table holds the stream and this caller's route alone (and
  # when the store was last lost, once it was).
  defp alone?(table) do
    case :ets.info(table, :size) do
      size when size <= 2 -> true
      3 -> :ets.member(table, :store_lost_at)
      _more -> false
    end
  end

  defp poll?(counters) do
    :atomics.get(counters, @misses) < @max_misses or
      rem(:atomics.add_get(counters, @misses, 1), @probe_every) == 0
  end

  defp take(counters, slot, id), do: :atomics.compare_exchange(counters, slot, 0, id) == :ok

  defp release(counters, slot, id), do: :atomics.compare_exchange(counters, slot, id, 0)

  # The caller counts its request, then writes it: killed in between, it leaves one answer
  # counted too many (safe: the connection then reads), never an answer uncounted. Killed
  # while it holds the write, it wrote its frame whole or not at all (one call of the
  # socket), and the connection takes the write over; unless the socket took a part only
  # (never, in practice: a small frame into a socket the daemon emptied): then the caller
  # marks the write as handed over (its id, negated) and sends the rest to the connection,
  # which writes it first; one killed before it sent the rest leaves the stream to close.
  defp solo_write(
         {socket, counters, _select, _port} = stream,
         table,
         connection,
         id,
         frame,
         polls
       ) do
    :atomics.add(counters, @in_flight, 1)

    case :socket.send(socket, frame, [], 0) do
      :ok ->
        release(counters, @writer, id)

        if polls do
          until = :erlang.monotonic_time(:microsecond) + @solo_poll_us
          own_answer(stream, table, connection, id, until)
        else
          done(stream, table, connection, id, false)
          :written
        end

      {:error, :timeout} ->
        :atomics.sub(counters, @in_flight, 1)
        release(counters, @writer, id)
        done(stream, table, connection, id, polls)
        :shared

      {:error, {:timeout, rest}} ->
        :atomics.compare_exchange(counters, @writer, id, -id)
        send(connection, {:unsent, stream, rest})
        done(stream, table, connection, id, polls)
        :written

      {:error, {reason, _rest}} ->
        done(stream, table, connection, id, polls)
        {:error, reason}

      {:error, reason} ->
        :atomics.sub(counters, @in_flight, 1)
        release(counters, @writer, id)
        done(stream, table, connection, id, polls)
        {:error, reason}
    end
  end

  # Its own answer is the first one in the socket: it peeks until the answer is whole, then
  # takes exactly that frame.
  defp own_answer({socket, _counters, _select, _port} = stream, table, connection, id, until) do
    case :socket.recv(socket, @peek_bytes, [:peek], 0) do
      {:ok, <<size::32, frame::binary-size(size), _::binary>>} ->
        take_own(stream, table, connection, id, frame)

      {:ok, <<size::32, _::binary>>} when size + 4 > @peek_bytes and size <= @solo_max_bytes ->
        case :socket.recv(socket, size + 4, [:peek], 0) do
          {:ok, <<^size::32, frame::binary-size(size)>>} ->
            take_own(stream, table, connection, id, frame)

          _not_yet ->
            poll_again(stream, table, connection, id, until)
        end

      {:ok, <<size::32, _::binary>>} when size + 4 > @peek_bytes ->
        done(stream, table, connection, id, true)
        :written

      {:ok, _begun} ->
        poll_again(stream, table, connection, id, until)

      {:error, :timeout} ->
        poll_again(stream, table, connection, id, until)

      {:error, reason} ->
        done(stream, table, connection, id, true)
        {:error, reason}
    end
  end

  defp poll_again({_socket, counters, _select, _port} = stream, table, connection, id, until) do
    if :erlang.monotonic_time(:microsecond) < until do
      own_answer(stream, table, connection, id, until)
    else
      :atomics.add(counters, @misses, 1)
      done(stream, table, connection, id, true)
      :written
    end
  end

  defp take_own({socket, counters, _select, _port} = stream, table, connection, id, frame) do
    with {:ok, ^id, _frame} <- Connection.answer_id(frame),
         {:ok, _taken} <- :socket.recv(socket, byte_size(frame) + 4, [], 0) do
      :atomics.sub(counters, @in_flight, 1)
      :atomics.put(counters, @misses, 0)
      done(stream, table, connection, id, true)
      {:answer, frame}
    else
      # Closed meanwhile.
      {:error, reason} ->
        done(stream, table, connection, id, true)
        {:error, reason}

      # Someone else's (answers come in order, so a request of a caller that gave up):
      # the connection reads it.
      _other ->
        done(stream, table, connection, id, true)
        :written
    end
  end

  # The caller is done with the socket; answers still expected are the connection's to read.
  defp done({_socket, counters, _select, _port} = stream, table, connection, id, read) do
    if read, do: release(counters, @reader, id)
    :ets.delete(table, {:solo, id})
    if :atomics.get(counters, @in_flight) > 0, do: send(connection, {:read, stream})
    :ok
  end

  ## The connection's side

  # The connection's writes of `count` requests, counted once written; what the socket did
  # not take is returned, to be written first next time (until then the connection keeps
  # the write to itself). A caller writing meanwhile is waited for (`:wait`); one that died
  # holding the write wrote its frame whole or not at all, and its write is taken over; one
  # that died handing over what the socket did not take of its frame left a part of it.
  @impl true
  def write_nowait({socket, counters, _select, _port}, table, iodata, count) do
    :atomics.put(counters, @crowd, :erlang.monotonic_time(:microsecond))

    case writer(counters, table) do
      :ok ->
        case :socket.send(socket, iodata, [], 0) do
          :ok ->
            :atomics.add(counters, @in_flight, count)
            :atomics.put(counters, @writer, 0)
            :ok

          {:error, :timeout} ->
            :atomics.put(counters, @writer, 0)
            :busy

          {:error, {:timeout, rest}} ->
            :atomics.add(counters, @in_flight, count)
            {:partial, rest}

          {:error, {reason, _rest}} ->
            {:error, reason}

          {:error, reason} ->
            {:error, reason}
        end

      other ->
        other
    end
  end

  defp writer(counters, table) do
    case :atomics.compare_exchange(counters, @writer, 0, @connection) do
      :ok ->
        :ok

      @connection ->
        :ok

      # Handing the rest of its frame over.
      handing when handing < 0 ->
        case holder(table, counters, @writer, -handing, handing) do
          :alive -> :wait
          :released -> writer(counters, table)
          :dead -> {:error, :writer_killed}
        end

      caller ->
        case holder(table, counters, @writer, caller, caller) do
          :alive -> :wait
          :released -> writer(counters, table)
          :dead -> take_over(counters, caller, table)
        end
    end
  end

  # Whether the caller that set `slot` to `value` is alive. It keeps its row until it
  # released every slot, so a holder without a row (dropped by the connection's sweep) is
  # dead.
  defp holder(table, counters, slot, caller, value) do
    case :ets.lookup(table, {:solo, caller}) do
      [{_row, pid}] -> if Process.alive?(pid), do: :alive, else: :dead
      [] -> if :atomics.get(counters, slot) == value, do: :dead, else: :released
    end
  end

  defp take_over(counters, caller, table) do
    if :atomics.compare_exchange(counters, @writer, caller, @connection) == :ok,
      do: :ok,
      else: writer(counters, table)
  end

  # A caller's frame the socket took in part: the connection writes the rest first.
  @impl true
  def unsent({_socket, counters, _select, _port}) do
    :atomics.put(counters, @writer, @connection)
    :ok
  end

  # After the connection wrote requests, or was told to read: it reads unless a caller
  # does; a caller that died reading is replaced.
  @impl true
  def read_for({_socket, counters, _select, _port} = stream, table) do
    if :atomics.get(counters, @in_flight) > 0 do
      case :atomics.compare_exchange(counters, @reader, 0, @connection) do
        :ok ->
          start_reading(stream)

        @connection ->
          :ok

        caller ->
          case holder(table, counters, @reader, caller, caller) do
            :alive ->
              Process.send_after(self(), {:read, stream}, @reader_check_ms)

            :released ->
              read_for(stream, table)

            :dead ->
              if :atomics.compare_exchange(counters, @reader, caller, @connection) == :ok,
                do: start_reading(stream),
                else: read_for(stream, table)
          end
      end
    end

    :ok
  end

  # The connection reads when the socket has something: the next look is now.
  defp start_reading({socket, _counters, select, _port}),
    do: send(self(), {:"$socket", socket, :select, select})

  @impl true
  def received({:"$socket", socket, :select, select}, {socket, counters, select, _port} = stream) do
    if :atomics.get(counters, @reader) == @connection,
      do: read(stream, [], @reads_per_turn),
      else: :other
  end

  def received(
        {:"$socket", socket, :abort, {select, reason}},
        {socket, _counters, select, _port}
      ),
      do: {:down, "connection error #{format_error(reason)}"}

  def received(_message, _stream), do: :other

  # What the socket has, until it has nothing more (it sends a select message when it
  # does) or @reads_per_turn reads were made (a message to itself continues).
  defp read(stream, read, 0) do
    start_reading(stream)
    {:data, IO.iodata_to_binary(read)}
  end

  defp read({socket, _counters, select, _port} = stream, read, reads_left) do
    case :socket.recv(socket, 0, [], select) do
      {:ok, data} ->
        read(stream, [read, data], reads_left - 1)

      {:select, {info, data}} ->
        Process.put({__MODULE__, select}, info)
        {:data, IO.iodata_to_binary([read, data])}

      {:select, info} ->
        Process.put({__MODULE__, select}, info)
        {:data, IO.iodata_to_binary(read)}

      {:error, reason} when read == [] ->
        {:down, down(reason)}

      # The answers read before it first: the error comes again at the next read.
      {:error, _reason} ->
        start_reading(stream)
        {:data, IO.iodata_to_binary(read)}
    end
  end

  defp down(:closed), do: "the daemon closed the connection"
  defp down(reason), do: "connection error #{format_error(reason)}"

  # `count` requests were answered; with none left in flight and no answer begun, the
  # connection stops reading (its read waiting for the socket, kept in its dictionary, is
  # cancelled), and reads again if one came meanwhile. More answers than requests break
  # the stream: the count would no longer say when to read.
  @impl true
  def settled({socket, counters, select, _port} = stream, count, partial) do
    left = :atomics.sub_get(counters, @in_flight, count)

    cond do
      left < 0 ->
        {:error, "the daemon sent #{-left} answer(s) more than it was asked for"}

      left == 0 and partial == no_partial() and :atomics.get(counters, @reader) == @connection ->
        case Process.delete({__MODULE__, select}) do
          nil -> :ok
          info -> :socket.cancel(socket, info)
        end

        :atomics.put(counters, @reader, 0)
        if :atomics.get(counters, @in_flight) > 0, do: send(self(), {:read, stream})
        :ok

      true ->
        :ok
    end
  end

  @impl true
  def close({socket, _counters, select, _port}) do
    Process.delete({__MODULE__, select})
    :socket.close(socket)
    :ok
  end

  @impl true
  defdelegate no_partial, to: PortStream

  @impl true
  defdelegate answers(partial, data), to: PortStream

  @impl true
  def reopen, do: :after_backoff

  @impl true
  def start_without_it?, do: true

  @impl true
  def describe({:socket, {:unix, path, _uid}}),
    do: "bourse_daemon at unix:#{Bourse.Error.path(path)}"

  def describe({:socket, {:tcp, host, port}}) when is_tuple(host),
    do: "bourse_daemon at #{:inet.ntoa(host)}:#{port}"

  def describe({:socket, {:tcp, host, port}}), do: "bourse_daemon at #{host}:#{port}"
end
