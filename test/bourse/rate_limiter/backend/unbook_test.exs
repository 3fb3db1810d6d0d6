defmodule Bourse.RateLimiter.Backend.UnbookTest do
  # A waiter whose claim finds its store stopped, past its booking slack, is told
  # `:unavailable` and gives its booking back: once the store resumes, the bucket holds what
  # it would hold had the waiter never booked (docs/CONTRACT.md, "Stores": such a call never
  # pays). Before, the booking stayed paid: a token short until the bucket refilled.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  import Bourse.BackendCase,
    only: [handle: 1, port_os_pid: 1, start_daemon: 1, start_limiter: 3]

  import Bourse.ContractCase, only: [eventually: 2]

  alias Bourse.{Error, OsSignal, RateLimiter, RedisServer}

  # Drained, it refills a token a second: the waiter books one for a second later.
  @limit %{capacity: 10, refill_per_sec: 1}
  @slack [booking_slack_ms: 50]

  test "the shared in-memory daemon stopped while the waiter sleeps" do
    {name, os_pid} = shared_daemon()

    assert_booking_given_back(name, fn -> OsSignal.send(os_pid, "STOP") end, fn ->
      OsSignal.send(os_pid, "CONT")
    end)
  end

  test "a waiter told :unavailable while the connection to the daemon is down" do
    {name, os_pid} = shared_daemon()

    stop = fn ->
      OsSignal.send(os_pid, "STOP")
      # Unanswered: the connection probes the daemon, and gives the stream up 1 s later,
      # before the waiter (due in 3 s) comes to claim.
      assert {:error, %Error{type: :unavailable}} = RateLimiter.inspect_key({"unbook", "-"}, name)
    end

    resume = fn ->
      # The connection tries again meanwhile, and finds no hello.
      Process.sleep(1_000)
      OsSignal.send(os_pid, "CONT")
    end

    assert_booking_given_back(name, stop, resume, 3)
  end

  test "the unbooks of many waiters, read by a daemon that resumes after the connection gave it up" do
    {name, os_pid} = shared_daemon()
    # Their claims, answered first, find the connection closed: the unbooks written after
    # them are still run (56 of 60 were not).
    keys = for i <- 1..60, do: {"unbook", "many#{i}"}
    for key <- keys, do: assert(:ok = RateLimiter.check_rate(key, @limit, 10, name))
    drained_at = System.monotonic_time(:millisecond)

    waiters =
      for key <- keys,
          do:
            Task.async(fn ->
              RateLimiter.wait_for_capacity(key, @limit, 1, name, max_wait_ms: 5_000)
            end)

    Process.sleep(500)
    OsSignal.send(os_pid, "STOP")
    assert Enum.all?(Task.await_many(waiters, 20_000), &match?({:error, %Error{}}, &1))
    # Past the connection's silence probe (1 s): it closes the stream.
    Process.sleep(2_500)
    OsSignal.send(os_pid, "CONT")

    eventually(
      fn ->
        refilled = (System.monotonic_time(:millisecond) - drained_at) / 1000

        Enum.all?(keys, fn key ->
          match?(
            %{tokens: tokens} when tokens > refilled - 0.5,
            RateLimiter.inspect_key(key, name)
          )
        end)
      end,
      5_000
    )
  end

  test "while the connection is down, an unbook sent again and again waits once" do
    {name, os_pid} = shared_daemon()
    System.cmd("kill", ["-9", "#{os_pid}"])
    key = {"unbook", "retried"}

    eventually(
      fn -> match?({:error, %Error{type: :unavailable}}, RateLimiter.inspect_key(key, name)) end,
      5_000
    )

    # A caller retrying `check_rates` with `:max_wait_ms` meanwhile: each call is answered
    # `:unavailable` unsent, and sends the same unbook. It once took all 10,000 places.
    for _ <- 1..20_000,
        do:
          assert({:error, _} = RateLimiter.check_rates([{key, @limit, 1}], name, max_wait_ms: 1))

    other =
      Task.async(fn -> RateLimiter.check_rates([{key, @limit, 1}], name, max_wait_ms: 1) end)

    assert {:error, %Error{type: :unavailable}} = Task.await(other)
    assert MapSet.size(:sys.get_state(handle(name).pid).kept_later) == 2
  end

  test "a check_rates waiter over two buckets comes back to a stopped daemon" do
    {name, os_pid} = shared_daemon()
    {a, b} = {{"unbook", "a"}, {"unbook", "b"}}
    # Never short: the booking waits on `a` alone, and is paid on both.
    roomy = %{capacity: 100, refill_per_sec: 0.001}
    checks = [{a, @limit, 1}, {b, roomy, 5}]
    assert :ok = RateLimiter.check_rate(a, @limit, 10, name)
    drained_at = System.monotonic_time(:millisecond)
    assert {:delay, ms} = RateLimiter.check_rates(checks, name, max_wait_ms: 5_000)
    assert RateLimiter.get_cost(b, nil, name) > 4.99
    OsSignal.send(os_pid, "STOP")
    Process.sleep(ms)

    assert {:error, %Error{type: :unavailable}} =
             RateLimiter.check_rates(checks, name, max_wait_ms: 5_000)

    OsSignal.send(os_pid, "CONT")
    eventually(fn -> RateLimiter.get_cost(b, nil, name) < 0.01 end, 5_000)
    refilled = (System.monotonic_time(:millisecond) - drained_at) / 1000
    assert RateLimiter.inspect_key(a, name).tokens > refilled - 0.5
  end

  test "the port's daemon stopped while the waiter sleeps" do
    name = start_limiter(:port, "unbook", @slack)
    # Connected, so that the port runs.
    assert :ok = RateLimiter.check_rate({"unbook", "warm"}, @limit, 0, name)
    os_pid = port_os_pid(handle(name))
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{os_pid}"], stderr_to_stdout: true) end)

    assert_booking_given_back(name, fn -> OsSignal.send(os_pid, "STOP") end, fn ->
      OsSignal.send(os_pid, "CONT")
    end)
  end

  if RedisServer.installed?() do
    test "Redis stopped while the waiter sleeps" do
      redis = RedisServer.start()
      on_exit(fn -> RedisServer.stop(redis) end)
      name = start_limiter({:redis, redis.url, redis_timeout_ms: 300}, "unbook", @slack)

      assert_booking_given_back(name, fn -> OsSignal.send(redis.os_pid, "STOP") end, fn ->
        OsSignal.send(redis.os_pid, "CONT")
      end)
    end
  end

  # A limiter on a shared in-memory daemon of its own, and the daemon's OS pid.
  defp shared_daemon do
    socket = Bourse.TempPath.new("unbook", ".sock")
    daemon = start_daemon(["--socket", socket])
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{daemon.os_pid}"], stderr_to_stdout: true) end)
    {start_limiter({:daemon, {:unix, socket}, timeout: 300}, "unbook", @slack), daemon.os_pid}
  end

  # Drains a bucket, has a waiter book `cost` tokens (due in `cost` s), stops the store
  # (`stop`) while the waiter sleeps, resumes it (`resume`) once the waiter was told
  # `:unavailable`, then waits for the bucket to hold all it refilled since it was drained.
  defp assert_booking_given_back(name, stop, resume, cost \\ 1) do
    key = {"unbook", "k#{System.unique_integer([:positive])}"}
    assert :ok = RateLimiter.check_rate(key, @limit, 10, name)
    drained_at = System.monotonic_time(:millisecond)

    waiter =
      Task.async(fn ->
        RateLimiter.wait_for_capacity(key, @limit, cost, name, max_wait_ms: 5_000)
      end)

    Process.sleep(400)
    assert RateLimiter.inspect_key(key, name).bookings == 1
    stop.()
    assert {:error, %Error{type: :unavailable}} = Task.await(waiter, 15_000)
    resume.()

    eventually(
      fn ->
        refilled = (System.monotonic_time(:millisecond) - drained_at) / 1000
        # A paid booking would leave `cost` tokens less: what refilled, less `cost`. (Unavailable
        # while the connection is made again.)
        case RateLimiter.inspect_key(key, name) do
          %{bookings: 0, tokens: tokens} -> tokens > refilled - 0.5
          _booked_or_unavailable -> false
        end
      end,
      5_000
    )
  end
end
