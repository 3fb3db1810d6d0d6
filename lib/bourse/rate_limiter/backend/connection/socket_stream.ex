defmodule Bourse.RateLimiter.Backend.Connection.SocketStream do
  @moduledoc false
  # A connection to a `bourse_daemon` server on TCP or a Unix socket, through OTP's
  # `:socket` (no port between the VM and the socket): a JSON line asks for the external
  # term format, then every frame both ways (the hello's answer, the proof of the shared
  # secret over TCP, requests, answers) is a 4-byte big-endian length and a term, framed as
  # on a port (`PortStream`). Reconnected after a backoff; the limiter may start while the
  # daemon is not up yet.
  #
  # ## Who reads
  #
  # A stream is `{socket, counters, select}`: `counters` holds the requests in flight
  # (written or handed to the connection, not answered yet) and who reads the socket: no
  # one (0), the connection process (-1), or a caller (its request's id). One reader at a
  # time, so no answer is read twice or cut in two:
  #
  #   * a caller whose request is the only one in flight, and who finds no one reading,
  #     writes it and reads its own answer (`solo/5`): it polls the socket for up to
  #     @solo_poll_us, which is faster than waiting to be woken when the daemon answers in
  #     a few microseconds. It only ever takes its own answer from the socket, whole (it
  #     peeks first), so a caller killed meanwhile takes nothing of anyone else's;
  #   * every other request goes to the connection, which writes it and, unless a caller
  #     reads, reads until no request is in flight (`read_for/2`, `received/2`,
  #     `settled/3`).
  #
  # A reader that stops reading while requests are still in flight tells the connection. A
  # caller killed while reading is noticed by the connection, which then reads instead.

  @behaviour Bourse.RateLimiter.Backend.Connection.Transport

  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.PortStream

  @handshake_timeout 5_000
  @in_flight 1
  @reader 2
  @connection -1
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

  @typedoc "An open stream: the socket, its counters (see the module's comment), and the tag of its reads."
  @type t :: {:socket.socket(), :atomics.atomics_ref(), reference()}

  @impl true
  def open({:socket, address}, settings) do
    with {:ok, socket} <- connect(address, settings.timeout) do
      case handshake(socket, settings.secret) do
        {:ok, hello} ->
          {:ok, {socket, :atomics.new(2, signed: true), make_ref()}, hello}

        error ->
          :socket.close(socket)
          error
      end
    end
  end

  defp connect({:tcp, host, port}, _timeout) do
    with {:ok, ip} <- resolve(host),
         family = if(tuple_size(ip) == 4, do: :inet, else: :inet6),
         {:ok, socket} <- tagged(:socket.open(family, :stream, :tcp), "cannot connect") do
      :socket.setopt(socket, {:tcp, :nodelay}, true)
      connected(socket, %{family: family, addr: ip, port: port})
    end
  end

  defp connect({:unix, path}, _timeout) do
    with {:ok, socket} <- tagged(:socket.open(:local, :stream, :default), "cannot connect") do
      connected(socket, %{family: :local, path: path})
    end
  end

  defp resolve(host) when is_tuple(host), do: {:ok, host}

  defp resolve(host) do
    with {:error, _} <- :inet.getaddr(host, :inet),
         {:error, reason} <- :inet.getaddr(host, :inet6),
         do: tagged({:error, reason}, "cannot resolve #{host}")
  end

  # Answers are read 64 KiB at a time.
  defp connected(socket, address) do
    case tagged(:socket.connect(socket, address, @handshake_timeout), "cannot connect") do
      :ok ->
        :socket.setopt(socket, {:otp, :rcvbuf}, 64 * 1024)
        {:ok, socket}

      error ->
        :socket.close(socket)
        error
    end
  end

  defp handshake(socket, secret) do
    with :ok <- send_all(socket, [Connection.hello_request(), ?\n]),
         {:ok, frame} <- recv_frame(socket, "no hello"),
         {:ok, hello} <- Connection.hello(frame),
         :ok <- prove(socket, hello, secret),
         do: {:ok, hello}
  end

  # A daemon reached over TCP asks for proof of the shared secret: the HMAC-SHA256 of the
  # nonce in its hello. The secret itself is never sent.
  defp prove(_socket, %{"auth" => nil}, _secret), do: :ok

  defp prove(_socket, %{"auth" => %{}}, nil) do
    {:error,
     "the daemon asks for its shared secret: set BOURSE_DAEMON_SECRET or the backend's " <>
       "secret_file: option"}
  end

  defp prove(socket, %{"auth" => %{"scheme" => "hmac-sha256", "nonce" => nonce}}, secret) do
    proof = :crypto.mac(:hmac, :sha256, secret, nonce) |> Base.encode16(case: :lower)
    request = Connection.encode(0, %{op: "auth", proof: proof})

    with :ok <- send_all(socket, PortStream.frame(request, byte_size(request))),
         {:ok, frame} <- recv_frame(socket, "no answer to auth") do
      case Connection.decode(frame) do
        {:ok, %{"ok" => true}} ->
          :ok

        _ ->
          {:error, "the daemon refused the proof of the shared secret (is it the same secret?)"}
      end
    end
  end

  defp prove(_socket, %{"auth" => _}, _secret),
    do: {:error, "the daemon asks for a proof this client does not know"}

  defp prove(_socket, _hello, _secret), do: :ok

  defp send_all(socket, iodata),
    do: tagged(:socket.send(socket, iodata, @handshake_timeout), "cannot send")

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
  defp recv_frame(socket, what) do
    with {:ok, header} <- recv(socket, 4, what) do
      case header do
        <<?{, _::binary>> -> json_line(socket, what, header)
        <<size::32>> when size > 1024 * 1024 -> {:error, "#{what}: a frame of #{size} bytes"}
        <<0::32>> -> {:ok, ""}
        <<size::32>> -> recv(socket, size, what)
      end
    end
  end

  defp json_line(socket, what, line) do
    cond do
      String.contains?(line, "\n") or byte_size(line) > 1024 ->
        {:error, "the daemon answered in JSON: #{String.slice(line, 0, 300)}"}

      true ->
        with {:ok, more} <- recv(socket, 0, what), do: json_line(socket, what, line <> more)
    end
  end

  defp recv(socket, size, what),
    do: tagged(:socket.recv(socket, size, [], @handshake_timeout), what)

  ## A caller's request

  @doc """
  Counts a caller's request in flight. When it is the only one and no one reads, the
  caller writes it and polls for its answer: `{:answer, frame}`; or `:written` (the
  connection was told to read it, having been told to read), or `{:error, reason}` (the
  stream is broken). `:shared` when the connection is to write it.
  """
  @spec solo(t(), :ets.tid(), pid(), pos_integer(), iodata()) ::
          {:answer, binary()} | :written | :shared | {:error, term()}
  def solo({socket, counters, _select} = stream, table, connection, id, frame) do
    if :atomics.add_get(counters, @in_flight, 1) == 1 and
         IO.iodata_length(frame) <= @solo_max_bytes and reader?(counters, table, id) do
      case :socket.send(socket, frame, [], 0) do
        :ok ->
          until = :erlang.monotonic_time(:microsecond) + @solo_poll_us
          own_answer(stream, table, connection, id, until)

        # Nothing written: the connection writes it.
        {:error, :timeout} ->
          stop_reading(stream, table, connection, id)
          :shared

        {:error, reason} ->
          stop_reading(stream, table, connection, id)
          {:error, reason}
      end
    else
      :shared
    end
  end

  # The caller becomes the reader; its row tells the connection who reads.
  defp reader?(counters, table, id) do
    :ets.insert(table, {{:reader, id}, self()})

    case :atomics.compare_exchange(counters, @reader, 0, id) do
      :ok ->
        true

      _reader ->
        :ets.delete(table, {:reader, id})
        false
    end
  end

  # Its own answer is the first one in the socket: it peeks until the answer is whole, then
  # takes exactly that frame.
  defp own_answer({socket, counters, _select} = stream, table, connection, id, until) do
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
        stop_reading(stream, table, connection, id)
        :written

      {:ok, _begun} ->
        poll_again(stream, table, connection, id, until)

      {:error, :timeout} ->
        poll_again(stream, table, connection, id, until)

      {:error, reason} ->
        :atomics.put(counters, @reader, 0)
        :ets.delete(table, {:reader, id})
        {:error, reason}
    end
  end

  defp poll_again(stream, table, connection, id, until) do
    if :erlang.monotonic_time(:microsecond) < until do
      own_answer(stream, table, connection, id, until)
    else
      stop_reading(stream, table, connection, id)
      :written
    end
  end

  defp take_own({socket, counters, _select} = stream, table, connection, id, frame) do
    case Connection.answer_id(frame) do
      {:ok, ^id, _frame} ->
        {:ok, _taken} = :socket.recv(socket, byte_size(frame) + 4, [], 0)
        :atomics.sub(counters, @in_flight, 1)
        stop_reading(stream, table, connection, id)
        {:answer, frame}

      # Someone else's (answers come in order, so a request of a caller that gave up):
      # the connection reads it.
      _other ->
        stop_reading(stream, table, connection, id)
        :written
    end
  end

  # The caller no longer reads; with requests still in flight the connection will.
  defp stop_reading({_socket, counters, _select} = stream, table, connection, id) do
    :atomics.put(counters, @reader, 0)
    :ets.delete(table, {:reader, id})
    if :atomics.get(counters, @in_flight) > 0, do: send(connection, {:read, stream})
    :ok
  end

  ## The connection's side

  # The connection's writes, of requests already counted in flight; what the socket did
  # not take is returned, to be written first next time.
  @impl true
  def write_nowait({socket, _counters, _select}, iodata) do
    case :socket.send(socket, iodata, [], 0) do
      :ok -> :ok
      {:error, :timeout} -> :busy
      {:error, {:timeout, rest}} -> {:partial, rest}
      {:error, {reason, _rest}} -> {:error, reason}
      {:error, reason} -> {:error, reason}
    end
  end

  @impl true
  def counted({_socket, counters, _select}, count) do
    :atomics.add(counters, @in_flight, count)
    :ok
  end

  # After the connection wrote requests, or was told to read: it reads unless a caller
  # does; a caller that died reading is replaced.
  @impl true
  def read_for({_socket, counters, _select} = stream, table) do
    if :atomics.get(counters, @in_flight) > 0 do
      case :atomics.compare_exchange(counters, @reader, 0, @connection) do
        :ok -> start_reading(stream)
        @connection -> :ok
        caller -> replace_reader(stream, table, caller)
      end
    end

    :ok
  end

  defp replace_reader({_socket, counters, _select} = stream, table, caller) do
    case :ets.lookup(table, {:reader, caller}) do
      [{_row, pid}] ->
        if Process.alive?(pid) do
          Process.send_after(self(), {:read, stream}, @reader_check_ms)
        else
          :ets.delete(table, {:reader, caller})

          if :atomics.compare_exchange(counters, @reader, caller, @connection) == :ok,
            do: start_reading(stream)
        end

      # It stopped reading since.
      [] ->
        read_for(stream, table)
    end
  end

  # The connection reads when the socket has something: the first look is now.
  defp start_reading({socket, _counters, select}),
    do: send(self(), {:"$socket", socket, :select, select})

  @impl true
  def received({:"$socket", socket, :select, select}, {socket, counters, select}) do
    if :atomics.get(counters, @reader) == @connection,
      do: read(socket, select, [], @reads_per_turn),
      else: :other
  end

  def received({:"$socket", socket, :abort, {select, reason}}, {socket, _counters, select}),
    do: {:down, "connection error #{format_error(reason)}"}

  def received(_message, _stream), do: :other

  # What the socket has, until it has nothing more (it sends a select message when it
  # does) or @reads_per_turn reads were made (a message to itself continues).
  defp read(socket, select, read, 0) do
    send(self(), {:"$socket", socket, :select, select})
    {:data, IO.iodata_to_binary(read)}
  end

  defp read(socket, select, read, reads_left) do
    case :socket.recv(socket, 0, [], select) do
      {:ok, data} ->
        read(socket, select, [read, data], reads_left - 1)

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
        send(self(), {:"$socket", socket, :select, select})
        {:data, IO.iodata_to_binary(read)}
    end
  end

  defp down(:closed), do: "the daemon closed the connection"
  defp down(reason), do: "connection error #{format_error(reason)}"

  # `count` requests were answered (or will never be written); with none left in flight and
  # no answer begun, the connection stops reading (its read waiting for the socket, kept in
  # its dictionary, is cancelled), and reads again if one came meanwhile.
  @impl true
  def settled({socket, counters, select} = stream, count, partial) do
    if :atomics.sub_get(counters, @in_flight, count) <= 0 and
         partial == no_partial() and :atomics.get(counters, @reader) == @connection do
      case Process.delete({__MODULE__, select}) do
        nil -> :ok
        info -> :socket.cancel(socket, info)
      end

      :atomics.put(counters, @reader, 0)
      if :atomics.get(counters, @in_flight) > 0, do: send(self(), {:read, stream})
    end

    :ok
  end

  @impl true
  def close({socket, _counters, select}) do
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
  def describe({:socket, {:unix, path}}), do: "bourse_daemon at unix:#{path}"

  def describe({:socket, {:tcp, host, port}}) when is_tuple(host),
    do: "bourse_daemon at #{:inet.ntoa(host)}:#{port}"

  def describe({:socket, {:tcp, host, port}}), do: "bourse_daemon at #{host}:#{port}"
end
