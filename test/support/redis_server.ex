defmodule Bourse.RedisServer do
  @moduledoc """
  Runs `redis-server` (no persistence) on a free loopback port for tests.

      redis = Bourse.RedisServer.start()
      redis.url    #=> "redis://127.0.0.1:40123"
      Bourse.RedisServer.stop(redis)

  The server outlives the process that started it, so it can be started in `setup_all`
  and stopped in `on_exit`. `installed?/0` tells whether the binary exists (`make deps`
  installs it).
  """

  import Bourse.Loopback, only: [free_port: 0]

  alias Bourse.Loopback

  @enforce_keys [:os_pid, :port, :url]
  defstruct @enforce_keys

  @type t :: %__MODULE__{os_pid: pos_integer(), port: :inet.port_number(), url: String.t()}

  @spec installed?() :: boolean()
  def installed?, do: System.find_executable("redis-server") != nil

  @doc "Starts a server on a free port (or on `port`) and waits until it answers PING."
  @spec start(:inet.port_number() | nil) :: t()
  def start(port \\ nil) do
    port = port || free_port()

    server =
      Port.open({:spawn_executable, System.find_executable("redis-server")}, [
        :binary,
        args: ["--port", "#{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
      ])

    {:os_pid, os_pid} = Port.info(server, :os_pid)
    redis = %__MODULE__{os_pid: os_pid, port: port, url: "redis://127.0.0.1:#{port}"}
    wait_until(fn -> command(redis, "PING") == "+PONG\r\n" end, "redis-server answers PING")
    redis
  end

  @doc """
  Stops the server without saving (its data is lost) and waits until it is gone; one a
  test that failed left stopped (SIGSTOP) is continued first.
  """
  @spec stop(t()) :: :ok
  def stop(redis) do
    System.cmd("kill", ["-CONT", Integer.to_string(redis.os_pid)], stderr_to_stdout: true)
    command(redis, "SHUTDOWN NOSAVE")
    wait_until(fn -> not File.exists?("/proc/#{redis.os_pid}") end, "redis-server exits")
  end

  # One inline command; its raw reply, or nil.
  defp command(redis, line) do
    with {:ok, socket} <- :gen_tcp.connect(~c"127.0.0.1", redis.port, [:binary, active: false]) do
      :ok = :gen_tcp.send(socket, line <> "\r\n")
      reply = with {:ok, reply} <- :gen_tcp.recv(socket, 0, 1_000), do: reply
      :gen_tcp.close(socket)
      if is_binary(reply), do: reply
    else
      _ -> nil
    end
  end

  defp wait_until(probe, what), do: Loopback.wait_until(probe, what, 10_000)
end
