defmodule Bourse.RateLimiter.RemoteNodeStoppedTest do
  # A call in flight to a limiter on another node ends soon after that node stops
  # answering (SIGSTOP here: distribution notices only after a minute), and a call that
  # rightly takes longer than a few seconds there is still answered. The limiter there
  # uses a daemon, stopped in turn so that its calls wait its timeout.
  use ExUnit.Case, async: false

  alias Bourse.{DaemonServer, OsSignal, RateLimiter}

  @moduletag :distributed
  @limit %{capacity: 10, refill_per_sec: 1}
  @daemon_timeout 4_000

  setup do
    daemon = DaemonServer.start(["--socket", Bourse.TempPath.new("remote-stop", ".sock")])
    {peer, node} = Bourse.PeerNode.start()
    os_pid = List.to_integer(:erpc.call(node, :os, :getpid, []))

    on_exit(fn ->
      OsSignal.send(os_pid, "CONT")
      :peer.stop(peer)
      :net_kernel.stop()
      DaemonServer.signal(daemon, "CONT")
      DaemonServer.stop(daemon)
    end)

    backend = {:daemon, {:unix, daemon.unix}, timeout: @daemon_timeout}
    child = {RateLimiter, name: :far, backend: backend}
    :ok = :erpc.call(node, Bourse.PeerNode, :start_children, [[child]])
    name = {:far, node}
    assert :ok = RateLimiter.check_rate({"ex", "first"}, @limit, 1, name)
    %{daemon: daemon, name: name, os_pid: os_pid}
  end

  test "a call there that waits its daemon's timeout is answered, however long the poll",
       %{daemon: daemon, name: name} do
    DaemonServer.signal(daemon, "STOP")
    started = System.monotonic_time(:millisecond)

    assert {:error, %Bourse.Error{type: :unavailable}} =
             RateLimiter.check_rate({"ex", "slow"}, @limit, 1, name)

    assert System.monotonic_time(:millisecond) - started >= @daemon_timeout
  end

  test "a call in flight to a stopped node exits as a call timeout within seconds",
       %{daemon: daemon, name: name, os_pid: os_pid} do
    DaemonServer.signal(daemon, "STOP")
    caller = self()

    spawn(fn ->
      started = System.monotonic_time(:millisecond)

      result =
        try do
          RateLimiter.check_rate({"ex", "in flight"}, @limit, 1, name)
        catch
          :exit, reason -> {:exit, reason}
        end

      send(caller, {:ended, result, System.monotonic_time(:millisecond) - started})
    end)

    # The call is on its way there, waiting for the daemon.
    Process.sleep(500)
    OsSignal.send(os_pid, "STOP")

    assert_receive {:ended, result, ms}, 30_000
    assert {:exit, {:timeout, {RateLimiter, :call, [^name]}}} = result
    # The node is asked every second, and given 5 s to answer.
    assert ms < 15_000
  end
end
