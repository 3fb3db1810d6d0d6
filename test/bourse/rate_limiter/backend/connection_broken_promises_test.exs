defmodule Bourse.RateLimiter.Backend.ConnectionBrokenPromisesTest do
  # Attacks on the port and daemon backends (docs/CONTRACT.md §8, Stores): a
  # caller told :unavailable whose request the daemon ran later; a caller killed between
  # noting its route and writing its request.
  use ExUnit.Case, async: true

  import Bourse.BackendCase
  import Bourse.ContractCase, only: [eventually: 1, now_ms: 0]

  alias Bourse.DaemonServer
  alias Bourse.RateLimiter

  @moduletag :capture_log

  @slow %{capacity: 1, refill_per_sec: 0.001}
  @wide %{capacity: 1.0e9, refill_per_sec: 1.0e9}

  # The routes in the table once they stop going away (or 0).
  defp routes_left(handle, give_up_at) do
    case routes(handle) do
      0 ->
        0

      left ->
        if now_ms() < give_up_at,
          do: Process.sleep(50) && routes_left(handle, give_up_at),
          else: left
    end
  end

  describe "a caller told :unavailable pays nothing (docs/CONTRACT.md §8, Stores)" do
    test "daemon backend: a check that timed out while the daemon was stopped is not paid when it resumes" do
      {daemon, name} = start_connected_daemon(timeout: 300)

      DaemonServer.signal(daemon, "STOP")
      assert unavailable?(RateLimiter.check_rate({"ex", "k"}, @slow, 1, name))
      DaemonServer.signal(daemon, "CONT")

      # The bucket holds one token; the call above was refused, so it is still there.
      eventually(fn -> RateLimiter.check_rate({"ex", "warm"}, @wide, 1, name) == :ok end)
      assert RateLimiter.get_cost({"ex", "k"}, 0, name) == 0
      assert :ok = RateLimiter.check_rate({"ex", "k"}, @slow, 1, name)
    end

    @tag timeout: 60_000
    test "port backend: a check that timed out while the port's daemon was stopped is not paid when it resumes" do
      name = start_limiter(:port)
      os_pid = name |> handle() |> stop_port()
      assert unavailable?(RateLimiter.check_rate({"ex", "k"}, @slow, 1, name))
      Bourse.OsSignal.send(os_pid, "CONT")

      eventually(fn -> RateLimiter.check_rate({"ex", "warm"}, @wide, 1, name) == :ok end)
      assert RateLimiter.get_cost({"ex", "k"}, 0, name) == 0
      assert :ok = RateLimiter.check_rate({"ex", "k"}, @slow, 1, name)
    end
  end

  describe "callers killed" do
    @tag timeout: 120_000
    test "port backend: callers killed at any moment of their call leave no route behind" do
      name = start_limiter(:port)
      handle = handle(name)

      # The daemon stopped under a flood: the port is busy, callers loop noting their
      # route, finding the port busy and taking the route back, until they are killed.
      os_pid = stop_port(handle)
      flooder = flood(name, @wide)
      # The flood's route; the limiter's own periodic sweep may be waiting beside it.
      eventually(fn -> routes(handle) >= 1 end)

      for round <- 1..40 do
        callers =
          for i <- 1..50 do
            spawn(fn -> RateLimiter.check_rate({"ex", "k#{round}-#{i}"}, @wide, 1, name) end)
          end

        Process.sleep(:rand.uniform(5))
        Enum.each(callers, &Process.exit(&1, :kill))
      end

      Bourse.OsSignal.send(os_pid, "CONT")
      Task.await(flooder, 60_000)

      # Every request the daemon received was answered; nothing else may be in flight.
      eventually(fn -> RateLimiter.check_rate({"ex", "after"}, @wide, 1, name) == :ok end)
      left = routes_left(handle, now_ms() + 10_000)
      assert left == 0, "#{left} routes left by 2000 killed callers"
    end
  end
end
