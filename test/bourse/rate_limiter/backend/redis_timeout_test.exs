defmodule Bourse.RateLimiter.Backend.RedisTimeoutTest do
  # A Redis timeout longer than the wait of the limiter's callers: a caller told
  # `:unavailable` must not pay when Redis resumes and runs the script it had received
  # (docs/CONTRACT.md §8, Stores).
  use ExUnit.Case, async: true

  @moduletag :capture_log

  import Bourse.BackendCase, only: [start_daemon: 1, start_limiter: 1]
  import Bourse.ContractCase, only: [eventually: 1]

  alias Bourse.{AnswerHold, Error, OsSignal, RateLimiter, RedisServer}

  unless RedisServer.installed?(), do: @moduletag(skip: "no redis-server (make deps installs it)")

  test "a Redis timeout of 12 s: a check that finds Redis stopped is never told :unavailable and paid later" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    name = start_limiter({:redis, redis.url, redis_timeout_ms: 12_000})
    key = {"slow_redis", "k"}
    limit = %{capacity: 20, refill_per_sec: 0.001}
    assert :ok = RateLimiter.check_rate(key, limit, 1, name)

    OsSignal.send(redis.os_pid, "STOP")
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{redis.os_pid}"], stderr_to_stdout: true) end)
    check = Task.async(fn -> RateLimiter.check_rate(key, limit, 1, name) end)
    # Redis resumes 8 s later: the caller has given up by then if it waits 5 s, and the
    # script may still run (until three quarters of the Redis timeout).
    early = Task.yield(check, 8_000)
    OsSignal.send(redis.os_pid, "CONT")

    case early || Task.yield(check, 60_000) do
      {:ok, :ok} ->
        assert RateLimiter.inspect_key(key, name).tokens < 18.01

      {:ok, {:error, %Error{type: :unavailable}}} ->
        Process.sleep(500)
        info = RateLimiter.inspect_key(key, name)
        assert info.tokens > 18.99, "a check told :unavailable paid: #{inspect(info)}"
    end
  end

  test "a shared daemon whose Redis timeout (4 s) is longer than its client's (1 s): a check told :unavailable never pays" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    args = ["--listen", "127.0.0.1:0", "--redis", redis.url, "--redis-timeout-ms", "4000"]
    daemon = start_daemon(args)
    name = start_limiter({:daemon, daemon.tcp, timeout: 1_000})
    key = {"slow_redis", "shared"}
    limit = %{capacity: 20, refill_per_sec: 0.001}
    assert :ok = RateLimiter.check_rate(key, limit, 1, name)

    OsSignal.send(redis.os_pid, "STOP")
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{redis.os_pid}"], stderr_to_stdout: true) end)
    assert {:error, %Error{type: :unavailable}} = RateLimiter.check_rate(key, limit, 1, name)
    # Resumed past the caller's deadline, well before the daemon stops waiting for Redis
    # (its script, queued in Redis, then runs).
    Process.sleep(300)
    OsSignal.send(redis.os_pid, "CONT")
    Process.sleep(1_000)
    info = RateLimiter.inspect_key(key, name)
    assert info.tokens > 18.99, "a check told :unavailable paid: #{inspect(info)}"
  end

  test "a debit or check that Redis ran but answered after the Redis timeout is given back" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    relay = AnswerHold.start(redis.port)
    name = start_limiter({:redis, "redis://127.0.0.1:#{relay.port}", redis_timeout_ms: 300})
    limit = %{capacity: 20, refill_per_sec: 0.001}
    {defined, debt_only} = {{"late_answer", "a"}, {"late_answer", "b"}}
    assert :ok = RateLimiter.check_rate(defined, limit, 1, name)

    # Redis runs each call; its answer comes after the caller was told :unavailable.
    late = [
      fn -> RateLimiter.record_request(defined, 5, name) end,
      fn -> RateLimiter.check_rate(defined, limit, 2, name) end,
      fn -> RateLimiter.record_request(debt_only, 3, name) end
    ]

    for call <- late do
      AnswerHold.hold(relay, true)
      assert {:error, %Error{type: :unavailable}} = call.()
      AnswerHold.hold(relay, false)
    end

    # Before debits were given back, the bucket lent 6 and the other key held a debt of 3.
    eventually(fn ->
      abs(RateLimiter.get_cost(defined, nil, name) - 1) < 0.01 and
        abs(RateLimiter.get_cost(debt_only, nil, name)) < 0.01
    end)
  end

  test "observe_response answers within one Redis timeout when Redis stops: its later round trips do not wait again" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    name = start_limiter({:redis, redis.url, redis_timeout_ms: 1_000})
    header = [{"x-mbx-used-weight-1m", "10"}]
    assert :ok = RateLimiter.observe_response("binance", "k", 200, header, name)

    OsSignal.send(redis.os_pid, "STOP")
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{redis.os_pid}"], stderr_to_stdout: true) end)

    # A used-weight sync, then a backoff reset (200) or a pause (429): two round trips.
    for status <- [200, 429] do
      {micros, answer} =
        :timer.tc(fn -> RateLimiter.observe_response("binance", "k", status, header, name) end)

      assert {:error, %Error{type: :unavailable}} = answer
      # Two Redis timeouts before (2 s each, measured); one now.
      assert micros < 1_700_000, "HTTP #{status}: answered after #{div(micros, 1000)} ms"
    end
  end

  test "a request of observe_response refused at once does not keep its limited reply's pause from being recorded" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    name = start_limiter({:redis, redis.url, redis_timeout_ms: 1_000})
    ip = %{capacity: 480, refill_per_sec: 72}
    assert :ok = RateLimiter.check_rate({"binance", "k", "ip"}, ip, 1, name)

    # The bucket's key made a string: its sync is refused at once (WRONGTYPE).
    {keys, 0} = System.cmd("redis-cli", ["-p", "#{redis.port}", "--scan", "--pattern", "*:b:*"])

    for key <- String.split(keys, "\n", trim: true),
        do: {_, 0} = System.cmd("redis-cli", ["-p", "#{redis.port}", "SET", key, "x"])

    headers = [{"retry-after", "30"}, {"x-mbx-used-weight-1m", "10"}]

    assert {:error, %Error{type: :rate_limit_exceeded, retry_after: 30_000}} =
             RateLimiter.observe_response("binance", "k", 429, headers, name,
               limits: %{"ip" => ip}
             )

    # The pause was recorded all the same: every caller of the credential holds.
    assert {:delay, ms} = RateLimiter.check_rate({"binance", "k", "orders"}, ip, 1, name)
    assert ms > 25_000
  end
end
