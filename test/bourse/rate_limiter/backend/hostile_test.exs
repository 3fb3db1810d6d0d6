defmodule Bourse.RateLimiter.Backend.HostileTest do
  # The backends out of the VM against hostile input and a misbehaving store, each with a
  # real bourse_daemon (and a real redis-server) on loopback.
  use ExUnit.Case, async: false

  import Bourse.BackendCase, only: [start_daemon_and_redis: 1, start_limiter: 1]

  alias Bourse.Error
  alias Bourse.RateLimiter
  alias Bourse.RedisServer

  @moduletag :capture_log

  @secret "SECRET-API-KEY-0123456789abcdef"

  setup_all do
    start_daemon_and_redis("bourse-hostile")
  end

  defp backends(%{daemon: daemon, redis: redis}) do
    [
      port: :port,
      tcp: {:daemon, daemon.tcp},
      unix: {:daemon, {:unix, daemon.unix}},
      redis: {:redis, redis.url}
    ]
  end

  defp timed(fun) do
    started = System.monotonic_time(:millisecond)
    answer = fun.()
    {answer, System.monotonic_time(:millisecond) - started}
  end

  test "bignums get :invalid_parameters at once, on every backend", context do
    limit = %{capacity: 10, refill_per_sec: 1}

    for {label, backend} <- backends(context) do
      name = start_limiter(backend)
      assert :ok = RateLimiter.check_rate({"ex", "k"}, limit, 1, name)

      for {limit, cost} <- [
            {%{capacity: 10 ** 400, refill_per_sec: 1}, 1},
            {%{capacity: 10, refill_per_sec: 10 ** 400}, 1},
            {%{requests: -(10 ** 400)}, 1},
            {limit, 10 ** 400}
          ] do
        {answer, ms} = timed(fn -> RateLimiter.check_rate({"ex", "k"}, limit, cost, name) end)
        # Before, the daemon could not read such a frame: the caller waited 5 s for nothing.
        assert {:error, %Error{type: :invalid_parameters, message: message}} = answer,
               "#{label}: #{inspect(answer)}"

        assert ms < 3_000, "#{label}: #{ms} ms"
        assert byte_size(message) < 300, "#{label}: #{message}"
      end

      assert :ok = RateLimiter.check_rate({"ex", "k"}, limit, 1, name)
    end
  end

  test "misplaced credentials are never echoed", context do
    limit = %{capacity: 10, refill_per_sec: 1}

    for {label, backend} <- backends(context) do
      name = start_limiter(backend)

      for answer <- [
            RateLimiter.check_rate({{"binance", @secret}, "ip"}, limit, 1, name),
            RateLimiter.check_rate({"binance", "k", {@secret}}, limit, 1, name),
            RateLimiter.check_rate({"binance", "k"}, limit, @secret, name),
            RateLimiter.check_rate({"binance", "k"}, %{requests: @secret}, 1, name),
            RateLimiter.check_rate({"binance", [@secret]}, limit, 1, name),
            RateLimiter.check_rates([{{"binance", "k"}, limit, @secret}], name),
            RateLimiter.record_request({"binance", "k"}, @secret, name),
            RateLimiter.reset_exchange([@secret], name),
            RateLimiter.reset({@secret}, name)
          ] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} = answer,
               "#{label}: #{inspect(answer)}"

        refute message =~ "SECRET", "#{label}: #{message}"
      end

      # busiest shows fingerprints only.
      assert :ok = RateLimiter.check_rate({"binance", @secret}, limit, 3, name)
      rows = RateLimiter.busiest(5, name)
      refute inspect(rows) =~ "SECRET", "#{label}: #{inspect(rows)}"
      fingerprint = Bourse.Fingerprint.of(@secret)
      assert Enum.any?(rows, fn row -> row.credential == fingerprint end), "#{label}"
      :ok = RateLimiter.reset_all(name)
    end
  end

  defp redis_signal(redis, signal), do: Bourse.OsSignal.send(redis.os_pid, signal)

  test "a stopped Redis: every caller gets :unavailable within the Redis timeout, and none pays" do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    name = start_limiter({:redis, redis.url, redis_timeout_ms: 500})
    key = {"stopped", "k"}
    limit = %{capacity: 20, refill_per_sec: 0.001}
    assert :ok = RateLimiter.check_rate(key, limit, 1, name)

    redis_signal(redis, "STOP")

    answers =
      1..20
      |> Enum.map(fn _ ->
        Task.async(fn -> timed(fn -> RateLimiter.check_rate(key, limit, 1, name) end) end)
      end)
      |> Enum.map(&Task.await(&1, 30_000))

    redis_signal(redis, "CONT")
    slowest = answers |> Enum.map(&elem(&1, 1)) |> Enum.max()
    IO.puts("\n20 callers with Redis stopped: the slowest answered after #{slowest} ms")

    for {answer, ms} <- answers do
      assert {:error, %Error{type: :unavailable}} = answer
      # Before: every caller waited 5,001 ms.
      assert ms <= 500 + 3_000, "#{ms} ms"
    end

    # Redis ran the scripts it had received, past their deadline: none of them paid.
    Process.sleep(300)
    tokens = RateLimiter.inspect_key(key, name).tokens
    IO.puts("tokens after SIGCONT: #{tokens} (19 before the stop)")
    assert tokens > 18.99
  end
end
