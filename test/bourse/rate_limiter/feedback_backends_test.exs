defmodule Bourse.FeedbackScenario do
  # The same replies observed on each backend get the same answers (docs/CONTRACT.md §8): header sync
  # within the exchange's limit, body signals, bans and the backoff all go through the
  # backend's pause, sync and bucket calls.
  import ExUnit.Assertions

  alias Bourse.RateLimiter

  def start(backend) do
    name = :"feedback_backend_#{System.unique_integer([:positive])}"
    ExUnit.Callbacks.start_supervised!({RateLimiter, name: name, backend: backend})
    name
  end

  # Runs the replies; returns the answers, each error with its fields but the message's
  # credential-free text, for comparison across backends.
  def run(name) do
    # Exchange ids of their own, so that limiters sharing a daemon or Redis do not meet.
    run = System.unique_integer([:positive])
    binance = "binance_#{run}"
    bybit = "bybit_#{run}"
    key = {binance, "k", "ip"}

    Bourse.Window.clear_of_edges(60_000)
    assert :ok = RateLimiter.check_rate(key, %{requests: 6000, period: 60_000}, 1, name)

    sync =
      RateLimiter.observe_response(binance, "k", 200, [{"x-mbx-used-weight-1m", "5900"}], name)

    left = Bourse.Window.left(60_000)
    tokens = RateLimiter.inspect_key(key, name).tokens
    assert_in_delta tokens, min(5999, 100 - 100 * left / 1000), 20

    # A counter reported far past the exchange's limit holds checks until its window ends,
    # never longer: the exchange forgets its count then.
    over = {binance, "k2", "ip"}
    Bourse.Window.clear_of_edges(60_000)
    assert :ok = RateLimiter.check_rate(over, %{requests: 6000, period: 60_000}, 1, name)
    headers = [{"x-mbx-used-weight-1m", "999999999999999"}]
    # Read first: the store's window ends no later, however long the reply takes to reach it.
    left = Bourse.Window.left(60_000)
    assert :ok = RateLimiter.observe_response(binance, "k2", 200, headers, name)

    assert {:delay, ms} = RateLimiter.check_rate(over, %{requests: 6000, period: 60_000}, 1, name)

    assert ms <= left + 20

    answers =
      for {exchange, status, headers, body} <- [
            {bybit, 200, [], ~s({"retCode":10006,"retMsg":"Too many visits!"})},
            {bybit, 200, [], %{"retCode" => 10006}},
            {bybit, 200, [], %{"retCode" => 0}},
            {bybit, 200, [{"retry-after", "2"}], %{"retCode" => 10018}},
            {"kraken_#{run}", 200, [], ~s({"error":["EAPI:Rate limit exceeded"]})},
            {"okx_#{run}", 429, [], ~s({"code":"50011","msg":"Rate limit reached."})},
            {"coinbase_#{run}", 200, [], %{"errors" => [%{"id" => "rate_limit_exceeded"}]}},
            {binance, 403, [], "<html></html>"},
            {"bybit-x#{run}", 200, [{"retry-after", "600"}], %{"retCode" => 10006}},
            # Repeated headers: the longest wait; a malformed entry: acted on all the same.
            {"ex_#{run}", 429, [{"retry-after", "1"}, {"retry-after", 2.5}], nil},
            {"ex2_#{run}", 429, [{:"retry-after", "2"}, {"retry-after", "3"}], nil},
            {"ex3_#{run}", 200, [{"retry-after", "3", "x"}], nil}
          ] do
        RateLimiter.observe_response(exchange, "k", status, headers, name, body: body)
      end

    paused =
      for key <- [{bybit, "k", "a"}, {bybit, :public, "b"}, {binance, :public, "c"}] do
        match?(
          {:delay, _},
          RateLimiter.check_rate(key, %{capacity: 1, refill_per_sec: 1}, 1, name)
        )
      end

    assert paused == [true, true, true]

    [sync | answers]
    |> Enum.map(&String.replace(inspect(&1), "#{run}", "_"))
    |> Kernel.++([paused])
  end
end

defmodule Bourse.RateLimiter.FeedbackBackendsTest do
  use ExUnit.Case, async: false

  alias Bourse.{DaemonServer, RedisServer}
  alias Bourse.FeedbackScenario, as: Scenario

  setup_all do
    daemon = DaemonServer.start(["--listen", "127.0.0.1:0"])
    redis = if RedisServer.installed?(), do: RedisServer.start()

    on_exit(fn ->
      DaemonServer.stop(daemon)
      if redis, do: RedisServer.stop(redis)
    end)

    %{daemon: daemon, redis: redis}
  end

  test "the same replies get the same answers on every backend", %{daemon: daemon, redis: redis} do
    nif = :nif |> Scenario.start() |> Scenario.run()
    assert [":ok", "{:error, %Bourse.Error{" <> _ | _] = nif

    backends = [:port, {:daemon, daemon.tcp}] ++ if(redis, do: [{:redis, redis.url}], else: [])

    for backend <- backends do
      assert backend |> Scenario.start() |> Scenario.run() == nif, inspect(backend)
    end
  end
end
