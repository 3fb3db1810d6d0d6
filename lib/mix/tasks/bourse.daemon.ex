defmodule Mix.Tasks.Bourse.Daemon do
  @shortdoc "Runs the bourse_daemon binary that :bourse built"

  @moduledoc """
  Runs `bourse_daemon`, the shared limiter daemon that `:bourse` built into its
  `priv/native` (`Bourse.RateLimiter.Backend.Port.executable/0`), with the arguments given:
  the same flags as the binary's (`mix bourse.daemon --help`, docs/PROTOCOL.md).

      BOURSE_DAEMON_SECRET=... mix bourse.daemon --listen 127.0.0.1:7878 --assume-busy-at-start
      mix bourse.daemon --socket /run/bourse/limiter.sock

  The daemon shares this task's standard input, output and error; the task exits with the
  daemon's status (Ctrl-C reaches both: the daemon stops as on SIGINT). Secrets
  are read by the daemon from files or its environment (which it inherits from this
  task), never from the command line. Under a service manager (systemd) run the binary
  itself: its path is `Bourse.RateLimiter.Backend.Port.executable/0`, and in a release
  `bin/APP eval 'IO.puts(Bourse.RateLimiter.Backend.Port.executable())'` prints it.
  """

  use Mix.Task

  alias Bourse.RateLimiter.Backend.Port, as: PortBackend

  @impl true
  def run(args) do
    Mix.Task.run("app.config")
    executable = PortBackend.executable()

    unless File.exists?(executable) do
      Mix.raise("bourse_daemon not found at #{executable}: run mix compile")
    end

    port =
      Port.open({:spawn_executable, executable}, [
        :binary,
        :exit_status,
        :nouse_stdio,
        args: args
      ])

    case wait(port) do
      0 -> :ok
      status -> exit({:shutdown, status})
    end
  end

  # With :nouse_stdio the daemon keeps this VM's stdin and stdout as its own.
  defp wait(port) do
    receive do
      {^port, {:exit_status, status}} -> status
      {^port, {:data, data}} -> IO.write(data) && wait(port)
    end
  end
end
