defmodule Bourse.RateLimiter.Backend.Connection.PortStream do
  @moduledoc false
  # A `bourse_daemon --stdio` run as an Erlang port: frames are a 4-byte big-endian length
  # and the JSON. The port is reopened at once when it dies (with --assume-busy-at-start:
  # its table would be new), and a port that cannot start is a configuration error.

  @behaviour Bourse.RateLimiter.Backend.Connection.Transport

  alias Bourse.RateLimiter.Backend.Connection

  @handshake_timeout 5_000

  @impl true
  def open({:port, executable, args}, settings) do
    flags = if settings.assume_busy, do: ["--assume-busy-at-start" | args], else: args

    port =
      Port.open({:spawn_executable, executable}, [
        :stream,
        :binary,
        :exit_status,
        :use_stdio,
        busy_limits_port: {64 * 1024, 1024 * 1024},
        args: flags,
        env: settings.env
      ])

    hello = Connection.hello_request()
    Port.command(port, frame(hello, IO.iodata_length(hello)))

    with {:ok, hello} <- hello(port, "") do
      {:ok, port, hello}
    end
  rescue
    error -> {:error, "cannot start #{executable}: #{Exception.message(error)}"}
  end

  defp hello(port, received) do
    receive do
      {^port, {:data, chunk}} ->
        case received <> chunk do
          <<size::32, frame::binary-size(size), _::binary>> -> Connection.hello(frame)
          incomplete -> hello(port, incomplete)
        end

      {^port, {:exit_status, status}} ->
        {:error, "it exited with status #{status}"}
    after
      @handshake_timeout ->
        Port.close(port)
        {:error, "no hello within #{@handshake_timeout} ms"}
    end
  end

  @impl true
  def frame(payload, size), do: [<<size::32>>, payload]

  # A port busy with earlier requests is not waited for: the connection must stay free to
  # read answers and to fail callers.
  @impl true
  def write(port, iodata) do
    if Port.command(port, iodata, [:nosuspend]), do: :ok, else: :busy
  rescue
    ArgumentError -> {:error, :closed}
  end

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

  # `partial`: the pieces of a frame not complete yet, their size, the size they must reach;
  # a frame in pieces is joined once all of it is there.
  @impl true
  def no_partial, do: {[], 0, 4}

  @impl true
  def answers({[], 0, _wanted}, chunk), do: frames(chunk, [])

  def answers({pieces, held, wanted}, chunk) do
    held = held + byte_size(chunk)

    if held < wanted,
      do: {[], {[pieces, chunk], held, wanted}},
      else: frames(IO.iodata_to_binary([pieces, chunk]), [])
  end

  defp frames(<<size::32, frame::binary-size(size), rest::binary>>, acc),
    do: frames(rest, [frame | acc])

  defp frames(<<>>, acc), do: {Enum.reverse(acc), no_partial()}

  defp frames(<<size::32, _::binary>> = rest, acc),
    do: {Enum.reverse(acc), {[rest], byte_size(rest), size + 4}}

  defp frames(rest, acc), do: {Enum.reverse(acc), {[rest], byte_size(rest), 4}}

  @impl true
  def reopen, do: :at_once

  @impl true
  def start_without_it?, do: false

  @impl true
  def describe({:port, executable, _args}), do: "bourse_daemon port (#{executable})"
end
