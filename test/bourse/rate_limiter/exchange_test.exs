defmodule Bourse.RateLimiter.ExchangeTest do
  use ExUnit.Case, async: true

  alias Bourse.{Error, RateLimiter}
  alias Bourse.RateLimiter.Exchange
  alias Bourse.Testing.{HTTP, MockExchange}

  defp profile!(name, opts \\ []) do
    {:ok, profile} = Exchange.profile(name, opts)
    profile
  end

  describe "profiles" do
    test "every counter of every profile is sized by its rule, and says where it comes from" do
      assert Exchange.profiles() ==
               [:binance_spot, :binance_usdm, :bybit_v5, :coinbase_advanced, :kraken_spot, :okx]

      for name <- Exchange.profiles(), share <- [0.8, 0.5, 1.0] do
        profile = profile!(name)
        assert is_binary(profile.exchange_id) and profile.counters != []
        assert {:ok, buckets} = Exchange.buckets(name, share: share)
        assert map_size(buckets) == length(profile.counters), "#{name}: one bucket per axis"

        for counter <- profile.counters do
          %{capacity: c, refill_per_sec: r} = Map.fetch!(buckets, counter.axis)
          assert c > 0 and r > 0
          assert %{url: "https://" <> _, read: "2026-" <> _} = counter.source
          assert counter.scope in [:ip, :account, :api_key, :endpoint, :instrument]

          case counter.kind do
            kind when kind in [:fixed, :rolling] ->
              assert c + r * counter.window_ms / 1000 <= share * counter.limit,
                     "#{name} #{counter.axis}"

            :decaying ->
              assert c <= max(share * counter.max, min(counter.max, 1)) and c <= counter.max
              assert r <= share * counter.decay_per_sec
          end
        end
      end
    end

    test "a counter's own burst is a floor: capacity 2 at the default share; a larger option applies" do
      assert {:ok, %{"order_create" => %{capacity: 2.0}, "ip" => ip}} =
               Exchange.buckets(:bybit_v5)

      assert {:ok, %{"public" => %{capacity: 2.0}}} = Exchange.buckets(:coinbase_advanced)
      assert {:ok, %{"market" => %{capacity: 2.0}}} = Exchange.buckets(:okx)

      assert {:ok, %{"order_create" => order, "ip" => wider_ip}} =
               Exchange.buckets(:bybit_v5, burst: 0.5)

      assert_in_delta order.capacity, 4.0, 1.0e-9
      assert_in_delta wider_ip.capacity, 5 * ip.capacity, 1.0e-9

      assert {:ok, %{"order_create" => %{capacity: 2.0}}} =
               Exchange.buckets(:bybit_v5, burst: 0.05)
    end

    test "Fincode's field report's Binance figures; Kraken's tiers; the usual axes" do
      assert {:ok, %{"ip" => %{capacity: 480.0, refill_per_sec: 72.0}} = spot} =
               Exchange.buckets(:binance_spot, share: 0.8)

      assert spot["orders_10s"] == %{capacity: 8.0, refill_per_sec: 7.2}
      assert {:ok, %{"ip" => %{capacity: 192.0}}} = Exchange.buckets(:binance_usdm)

      assert {:ok, %{"private" => starter}} = Exchange.buckets(:kraken_spot)
      assert_in_delta starter.capacity, 12.0, 1.0e-9
      assert_in_delta starter.refill_per_sec, 0.264, 1.0e-9

      assert {:ok, %{"private" => %{capacity: 16.0, refill_per_sec: 0.8}}} =
               Exchange.buckets(:kraken_spot, tier: :pro, share: 0.8)

      assert profile!(:kraken_spot).counters |> hd() |> Map.fetch!(:costs) |> Map.get("Ledgers") ==
               2

      assert {:ok, %{"ip" => %{capacity: 48.0, refill_per_sec: 86.4}}} =
               Exchange.buckets(:bybit_v5)
    end

    test "a profile is data: override a counter, or add one, and size the map" do
      profile = profile!(:binance_spot)
      [ip | rest] = profile.counters
      mine = %{profile | counters: [%{ip | limit: 1200} | rest]}
      assert {:ok, %{"ip" => %{capacity: 96.0, refill_per_sec: 14.4}}} = Exchange.buckets(mine)

      extra = %{
        axis: "sapi",
        scope: :ip,
        kind: :rolling,
        limit: 100,
        window_ms: 1000,
        source: %{}
      }

      assert {:ok, %{"sapi" => _}} = Exchange.buckets(%{profile | counters: [extra]})
    end

    test "bad names, options and counters are invalid_parameters" do
      for {arg, opts} <- [
            {:nope, []},
            {:kraken_spot, [tier: :gold]},
            {:binance_spot, [tier: :pro]},
            {:binance_spot, [share: 0]},
            {:kraken_spot, [share: 2]},
            # Refused on every profile, whatever its counters use.
            {:binance_spot, [burst: 2]},
            {:kraken_spot, [burst: 2]},
            {%{counters: [%{axis: "x", kind: :decaying, max: 1, decay_per_sec: 1}]}, [burst: 0]},
            {%{counters: [%{axis: "x", kind: :fixed}]}, []},
            {%{counters: [%{axis: "x", kind: :decaying, max: -1, decay_per_sec: 1}]}, []},
            {"binance", []},
            {:binance_spot, [shar: 0.5]},
            {:binance_spot, %{share: 0.5}}
          ] do
        assert {:error, %Error{type: :invalid_parameters, message: "" <> _}} =
                 Exchange.buckets(arg, opts),
               inspect({arg, opts})
      end

      for opts <- [:x, [tir: :pro], [share: 0.5]] do
        assert {:error, %Error{type: :invalid_parameters, message: "" <> _}} =
                 Exchange.profile(:kraken_spot, opts),
               inspect(opts)
      end

      assert {:error, %Error{message: "unknown profile option :tier; expected [] for :okx"}} =
               Exchange.profile(:okx, tier: :pro)
    end

    test "put_header_limits refuses what is not a profile, never raising" do
      {:ok, profile} = Exchange.profile(:binance_usdm)

      for {given, opts} <- [
            {"binance", []},
            {%{exchange_id: "x", counters: :x}, []},
            {%{counters: []}, []},
            {profile, share: 0.5},
            {:binance_usdm, :x},
            {:no_such_profile, []}
          ] do
        assert {:error, %Error{type: :invalid_parameters}} =
                 Exchange.put_header_limits(given, opts),
               inspect({given, opts})
      end
    end

    test "a profile's limits bound header sync for its exchange id, with nothing set" do
      name = :"exchange_#{System.unique_integer([:positive])}"
      start_supervised!({RateLimiter, name: name})
      # A profile's options go to the profile.
      assert :ok = Exchange.put_header_limits(:kraken_spot, tier: :pro)

      key = {"binance_usdm", "k-#{name}", "ip"}
      Bourse.Window.clear_of_edges(60_000)
      assert :ok = RateLimiter.check_rate(key, %{requests: 2400, period: 60_000}, 0, name)

      assert :ok =
               RateLimiter.observe_response(
                 "binance_usdm",
                 elem(key, 1),
                 200,
                 [
                   {"x-mbx-used-weight-1m", "2300"}
                 ],
                 name
               )

      left = Bourse.Window.left(60_000)
      tokens = RateLimiter.inspect_key(key, name).tokens
      assert_in_delta tokens, min(2400, 100 - 40 * left / 1000), 10
    end
  end

  describe "each profile against a mock exchange counting like it" do
    @describetag timeout: 120_000

    # Every counter of every profile, scaled to a second or so: the mock counts as the
    # counter does (fixed or rolling window, decaying counter with Kraken's costs of 2),
    # four clients drive the profile's bucket flat out; none may be refused.
    test "no request is refused" do
      name = :"exchange_mock_#{System.unique_integer([:positive])}"
      start_supervised!({RateLimiter, name: name})

      runs =
        for profile_name <- Exchange.profiles(),
            profile = profile!(profile_name),
            counter <- profile.counters,
            do: {profile, scale(counter)}

      runs
      |> Task.async_stream(&drive(&1, name), max_concurrency: 6, timeout: 60_000)
      |> Enum.each(fn {:ok, {label, stats}} ->
        assert stats.rejected == 0, "#{label}: #{inspect(stats)}"
        assert stats.accepted >= 24, "#{label}: #{inspect(stats)}"
      end)
    end
  end

  # The counter's kind with small numbers: 20 per second, or a counter of 10 decaying 20
  # a second.
  defp scale(%{kind: :decaying} = counter), do: %{counter | max: 10, decay_per_sec: 20}
  defp scale(counter), do: %{counter | limit: 20, window_ms: 1_000}

  defp drive({profile, counter}, name) do
    {:ok, mock} =
      case counter.kind do
        :fixed ->
          MockExchange.start(limit: counter.limit, window_ms: counter.window_ms)

        :rolling ->
          MockExchange.start(
            mode: :rolling_window,
            limit: counter.limit,
            window_ms: counter.window_ms
          )

        :decaying ->
          MockExchange.start(
            mode: :decaying,
            max: counter.max,
            decay_per_sec: counter.decay_per_sec,
            client: :api_key,
            reject: :kraken,
            costs: %{"/0/private/Ledgers" => 2}
          )
      end

    axis = counter.axis
    {:ok, %{^axis => bucket}} = Exchange.buckets(%{profile | counters: [counter]})
    label = "#{profile.name} #{counter.axis}"
    key = {profile.exchange_id, label, counter.axis}

    1..4
    |> Enum.map(fn client ->
      Task.async(fn ->
        for i <- 1..8 do
          # Every third request of the decaying counters is a ledger call, costing 2.
          {path, cost} =
            if counter.kind == :decaying and rem(i + client, 3) == 0,
              do: {"/0/private/Ledgers", 2},
              else: {"/ping", 1}

          :ok = RateLimiter.wait_for_capacity(key, bucket, cost, name)
          {:ok, _status, _, _} = HTTP.get(mock.url <> path, [{"x-api-key", label}])
        end
      end)
    end)
    |> Task.await_many(60_000)

    stats = MockExchange.stats(mock)
    MockExchange.stop(mock)
    {label, stats}
  end
end
