defmodule Bourse.RateLimiter.Backend.RedisRestartTest do
  # A Redis limiter's own daemon started again (killed, or its limiter restarted) finds the
  # buckets in Redis as they were: it starts as the first one did, and empties nothing for
  # the other limiters sharing them.
  use ExUnit.Case, async: true

  import Bourse.BackendCase, only: [handle: 1, port_os_pid: 1]
  import Bourse.ContractCase, only: [eventually: 1]

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
    start_supervised!({RateLimiter, name: restarted, backend: backend}, id: restarted)
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
