defmodule Bourse.RateLimiter.Backend.PortStartTest do
  # A port whose daemon refuses its configuration is told why (the daemon answers its
  # hello with the message it prints on stderr, then exits 2): the limiter's start names
  # the cause, not only the exit status.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.{RateLimiter, RedisServer}

  test "a Redis URL the daemon refuses: :invalid_parameters, naming what is wrong with it" do
    for {url, cause} <- [
          {"redis://127.0.0.1:6379/notanumber", "Invalid database number"},
          {"redis://127.0.0.1:99999", "99999"}
        ] do
      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               RateLimiter.start_link(name: :port_start_bad_url, backend: {:redis, url})

      assert message =~ "bourse_daemon refused its configuration"
      assert message =~ cause
      refute message =~ "exited with status"
    end
  end

  test "a password in the URL is never in the refusal" do
    url = "redis://:s3cret-Pa55@127.0.0.1:6379/notanumber"

    assert {:error, %Bourse.Error{message: message}} =
             RateLimiter.start_link(name: :port_start_bad_db_password, backend: {:redis, url})

    assert message =~ "Invalid database number"
    refute message =~ "s3cret"
  end

  unless RedisServer.installed?(), do: @tag(skip: "no redis-server (make deps installs it)")

  test "a single Redis given as a list of cluster seeds: :invalid_parameters, saying so" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    seeds = ["redis://127.0.0.1:#{redis.port}"]

    assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
             RateLimiter.start_link(name: :port_start_single_redis, backend: {:redis, seeds})

    assert message =~
             "redis at 127.0.0.1:#{redis.port}: it is not a Redis Cluster (cluster support disabled)"

    assert message =~ "backend: {:redis, url}, not a list"
  end
end
