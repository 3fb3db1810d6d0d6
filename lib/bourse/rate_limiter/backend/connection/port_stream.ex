defmodule Bourse.RateLimiter.Backend.Connection.PortStream do
  @moduledoc false
  # A `bourse_daemon --stdio` run as an Erlang port, its frames on a Unix socket: the port
  # is the daemon's life (its exit status, its end when the VM closes it), the socket its
  # stream (`--stdio-socket`: this side listens, in a directory of its own that only this
  # OS user can enter, and the path is gone once the daemon connected). On the socket the
  # connection reads and writes as on a daemon's (`SocketStream`): a caller alone in flight
  # reads its own answer. Every frame both ways is a 4-byte big-endian length, then the
  # payload (a JSON hello asking for the external term format, then terms). The port is
  # reopened at once when it dies (with --assume-busy-at-start: its table would be new), and
  # a port that cannot start is a configuration error.

  @behaviour Bourse.RateLimiter.Backend.Connection.Transport

  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.{PrivateDir, SocketStream}

  @handshake_timeout 5_000
  # The largest answer read: the largest request any daemon accepts (--max-frame-bytes).
  @max_answer_bytes 64 * 1024 * 1024
  # The longest path of a Unix socket (Linux), and what the path adds to the temporary
  # directory's: "/bourse-", 16 random characters, "/d.sock".
  @max_socket_path_bytes 107
  @added_bytes 31

  @impl true
  def open({:port, executable, args}, settings) do
    flags = if settings.assume_busy, do: ["--assume-busy-at-start" | args], else: args

    with {:ok, dir} <- socket_dir() do
      path = Path.join(dir, "d.sock")

      try do
        start(executable, flags ++ ["--stdio-socket", path], path, settings)
      after
        PrivateDir.discard(dir)
      end
    end
  end

  defp start(executable, flags, path, settings) do
    with {:ok, listener} <- listen(path) do
      accepted =
        with {:ok, port} <- spawn_daemon(executable, flags, settings.env),
             do: accept(listener, port, executable)

      :socket.close(listener)

      with {:ok, socket, port} <- accepted do
        stream = SocketStream.stream(socket, port)

        case hello(socket, port, settings.busy_start) do
          {:ok, hello} ->
            {:ok, stream, hello}

          error ->
            :ok = SocketStream.close(stream)
            kill_port(port)
            error
        end
      end
    end
  end

  # The socket's private directory. A runtime directory only this OS user may enter (a
  # login session's, a service's) leaves no moment for another user to put entries in it
  # before it is made private; else it goes in the temporary directory.
  defp socket_dir do
    with runtime when is_binary(runtime) <- private_runtime_dir(),
         {:ok, dir} <- PrivateDir.create(runtime),
         :ok <- same_owner(runtime, dir) do
      {:ok, dir}
    else
      _none -> PrivateDir.create(temporary_base())
    end
  end

  # `$XDG_RUNTIME_DIR`, if it is a directory of mode 0700 whose path leaves room for the
  # socket's.
  defp private_runtime_dir do
    with dir when is_binary(dir) and dir != "" <- System.get_env("XDG_RUNTIME_DIR"),
         true <- fits?(dir),
         {:ok, %File.Stat{type: :directory, mode: mode}} <- File.lstat(dir),
         0o700 <- Bitwise.band(mode, 0o777) do
      dir
    else
      _ -> nil
    end
  end

  # The directory made is this OS user's: the runtime directory must be too (root may
  # inherit another user's).
  defp same_owner(runtime, dir) do
    case {File.lstat(runtime), File.lstat(dir)} do
      {{:ok, %File.Stat{uid: uid}}, {:ok, %File.Stat{uid: uid}}} ->
        :ok

      _other ->
        PrivateDir.discard(dir)
        :error
    end
  end

  # The system's temporary directory, or /tmp if its path is too long for a socket's.
  defp temporary_base do
    base = System.tmp_dir() || "/tmp"
    if fits?(base), do: base, else: "/tmp"
  end

  # Whether a socket's path under `base` is short enough.
  defp fits?(base), do: byte_size(base) + @added_bytes <= @max_socket_path_bytes

  defp listen(path) do
    with {:ok, listener} <- :socket.open(:local, :stream, :default),
         :ok <- :socket.bind(listener, %{family: :local, path: path}),
         :ok <- :socket.listen(listener, 1) do
      {:ok, listener}
    else
      {:error, reason} ->
        {:error, "cannot listen on #{Bourse.Error.path(path)}: #{inspect(reason)}"}
    end
  end

  # An executable that is not there is not spawned: the VM leaks a file per such spawn.
  defp spawn_daemon(executable, flags, env) do
    case :file.read_file_info(executable) do
      {:ok, _info} -> open_port(executable, flags, env)
      {:error, reason} -> {:error, cannot_run(executable, reason)}
    end
  end

  # Only the spawn's own failure (no such file, not executable) is the binary's. Its stdin
  # and stdout become the socket: their end is no end of the port.
  defp open_port(executable, flags, env) do
    {:ok,
     Port.open({:spawn_executable, executable}, [
       :stream,
       :binary,
       :exit_status,
       :use_stdio,
       :eof,
       args: flags,
       env: env
     ])}
  rescue
    error in ErlangError -> {:error, cannot_run(executable, error.original)}
  end

  defp cannot_run(executable, reason),
    do: "cannot run #{executable}: #{:file.format_error(reason)}"

  # The daemon connects at once, or exits.
  defp accept(listener, port, executable) do
    case :socket.accept(listener, :nowait) do
      {:ok, socket} ->
        {:ok, socket, port}

      {:select, _info} ->
        receive do
          {:"$socket", ^listener, :select, _handle} -> accept(listener, port, executable)
          {^port, {:exit_status, status}} -> {:error, exited_early(executable, status)}
        after
          @handshake_timeout ->
            kill_port(port)
            {:error, "it did not connect within #{@handshake_timeout} ms"}
        end

      {:error, reason} ->
        close_port(port)
        {:error, "cannot accept its connection: #{inspect(reason)}"}
    end
  end

  # A program the kernel refuses to run passes the spawn: the VM's child exits with the
  # errno of its exec, ENOEXEC (8), a status the daemon itself never exits with.
  defp exited_early(executable, 8),
    do:
      "cannot run #{executable}: it is not an executable this system can run " <>
        "(#{:file.format_error(:enoexec)})"

  defp exited_early(executable, status),
    do: "#{executable} exited with status #{status} before it connected"

  # The daemon writes nothing before its hello's answer and nothing after it unasked.
  defp hello(socket, port, busy_start) do
    hello = Connection.hello_request(busy_start)

    with :ok <- :socket.send(socket, frame(hello, byte_size(hello)), @handshake_timeout),
         {:ok, <<size::32>>} when size <= @max_answer_bytes <-
           :socket.recv(socket, 4, [], @handshake_timeout),
         {:ok, answer} <- :socket.recv(socket, size, [], @handshake_timeout) do
      Connection.hello(answer)
    else
      _failed ->
        receive do
          {^port, {:exit_status, status}} -> {:error, "it exited with status #{status}"}
        after
          100 -> {:error, "no hello within #{@handshake_timeout} ms"}
        end
    end
  end

  # A frame of `size` bytes of `payload`, on a port as on a socket.
  @spec frame(iodata(), non_neg_integer()) :: iodata()
  def frame(payload, size), do: [<<size::32>>, payload]

  @impl true
  defdelegate write_nowait(stream, table, iodata, count), to: SocketStream

  @impl true
  defdelegate unsent(stream), to: SocketStream

  @impl true
  defdelegate read_for(stream, table), to: SocketStream

  @impl true
  defdelegate settled(stream, count, partial), to: SocketStream

  @impl true
  def close(stream) do
    :ok = SocketStream.close(stream)
    close_port(elem(stream, 3))
  end

  defp close_port(port) do
    Port.close(port)
    :ok
  rescue
    # It closed already.
    ArgumentError -> :ok
  end

  # A daemon that did not start as it should is killed, not only left: one that reads
  # neither its socket nor its stdin (blocked opening a file, say) would outlive the VM.
  defp kill_port(port) do
    with {:os_pid, os_pid} <- Port.info(port, :os_pid) do
      close_port(port)
      :os.cmd(~c"kill -KILL #{os_pid} 2>/dev/null")
    end

    :ok
  end

  @impl true
  def received({port, {:exit_status, status}}, {_socket, _counters, _select, port}),
    do: {:down, "the port process exited with status #{status}"}

  def received({:EXIT, port, reason}, {_socket, _counters, _select, port}),
    do: {:down, "the port closed (#{inspect(reason)})"}

  def received(message, {_socket, _counters, _select, port} = stream) do
    case SocketStream.received(message, stream) do
      {:down, reason} -> {:down, exit_reason(port, reason)}
      other -> other
    end
  end

  # The socket closes as the daemon exits: its exit status says more.
  defp exit_reason(port, reason) do
    receive do
      {^port, {:exit_status, status}} -> "the port process exited with status #{status}"
    after
      100 -> reason
    end
  end

  @impl true
  def no_partial, do: <<>>

  # Each complete frame in what is left of the previous data and the new data (sub-binaries
  # of them, copied by no one), and what is left; or, past a header announcing more than
  # @max_answer_bytes (no daemon writes such an answer), the frames before it and why the
  # stream is broken: what follows is not buffered. What is left of a frame begun is kept as
  # its chunks (`{bytes wanted, bytes held, chunks newest first}`), joined once it is whole:
  # joining at every read would copy a frame of n reads n times.
  @impl true
  def answers({wanted, held, chunks}, data) when held + byte_size(data) < wanted,
    do: {[], {wanted, held + byte_size(data), [data | chunks]}}

  def answers({_wanted, _held, chunks}, data),
    do: split(IO.iodata_to_binary(Enum.reverse(chunks, [data])), [])

  def answers(<<>>, data), do: split(data, [])
  def answers(partial, data), do: split(partial <> data, [])

  defp split(<<size::32, _::binary>>, frames) when size > @max_answer_bytes,
    do:
      {:error, Enum.reverse(frames),
       "the daemon announced an answer of #{size} bytes (at most #{@max_answer_bytes} are read)"}

  defp split(<<size::32, frame::binary-size(size), rest::binary>>, frames),
    do: split(rest, [frame | frames])

  defp split(<<size::32, _::binary>> = begun, frames),
    do: {Enum.reverse(frames), {size + 4, byte_size(begun), [begun]}}

  defp split(rest, frames), do: {Enum.reverse(frames), rest}

  @impl true
  def reopen, do: :at_once

  @impl true
  def start_without_it?, do: false

  @impl true
  def describe({:port, executable, _args}),
    do: "bourse_daemon port (#{Bourse.Error.path(executable)})"
end
