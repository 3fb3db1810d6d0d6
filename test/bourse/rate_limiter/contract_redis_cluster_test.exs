defmodule Bourse.RateLimiter.ContractRedisClusterTest do
  # The whole contract (docs/CONTRACT.md) through the public API, with the buckets in a
  # Redis Cluster (three masters, three replicas) started here: `backend: {:redis, seeds}`.
  # As with one Redis server, the limiters share the buckets, so the tests run one at a
  # time on a cluster cleared before each, and the tests of limiters with buckets of their
  # own do not apply, nor, with `assume_busy_at_start`, that of a new exchange (a cluster
  # begins its state at its first check). Fewer random malformed calls than elsewhere: the
  # same daemon as on one Redis server answers them.
  use Bourse.ContractTests,
    backend: {:redis, ["set in setup_all"]},
    async: false,
    skip: [:own_table, :several_exchanges, :new_exchange_when_busy],
    fuzz_calls: 5_000

  alias Bourse.RedisCluster

  if reason = RedisCluster.unavailable(), do: @moduletag(skip: reason)

  setup_all do
    cluster = RedisCluster.start()
    on_exit(fn -> RedisCluster.stop(cluster) end)
    # Two seeds: the daemon finds the other nodes itself. The contract's tests are not
    # about Redis timeouts: a slow Redis on a loaded machine gets 4 s, not the default 1 s.
    %{backend: {:redis, Enum.take(cluster.urls, 2), redis_timeout_ms: 4_000}, cluster: cluster}
  end

  setup %{name: name} do
    assert :ok = Bourse.RateLimiter.reset_all(name)
    :ok
  end

  describe "a Redis Cluster" do
    test "limiters on one cluster share their buckets, on every master", %{
      backend: backend,
      name: name,
      cluster: cluster
    } do
      other = :"#{name}.other_machine"
      start_supervised!({Bourse.RateLimiter, name: other, backend: backend}, id: other)
      limit = %{capacity: 3, refill_per_sec: 0.001}

      for n <- 1..12 do
        key = {"exchange#{n}", "shared"}
        assert :ok = Bourse.RateLimiter.check_rate(key, limit, 2, name)
        assert :ok = Bourse.RateLimiter.check_rate(key, limit, 1, other)
        assert {:delay, _} = Bourse.RateLimiter.check_rate(key, limit, 1, name)
      end

      masters =
        for n <- 1..12, uniq: true do
          slot = RedisCluster.key_slot(cluster, "{#{byte_size("exchange#{n}")}:exchange#{n}}")
          RedisCluster.master_of_slot(cluster, slot)
        end

      assert length(masters) == 3
      assert :ok = Bourse.RateLimiter.reset_exchange("exchange3", other)
      assert Bourse.RateLimiter.get_cost({"exchange3", "shared"}, 1, name) == 0
      assert Bourse.RateLimiter.get_cost({"exchange4", "shared"}, 1, name) >= 2.99
    end

    test "a check over several exchanges would span slots: refused, nothing paid", %{
      name: name
    } do
      limit = %{capacity: 3, refill_per_sec: 0.001}
      checks = [{{"binance", "k"}, limit, 1}, {{"okx", "k"}, limit, 1}]

      assert {:error, %Bourse.Error{type: :invalid_parameters, exchange: "okx", message: message}} =
               Bourse.RateLimiter.check_rates(checks, name)

      assert message =~ "one exchange"
      assert Bourse.RateLimiter.get_cost({"binance", "k"}, 1, name) == 0
      # One exchange, several credentials and the public pool: one slot, atomic.
      checks = [{{"binance", "k"}, limit, 1}, {{"binance", :public, "ip"}, limit, 3}]
      assert :ok = Bourse.RateLimiter.check_rates(checks, name)
      assert {:delay, _} = Bourse.RateLimiter.check_rates(checks, name)
      assert_about(Bourse.RateLimiter.get_cost({"binance", "k"}, 1, name), 1, 0.01)
    end

    test "a master killed: :unavailable within the timeout, nothing admitted, then served again",
         %{backend: {:redis, seeds, _patient}, cluster: cluster} do
      name = :cluster_failover_limiter
      backend = {:redis, seeds, redis_timeout_ms: 500}
      start_supervised!({Bourse.RateLimiter, name: name, backend: backend}, id: name)
      key = {"failover", "k"}
      # Nothing refills during the test, however long the failover takes.
      limit = %{capacity: 1_000, refill_per_sec: 1.0e-6}
      assert :ok = Bourse.RateLimiter.check_rate(key, limit, 1, name)
      # The payment is on the replica too (replication is asynchronous).
      RedisCluster.wait_healthy(cluster)
      slot = RedisCluster.key_slot(cluster, "{8:failover}")
      RedisCluster.kill(cluster, RedisCluster.master_of_slot(cluster, slot))

      answers =
        Stream.repeatedly(fn ->
          timed(fn -> Bourse.RateLimiter.check_rate(key, limit, 1, name) end)
        end)
        |> Enum.reduce_while([], fn {ms, answer}, answers ->
          if answer == :ok or length(answers) > 200,
            do: {:halt, [{ms, answer} | answers]},
            else: {:cont, [{ms, answer} | answers]}
        end)

      assert {_, :ok} = hd(answers), "never served again: #{inspect(Enum.take(answers, 3))}"
      refused = tl(answers)
      assert refused != [], "the failover went unnoticed"

      for {ms, answer} <- refused do
        assert {:error, %Bourse.Error{type: :unavailable}} = answer
        assert ms < 2_000, "an answer took #{ms} ms"
      end

      # Every refusal paid nothing: one check before, one after.
      assert_about(Bourse.RateLimiter.get_cost(key, 1, name), 2, 0.01)
      RedisCluster.wait_healthy(cluster)
    end

    test "bad cluster seeds are :invalid_parameters" do
      for seeds <- [
            [],
            ["http://127.0.0.1:7000"],
            ["unix:///tmp/x"],
            [7000],
            ["redis://a:1" | "b"]
          ] do
        assert {:error, %Bourse.Error{type: :invalid_parameters}} =
                 Bourse.RateLimiter.start_link(
                   name: :bad_cluster_limiter,
                   backend: {:redis, seeds}
                 )
      end
    end
  end
end
