defmodule Bourse.DaemonServer do
  @moduledoc """
  Runs `bourse_daemon` servers (priv/native/bourse_daemon) as OS processes for tests.

      daemon = Bourse.DaemonServer.start(["--listen", "127.0.0.1:0"])
      daemon.tcp    #=> "127.0.0.1:40123" (the `listening tcp ...` line)
      Bourse.DaemonServer.stop(daemon)

  The daemon outlives the process that started it (a server ignores its stdin), so it can
  be started in `setup_all` and stopped in `on_exit`; `stop/1` and `signal/2` work from any
  process.
  """

  import ExUnit.Assertions

  alias Bourse.RateLimiter.Backend.Port, as: PortBackend

  @enforce_keys [:os_pid, :tcp, :unix]
  defstruct @enforce_keys

  @type t :: %__MODULE__{os_pid: pos_integer(), tcp: String.t() | nil, unix: Path.t() | nil}

  @secret "test-daemon-secret-0123456789"

  @doc """
  Starts a daemon with `args` and waits until every listener is bound. Its TCP clients
  prove the secret `secret/0`, which this VM's `BOURSE_DAEMON_SECRET` holds from then on
  (where the daemon backend reads it).
  """
  @spec start([String.t()]) :: t()
  def start(args) do
    System.put_env("BOURSE_DAEMON_SECRET", @secret)

    port =
      Port.open({:spawn_executable, PortBackend.executable()}, [
        :binary,
        :exit_status,
        {:line, 4096},
        args: args,
        env: [{~c"BOURSE_DAEMON_SECRET", String.to_charlist(@secret)}]
      ])

    {:os_pid, os_pid} = Port.info(port, :os_pid)
    listeners = Enum.count(args, &(&1 in ["--listen", "--socket"]))
    bound = for _ <- 1..listeners//1, into: %{}, do: listener(port)
    %__MODULE__{os_pid: os_pid, tcp: bound[:tcp], unix: bound[:unix]}
  end

  defp listener(port) do
    receive do
      {^port, {:data, {:eol, "listening tcp " <> address}}} -> {:tcp, address}
      {^port, {:data, {:eol, "listening unix " <> path}}} -> {:unix, path}
      {^port, {:exit_status, status}} -> flunk("bourse_daemon exited with status #{status}")
    after
      30_000 -> flunk("bourse_daemon did not report its listeners")
    end
  end

  @doc "The shared secret of the daemons started here."
  @spec secret() :: String.t()
  def secret, do: @secret

  @doc """
  Sends a signal (`"TERM"`, `"KILL"`, `"STOP"`, `"CONT"`) to the daemon; after `"STOP"`,
  returns once all its threads are stopped (`Bourse.OsSignal.send/2`).
  """
  @spec signal(t(), String.t()) :: :ok
  def signal(%__MODULE__{os_pid: os_pid}, signal), do: Bourse.OsSignal.send(os_pid, signal)

  @doc """
  Stops the daemon (SIGCONT, as a test that failed may have left it stopped, then SIGTERM)
  and waits until it is gone.
  """
  @spec stop(t()) :: :ok
  def stop(daemon) do
    if alive?(daemon), do: Enum.each(["CONT", "TERM"], &signal(daemon, &1))
    wait_gone(daemon, 300)
  end

  @doc "Kills the daemon (SIGKILL) and waits until it is gone."
  @spec kill(t()) :: :ok
  def kill(daemon) do
    signal(daemon, "KILL")
    wait_gone(daemon, 300)
  end

  @doc """
  Whether the daemon's OS process still runs. A zombie counts as gone once its other
  threads are: a killed process's main thread can be a zombie while they still exit, its
  sockets still open until the last of them has.
  """
  @spec alive?(t()) :: boolean()
  def alive?(%__MODULE__{os_pid: os_pid}) do
    case File.read("/proc/#{os_pid}/stat") do
      {:ok, stat} -> not String.contains?(stat, ") Z ") or threads(os_pid) > 1
      {:error, _} -> false
    end
  end

  defp threads(os_pid) do
    case File.ls("/proc/#{os_pid}/task") do
      {:ok, tasks} -> length(tasks)
      {:error, _} -> 0
    end
  end

  defp wait_gone(daemon, tries) do
    cond do
      not alive?(daemon) ->
        :ok

      tries == 0 ->
        flunk("bourse_daemon #{daemon.os_pid} did not exit")

      true ->
        Process.sleep(20)
        wait_gone(daemon, tries - 1)
    end
  end
end
