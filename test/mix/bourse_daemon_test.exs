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
end
