defmodule Bourse.RateLimiter.Backend.RedisKeysExpireTest do
  # Every key the Redis backend writes expires but one per prefix (docs/PROTOCOL.md,
  # "Redis"), also after FLUSHALL, which empties the keyspace but keeps the function
  # library.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  import Bourse.BackendCase, only: [start_limiter: 1]

  alias Bourse.{RateLimiter, RedisServer}

  unless RedisServer.installed?(), do: @moduletag(skip: "no redis-server (make deps installs it)")

  @credential "SECRET-CREDENTIAL-0123"
  @limit %{capacity: 5, refill_per_sec: 1}

  defp redis_cli(redis, args) do
    {out, 0} = System.cmd("redis-cli", ["-p", "#{redis.port}" | args])
    String.trim(out)
  end

  defp checks(names, exchanges) do
    for name <- names, exchange <- exchanges do
      answer = RateLimiter.check_rate({exchange, @credential}, @limit, 1, name)
      assert answer == :ok or match?({:delay, _}, answer), inspect(answer)
    end
  end

  test "after FLUSHALL every key written again expires but the record, and none names the credential" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    busy = :"busy_#{System.unique_integer([:positive])}"
    backend = {:redis, redis.url, redis_timeout_ms: 4_000}

    start_supervised!({RateLimiter, name: busy, backend: backend, assume_busy_at_start: true},
      id: busy
    )

    names = [start_limiter(backend), busy]
    checks(names, ["x", "y"])
    assert redis_cli(redis, ["FLUSHALL"]) == "OK"
    checks(names, ["x", "y", "z"])

    keys = redis_cli(redis, ["--scan"]) |> String.split("\n", trim: true)
    assert Enum.any?(keys, &String.starts_with?(&1, "bourse:e{")), inspect(keys)

    # The server's record of since when its data is whole is one key, kept for good.
    assert "bourse:data" in keys

    for key <- keys -- ["bourse:data"] do
      ttl = String.to_integer(redis_cli(redis, ["PTTL", key]))
      assert ttl > 0, "#{key} has no expiry (PTTL #{ttl})"
      refute key =~ @credential
    end
  end
end
