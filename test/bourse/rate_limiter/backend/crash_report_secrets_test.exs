defmodule Bourse.RateLimiter.Backend.CrashReportSecretsTest do
  # The crash report of a limiter or of its connection to a daemon (which OTP logs with the
  # process's state and last message) holds neither the daemon's shared secret nor a Redis
  # password.
  # Not async: captures the global Logger.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog
  import Bourse.BackendCase, only: [handle: 1, start_daemon: 1, start_limiter: 1]
  import Bourse.ContractCase, only: [eventually: 1]

  alias Bourse.{DaemonServer, RedisServer}

  unless RedisServer.installed?(), do: @moduletag(skip: "no redis-server (make deps installs it)")

  @password "redis-pass-0123456789"

  setup do
    redis = RedisServer.start()
    # It asks for a password, which `RedisServer.stop/1` does not give.
    on_exit(fn -> System.cmd("kill", ["-9", "#{redis.os_pid}"]) end)

    {"OK\n", 0} =
      System.cmd("redis-cli", ~w(-p #{redis.port} CONFIG SET requirepass #{@password}))

    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    url = "redis://:#{@password}@127.0.0.1:#{redis.port}"
    %{tcp: start_limiter({:daemon, daemon.tcp}), redis: start_limiter({:redis, url})}
  end

  defp crash_report(fun) do
    capture_log(fn ->
      Process.flag(:trap_exit, true)
      fun.()
      Process.sleep(300)
    end)
  end

  test "a crashed connection's report shows no secret", %{tcp: tcp, redis: redis} do
    for name <- [tcp, redis] do
      pid = handle(name).pid
      ref = Process.monitor(pid)
      # Stopped for an abnormal reason, it writes a crash report with its state.
      log = crash_report(fn -> :sys.terminate(pid, :crash_report_test) end)
      assert_received {:DOWN, ^ref, :process, ^pid, _}
      assert log =~ "terminating"
      refute log =~ DaemonServer.secret()
      refute log =~ @password
    end
  end

  test "a crashed connection's report shows no key of a request kept for the next stream" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    name = start_limiter({:daemon, daemon.tcp})
    System.cmd("kill", ["-9", "#{daemon.os_pid}"])
    handle = handle(name)
    key = {"crash", "api-key-0123456789"}

    eventually(fn ->
      match?({:error, %{type: :unavailable}}, Bourse.RateLimiter.inspect_key(key, name))
    end)

    limit = %{capacity: 1, refill_per_sec: 1}
    Bourse.RateLimiter.Backend.Protocol.unbook(handle, self(), [{key, limit, 1}])
    assert MapSet.size(:sys.get_state(handle.pid).kept_later) == 1
    log = crash_report(fn -> :sys.terminate(handle.pid, :crash_report_test) end)
    assert log =~ "terminating"
    refute log =~ "api-key-0123456789"
    # Nor an encoded request (a map in the external term format), shown as bytes.
    refute log =~ "<<131, 116,"
  end

  test "a crashed limiter's report shows no Redis password", %{redis: redis} do
    pid = GenServer.whereis(redis)
    ref = Process.monitor(pid)
    log = crash_report(fn -> :sys.terminate(pid, :crash_report_test) end)
    assert_received {:DOWN, ^ref, :process, ^pid, _}
    assert log =~ "terminating"
    refute log =~ @password
  end
end
