defmodule Mix.Tasks.Bourse.Daemon do
  @shortdoc "Runs the bourse_daemon binary that :bourse built"

  @moduledoc """
  Runs `bourse_daemon`, the shared limiter daemon that `:bourse` built into its
  `priv/native` (`Bourse.RateLimiter.Backend.Port.executable/0`), with the arguments given:
  the same flags as the binary's (`mix bourse.daemon --help`, docs/PROTOCOL.md).

      BOURSE_DAEMON_SECRET=... mix bourse.daemon --listen 127.0.0.1:7878 --assume-busy-at-start
      mix bourse.daemon --socket /run/bourse/limiter.sock

  The daemon's output and errors are printed as they come; the task exits with the daemon's
  status, and the daemon stops when the task's VM goes away (Ctrl-C, `kill`). Secrets
  are read by the daemon from files or its environment (which it inherits from this
  task), never from the command line. Under a service manager (systemd) run the binary
  itself: its path is `Bourse.RateLimiter.Backend.Port.executable/0`, and in a release
  `bin/APP eval 'IO.puts(Bourse.RateLimiter.Backend.Port.executable())'` prints it.
  """

  use Mix.Task

  alias Bourse.RateLimiter.Backend.Port, as: PortBackend

  # A port's program runs in a session of its own and outlives the VM that started it: the
  # daemon runs under sh, which stops it when the port's pipe (sh's stdin) closes, as it
  # does when this VM exits or is killed, and exits with the daemon's status.
  @supervise ~S"""
  exec 3<&0
  "$0" "$@" </dev/null &
  daemon=$!
  { cat <&3 >/dev/null; kill "$daemon"; } >/dev/null 2>&1 &
  watcher=$!
  wait "$daemon"
  status=$?
  kill "$watcher" 2>/dev/null
  exit "$status"
  """

  @impl true
  def run(args) do
    Mix.Task.run("app.config")
    executable = PortBackend.executable()

    unless File.exists?(executable) do
      Mix.raise("bourse_daemon not found at #{executable}: run mix compile")
    end

    port =
      Port.open({:spawn_executable, System.find_executable("sh")}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        args: ["-c", @supervise, executable | args]
      ])

    case wait(port) do
      0 -> :ok
      status -> exit({:shutdown, status})
    end
  end

  defp wait(port) do
    receive do
      {^port, {:exit_status, status}} ->
        status

      {^port, {:data, data}} ->
        IO.write(data)
        wait(port)
    end
  end
end
