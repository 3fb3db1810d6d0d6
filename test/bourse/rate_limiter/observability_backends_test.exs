defmodule Bourse.ObservabilityScenario do
  # One scenario of inspect_key, stats, busiest and events, run against each backend.
  import ExUnit.Assertions

  alias Bourse.{Error, Fingerprint, RateLimiter}

  @limit %{capacity: 2, refill_per_sec: 0.001}

  def start(backend, extra \\ []) do
    name = :"observability_backend_#{System.unique_integer([:positive])}"
    test = self()
    on_event = fn event, measurements, metadata -> send(test, {event, measurements, metadata}) end

    ExUnit.Callbacks.start_supervised!(
      {RateLimiter, [name: name, backend: backend, on_event: on_event] ++ extra}
    )

    name
  end

  def run(name) do
    # An API key that looks like a fingerprint is fingerprinted too, and once only.
    credential = "key:" <> Base.encode16(:crypto.strong_rand_bytes(4), case: :lower)
    key = {"binance", credential, "ip"}
    fingerprint = Fingerprint.of(credential)
    assert fingerprint != credential
    before = RateLimiter.stats(name)

    assert RateLimiter.inspect_key(key, name) == nil

    assert {:error, %Error{type: :invalid_parameters}} =
             RateLimiter.inspect_key({"binance", ~c"x"}, name)

    assert {:error, %Error{type: :invalid_parameters}} =
             RateLimiter.check_rate(key, %{capacity: -1, refill_per_sec: 1}, 1, name)

    assert :ok = RateLimiter.check_rate(key, @limit, 2, name)
    assert {:delay, ms} = RateLimiter.check_rate(key, @limit, 1, name)

    assert_received {[:bourse, :rate_limiter, :refused], %{delay_ms: ^ms},
                     %{credential: ^fingerprint, reason: :delay, axis: "ip"}}

    assert {:delay, booked} =
             RateLimiter.check_rates([{key, @limit, 1}], name, max_wait_ms: 10_000_000)

    assert_received {[:bourse, :rate_limiter, :booked], %{delay_ms: ^booked}, %{cost: 1}}

    # Back early with a shorter budget: refused over budget, its booking kept.
    assert {:error, %Error{type: :rate_limit_exceeded, retry_after: held}} =
             RateLimiter.check_rates([{key, @limit, 1}], name, max_wait_ms: 10)

    assert_received {[:bourse, :rate_limiter, :refused], %{delay_ms: ^held},
                     %{reason: :over_budget, max_wait_ms: 10}}

    assert :ok = RateLimiter.pause({"binance", credential}, 60_000, name)

    assert_received {[:bourse, :rate_limiter, :paused], %{ms: 60_000},
                     %{credential: ^fingerprint}}

    assert %{
             limit: %{capacity: 2.0, refill_per_sec: 0.001},
             tokens: tokens,
             bookings: 1,
             booked_cost: 1.0,
             next_ready_ms: next_ready,
             pause_ms: pause
           } = RateLimiter.inspect_key(key, name)

    assert_in_delta tokens, -1.0, 0.01
    assert next_ready > 0
    assert pause in 50_000..60_000

    assert Enum.any?(
             RateLimiter.busiest(100, name),
             &match?(
               %{exchange: "binance", credential: ^fingerprint, axis: "ip", bookings: 1},
               &1
             )
           )

    after_ = RateLimiter.stats(name)

    for {counter, added} <- [admitted: 1, delayed: 1, booked: 1, over_budget: 1] do
      assert after_[counter] - before[counter] == added,
             "#{counter}: #{inspect({before, after_})}"
    end

    # The bad capacity at least: the backends' encoders refuse the charlist credential
    # before the daemon sees it, and that refusal is not counted.
    assert after_.invalid > before.invalid

    assert after_.bookings >= 1
    assert after_.event_failures == 0
  end

  # A booking nobody claims lapses; the sweep reports it once the table has counted it:
  # in the sweep itself, or (`touch: true`, where the sweep does not look at every key)
  # when the key is next checked. A token refills in 1 s: the booking is made even when a
  # loaded machine takes long between the two calls.
  def lapse(name, opts \\ []) do
    key = {"okx", :public, "lapse-#{System.unique_integer([:positive])}"}
    limit = %{capacity: 1, refill_per_sec: 1}
    assert :ok = RateLimiter.check_rate(key, limit, 1, name)

    assert {:delay, ms} = RateLimiter.check_rates([{key, limit, 1}], name, max_wait_ms: 5_000)

    if opts[:touch] do
      Process.sleep(ms + 100)
      RateLimiter.check_rate(key, limit, 1, name)
    end

    assert_receive {[:bourse, :rate_limiter, :lapsed], %{count: count}, %{limiter: ^name}},
                   10_000

    assert count >= 1
  end
end

defmodule Bourse.RateLimiter.ObservabilityPortTest do
  use ExUnit.Case, async: true

  alias Bourse.ObservabilityScenario, as: Scenario

  test "inspect_key, stats, busiest and events through a port" do
    :port |> Scenario.start() |> Scenario.run()
  end

  test "lapses through a port" do
    :port |> Scenario.start(booking_slack_ms: 0, sweep_interval_ms: 20) |> Scenario.lapse()
  end
end

defmodule Bourse.RateLimiter.ObservabilityDaemonTest do
  use ExUnit.Case, async: false

  alias Bourse.DaemonServer
  alias Bourse.ObservabilityScenario, as: Scenario

  setup_all do
    daemon = DaemonServer.start(["--listen", "127.0.0.1:0", "--booking-slack-ms", "0"])
    on_exit(fn -> DaemonServer.stop(daemon) end)
    %{daemon: daemon}
  end

  test "inspect_key, stats, busiest and events through a shared daemon", %{daemon: daemon} do
    {:daemon, daemon.tcp} |> Scenario.start() |> Scenario.run()
  end

  test "lapses through a shared daemon", %{daemon: daemon} do
    {:daemon, daemon.tcp} |> Scenario.start(sweep_interval_ms: 20) |> Scenario.lapse()
  end
end

defmodule Bourse.RateLimiter.ObservabilityRedisTest do
  use ExUnit.Case, async: false

  alias Bourse.ObservabilityScenario, as: Scenario
  alias Bourse.RedisServer

  unless RedisServer.installed?(), do: @moduletag(skip: "no redis-server (make deps installs it)")

  setup_all do
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    %{redis: redis}
  end

  test "inspect_key, stats, busiest and events with the buckets in Redis", %{redis: redis} do
    {:redis, redis.url} |> Scenario.start() |> Scenario.run()
  end

  # Redis expires idle keys itself; lapses are counted when a key is next checked.
  test "lapses with the buckets in Redis", %{redis: redis} do
    {:redis, redis.url}
    |> Scenario.start(booking_slack_ms: 0, sweep_interval_ms: 20)
    |> Scenario.lapse(touch: true)
  end
end
