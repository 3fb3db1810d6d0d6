defmodule Bourse.RateLimiter.Backend.Connection.PortStream do
  @moduledoc false
  # A `bourse_daemon --stdio` run as an Erlang port: every frame both ways is a 4-byte
  # big-endian length, then the payload (a JSON hello asking for the external term format,
  # then terms). The frames are written and read here, not by the port (no `{:packet, 4}`),
  # so that one write can carry the frames of many callers and one message the answers of
  # one read. The port is reopened at once when it dies (with --assume-busy-at-start: its
  # table would be new), and a port that cannot start is a configuration error.

  @behaviour Bourse.RateLimiter.Backend.Connection.Transport

  alias Bourse.RateLimiter.Backend.Connection

  @handshake_timeout 5_000
  # The largest answer read: the largest request any daemon accepts (--max-frame-bytes).
  @max_answer_bytes 64 * 1024 * 1024

  @impl true
  def open({:port, executable, args}, settings) do
    flags = if settings.assume_busy, do: ["--assume-busy-at-start" | args], else: args

    with {:ok, port} <- spawn_daemon(executable, flags, settings.env),
         hello = Connection.hello_request(),
         true <- Port.command(port, frame(hello, byte_size(hello))),
         {:ok, hello} <- hello(port, no_partial()) do
      {:ok, port, hello}
    end
  end

  # Only the spawn's own failure (no such file, not executable) is the binary's.
  defp spawn_daemon(executable, flags, env) do
    {:ok,
     Port.open({:spawn_executable, executable}, [
       :stream,
       :binary,
       :exit_status,
       :use_stdio,
       busy_limits_port: {64 * 1024, 1024 * 1024},
       args: flags,
       env: env
     ])}
  rescue
    error in ErlangError ->
      {:error, "cannot run #{executable}: #{:file.format_error(error.original)}"}
  end

  # The daemon writes nothing before its hello's answer and nothing after it unasked.
  defp hello(port, partial) do
    receive do
      {^port, {:data, data}} ->
        case answers(partial, data) do
          {[frame | _], _rest} -> Connection.hello(frame)
          {[], partial} -> hello(port, partial)
          {:error, _frames, reason} -> {:error, reason}
        end

      {^port, {:exit_status, status}} ->
        {:error, "it exited with status #{status}"}
    after
      @handshake_timeout ->
        Port.close(port)
        {:error, "no hello within #{@handshake_timeout} ms"}
    end
  end

  # A frame of `size` bytes of `payload`, on a port as on a socket.
  @spec frame(iodata(), non_neg_integer()) :: iodata()
  def frame(payload, size), do: [<<size::32>>, payload]

  # A port busy with earlier requests is not waited for: its callers try again until their
  # deadline.
  @spec write(port(), iodata()) :: :ok | :busy | {:error, :closed}
  def write(port, iodata) do
    if Port.command(port, iodata, [:nosuspend]), do: :ok, else: :busy
  rescue
    ArgumentError -> {:error, :closed}
  end

  @impl true
  def write_nowait(port, iodata), do: write(port, iodata)

  # The connection reads every answer of a port, as it comes.
  @impl true
  def counted(_port, _count), do: :ok

  @impl true
  def read_for(_port, _table), do: :ok

  @impl true
  def settled(_port, _count, _partial), do: :ok

  @impl true
  def close(port) do
    Port.close(port)
    :ok
  rescue
    # It closed already.
    ArgumentError -> :ok
  end

  @impl true
  def received({port, {:data, chunk}}, port), do: {:data, chunk}

  def received({port, {:exit_status, status}}, port),
    do: {:down, "the port process exited with status #{status}"}

  def received({:EXIT, port, reason}, port), do: {:down, "the port closed (#{inspect(reason)})"}
  def received(_message, _port), do: :other

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
  def describe({:port, executable, _args}), do: "bourse_daemon port (#{executable})"
end
