defmodule Mix.Tasks.Bourse.DaemonTest do
  # `mix bourse.daemon` runs the binary :bourse built, with the flags given, in the
  # terminal of the mix that runs it.
  use ExUnit.Case, async: true

  defp mix(args, env \\ []) do
    System.cmd("mix", ["bourse.daemon" | args],
      stderr_to_stdout: true,
      env: [{"MIX_ENV", "test"} | env]
    )
  end

  test "runs the binary with the flags given and exits with its status" do
    {output, 0} = mix(["--version"])
    assert output =~ ~r/^bourse_daemon \S+ \(protocol 1\)$/m

    {output, 0} = mix(["--help"])
    assert output =~ "--secret-file"

    # A TCP listener without a secret is refused by the daemon: status 2.
    {output, status} = mix(["--listen", "127.0.0.1:0"], [{"BOURSE_DAEMON_SECRET", nil}])
    assert status != 0
    assert output =~ "needs a shared secret"
  end

  test "the daemon stops when the task's VM is killed" do
    socket = Bourse.TempPath.new("bourse_daemon_test", ".sock")

    port =
      Port.open({:spawn_executable, System.find_executable("mix")}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        args: ["bourse.daemon", "--socket", socket],
        env: [{~c"MIX_ENV", ~c"test"}]
      ])

    assert_receive {^port, {:data, "listening unix " <> _}}, 60_000
    [daemon] = daemons(["--socket", socket])

    # The port's program leads a process group: mix's script and the VM.
    {:os_pid, mix} = Port.info(port, :os_pid)
    System.cmd("sh", ["-c", "kill -s KILL -- -#{mix}"])
    assert_receive {^port, {:exit_status, _}}, 10_000
    assert wait_until(fn -> not alive?(daemon) end), "bourse_daemon on #{socket} outlived mix"
  end

  # The bourse_daemon processes running with exactly these arguments.
  defp daemons(args) do
    for pid <- File.ls!("/proc"),
        {:ok, cmdline} <- [File.read("/proc/#{pid}/cmdline")],
        [program | ^args] <- [String.split(cmdline, <<0>>, trim: true)],
        Path.basename(program) == "bourse_daemon",
        do: pid
  end

  defp alive?(pid), do: File.exists?("/proc/#{pid}") and not zombie?(pid)

  defp zombie?(pid) do
    case File.read("/proc/#{pid}/stat") do
      {:ok, stat} -> stat |> String.split(") ") |> List.last() |> String.starts_with?("Z")
      {:error, _} -> true
    end
  end

  defp wait_until(fun, tries \\ 100) do
    cond do
      fun.() -> true
      tries == 0 -> false
      true -> Process.sleep(100) && wait_until(fun, tries - 1)
    end
  end
end
