defmodule Bourse.RateLimiter.Backend.RedisRestartTest do
  # A Redis limiter's own daemon started again (killed, or its limiter restarted) finds the
  # buckets in Redis as they were: it starts as the first one did, and empties nothing for
  # the other limiters sharing them.
  use ExUnit.Case, async: true

  import Bourse.BackendCase, only: [handle: 1, port_os_pid: 1]
  import Bourse.ContractCase, only: [eventually: 1, now_ms: 0]

  alias Bourse.{OsSignal, RateLimiter, RedisServer}

  @moduletag :capture_log

  unless RedisServer.installed?(), do: @moduletag(skip: "no redis-server (make deps installs it)")

  # Nearly no refill: what a bucket holds is what it was left with.
  @limit %{capacity: 10, refill_per_sec: 0.01}

  setup do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    backend = {:redis, redis.url, prefix: "restart"}
    [restarted, other] = for _ <- 1..2, do: :"redis_restart_#{System.unique_integer([:positive])}"
    # A booking waits for its waiter however long a loaded machine takes to restart a daemon.
    opts = [name: restarted, backend: backend, booking_slack_ms: 30_000]
    start_supervised!({RateLimiter, opts}, id: restarted)
    start_supervised!({RateLimiter, name: other, backend: backend}, id: other)
    key = {"ex", "shared"}
    assert :ok = RateLimiter.check_rate(key, @limit, 4, restarted)
    %{backend: backend, key: key, other: other, restarted: restarted}
  end

  test "its daemon killed: the bucket keeps its tokens for both limiters",
       %{key: key, other: other, restarted: restarted} do
    handle = handle(restarted)
    old = port_os_pid(handle)
    OsSignal.send(old, "KILL")
    eventually(fn -> port_os_pid(handle) != old end)

    assert_kept(key, restarted, other)
  end

  # Before, the new daemon knew no booking of the waiter: it booked and paid a second time.
  test "its daemon killed while a waiter sleeps: the waiter claims its booking, paying once",
       %{restarted: restarted} do
    key = {"ex", "waiter"}
    limit = %{capacity: 5, refill_per_sec: 5}
    assert :ok = RateLimiter.check_rate(key, limit, 5, restarted)
    checks = [{key, limit, 5}]
    assert {:delay, ms} = RateLimiter.check_rates(checks, restarted, max_wait_ms: 5_000)
    ready_at = now_ms() + ms

    handle = handle(restarted)
    old = port_os_pid(handle)
    OsSignal.send(old, "KILL")
    eventually(fn -> port_os_pid(handle) != old end)

    Process.sleep(max(ready_at - now_ms(), 0))
    assert :ok = RateLimiter.check_rates(checks, restarted, max_wait_ms: 5_000)
    # Paid once: the booking's 5, less what refilled since it was ready.
    assert RateLimiter.get_cost(key, 0, restarted) <= 5.0
  end

  test "the limiter restarted: the bucket keeps its tokens for both limiters",
       %{backend: backend, key: key, other: other, restarted: restarted} do
    stop_supervised!(restarted)
    start_supervised!({RateLimiter, name: restarted, backend: backend}, id: restarted)

    assert_kept(key, restarted, other)
  end

  defp assert_kept(key, restarted, other) do
    assert :ok = RateLimiter.check_rate(key, @limit, 2, restarted)
    assert :ok = RateLimiter.check_rate(key, @limit, 2, other)
    assert_in_delta RateLimiter.inspect_key(key, other).tokens, 2, 0.1
    # A new bucket of the exchange starts full.
    assert :ok = RateLimiter.check_rate({"ex", "new"}, @limit, 10, restarted)
  end
end
