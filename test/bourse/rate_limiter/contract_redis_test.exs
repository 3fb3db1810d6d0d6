defmodule Bourse.RateLimiter.ContractRedisTest do
  # The whole contract (docs/CONTRACT.md) through the public API, with the buckets in Redis: each
  # limiter runs its own `bourse_daemon --stdio --redis URL`, all on one redis-server
  # started here, so the tests run one at a time on a Redis cleared before each. The tests
  # that need limiters with buckets of their own do not apply.
  use Bourse.ContractTests,
    backend: {:redis, "set in setup_all"},
    async: false,
    skip: [:own_table]

  alias Bourse.RedisServer

  unless RedisServer.installed?(), do: @moduletag(skip: "no redis-server (make deps installs it)")

  setup_all do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    # Overrides the module's :backend tag for every test. No test here is about Redis
    # timeouts: a slow Redis on a loaded machine gets 4 s, not the default 1 s.
    %{backend: {:redis, redis.url, redis_timeout_ms: 4_000}, redis: redis}
  end

  setup %{name: name} do
    assert :ok = Bourse.RateLimiter.reset_all(name)
    :ok
  end

  describe "several machines on one Redis" do
    test "limiters on one Redis share their buckets", %{backend: backend, name: name} do
      other = :"#{name}.other_machine"
      start_supervised!({Bourse.RateLimiter, name: other, backend: backend}, id: other)
      key = {"binance", "shared"}
      limit = %{capacity: 3, refill_per_sec: 0.001}
      assert :ok = Bourse.RateLimiter.check_rate(key, limit, 2, name)
      assert :ok = Bourse.RateLimiter.check_rate(key, limit, 1, other)
      assert {:delay, _} = Bourse.RateLimiter.check_rate(key, limit, 1, name)
      assert Bourse.RateLimiter.get_cost(key, 60_000, other) >= 2.99
    end

    test "nothing is admitted while Redis is down, and it works again after", %{
      redis: redis,
      name: name
    } do
      key = {"okx", "down"}
      limit = %{requests: 100}
      assert :ok = Bourse.RateLimiter.check_rate(key, limit, 1, name)
      RedisServer.stop(redis)

      assert {:error, %Bourse.Error{type: :unavailable}} =
               Bourse.RateLimiter.check_rate(key, limit, 1, name)

      assert {:error, %Bourse.Error{type: :unavailable}} =
               Bourse.RateLimiter.check_rates([{key, limit, 1}], name, max_wait_ms: 1_000)

      RedisServer.start(redis.port)
      assert :ok = Bourse.RateLimiter.check_rate(key, limit, 1, name)
    end

    test "bad Redis options are :invalid_parameters" do
      for backend <- [
            {:redis, "http://127.0.0.1:6379"},
            {:redis, "rediss://127.0.0.1:6379"},
            {:redis, ["rediss://127.0.0.1:7000"]},
            {:redis, "redis://127.0.0.1:99999"},
            {:redis, 6379},
            {:redis, "redis://127.0.0.1:6379", prefix: "a*b"},
            {:redis, "redis://127.0.0.1:6379", redis_timeout_ms: 0},
            {:redis, "redis://127.0.0.1:6379", redis_timeout_ms: 60_001},
            {:redis, "redis://127.0.0.1:6379", timeout: 5}
          ] do
        assert {:error, %Bourse.Error{type: :invalid_parameters}} =
                 Bourse.RateLimiter.start_link(name: :bad_redis_limiter, backend: backend)
      end
    end
  end
end
