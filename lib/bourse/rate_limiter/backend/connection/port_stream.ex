defmodule Bourse.RateLimiter.Backend.Connection.PortStream do
  @moduledoc false
  # A `bourse_daemon --stdio` run as an Erlang port in `{:packet, 4}` mode: the VM frames
  # each request (a 4-byte big-endian length, then the payload: a JSON hello asking for the
  # external term format, then terms) and hands each answer over as one message, so frames
  # are never split or joined here. The port is reopened at once when it dies (with --assume-busy-at-start:
  # its table would be new), and a port that cannot start is a configuration error.

  @behaviour Bourse.RateLimiter.Backend.Connection.Transport

  alias Bourse.RateLimiter.Backend.Connection

  @handshake_timeout 5_000

  @impl true
  def open({:port, executable, args}, settings) do
    flags = if settings.assume_busy, do: ["--assume-busy-at-start" | args], else: args

    with {:ok, port} <- spawn_daemon(executable, flags, settings.env),
         true <- Port.command(port, Connection.hello_request()),
         {:ok, hello} <- hello(port) do
      {:ok, port, hello}
    end
  end

  # Only the spawn's own failure (no such file, not executable) is the binary's.
  defp spawn_daemon(executable, flags, env) do
    {:ok,
     Port.open({:spawn_executable, executable}, [
       {:packet, 4},
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

  defp hello(port) do
    receive do
      {^port, {:data, frame}} ->
        Connection.hello(frame)

      {^port, {:exit_status, status}} ->
        {:error, "it exited with status #{status}"}
    after
      @handshake_timeout ->
        Port.close(port)
        {:error, "no hello within #{@handshake_timeout} ms"}
    end
  end

  @impl true
  def frame(payload, _size), do: payload

  # A port busy with earlier requests is not waited for: its callers try again until their
  # deadline.
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

  @impl true
  def no_partial, do: nil

  @impl true
  def answers(nil, frame), do: {[frame], nil}

  @impl true
  def reopen, do: :at_once

  @impl true
  def start_without_it?, do: false

  @impl true
  def describe({:port, executable, _args}), do: "bourse_daemon port (#{executable})"
end
