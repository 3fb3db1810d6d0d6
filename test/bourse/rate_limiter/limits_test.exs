defmodule Bourse.RateLimiter.LimitsTest do
  use ExUnit.Case, async: true

  alias Bourse.Error
  alias Bourse.RateLimiter.Limits

  # The field report's exchangeInfo (docs/CONTRACT.md, Sources); RAW_REQUESTS is 300000 per 5 minutes.
  @exchange_info %{
    "timezone" => "UTC",
    "rateLimits" => [
      %{
        "rateLimitType" => "REQUEST_WEIGHT",
        "interval" => "MINUTE",
        "intervalNum" => 1,
        "limit" => 6000
      },
      %{"rateLimitType" => "ORDERS", "interval" => "SECOND", "intervalNum" => 10, "limit" => 100},
      %{"rateLimitType" => "ORDERS", "interval" => "DAY", "intervalNum" => 1, "limit" => 200_000},
      %{
        "rateLimitType" => "RAW_REQUESTS",
        "interval" => "MINUTE",
        "intervalNum" => 5,
        "limit" => 300_000
      }
    ]
  }

  describe "size/3" do
    test "Fincode's field report's sizing: 20% kept back, a 10% burst" do
      assert Limits.size(6000, 60_000) == {:ok, %{capacity: 480.0, refill_per_sec: 72.0}}
      assert Limits.size(100, 10_000) == {:ok, %{capacity: 8.0, refill_per_sec: 7.2}}
      assert Limits.size(600, 5_000) == {:ok, %{capacity: 48.0, refill_per_sec: 86.4}}
    end

    test ":share and :burst" do
      assert Limits.size(10, 1_000, share: 1.0, burst: 0.2) ==
               {:ok, %{capacity: 2.0, refill_per_sec: 8.0}}

      assert Limits.size(10, 1_000, share: 1, burst: 0.5) ==
               {:ok, %{capacity: 5.0, refill_per_sec: 5.0}}
    end

    test "capacity + refill * window never exceeds share * limit" do
      for _ <- 1..5_000 do
        limit = Enum.random([:rand.uniform(1_000_000), :rand.uniform() * 1000 + 0.001])
        window_ms = Enum.random([:rand.uniform(86_400_000), :rand.uniform() * 100_000 + 1])
        share = 1 - :rand.uniform() * 0.999
        burst = :rand.uniform() * 0.999

        assert {:ok, %{capacity: c, refill_per_sec: r}} =
                 Limits.size(limit, window_ms, share: share, burst: burst)

        assert c > 0 and r > 0

        assert c + r * (window_ms / 1000) <= share * limit,
               inspect({limit, window_ms, share, burst})
      end
    end

    test "bad input is :invalid_parameters, naming what is wrong" do
      for {args, word} <- [
            {[0, 1000], "limit"},
            {[-5, 1000], "limit"},
            {["6000", 1000], "limit"},
            {[nil, 1000], "limit"},
            {[1.0e300, 1000], "limit"},
            {[10, 0], "window_ms"},
            {[10, 0.5], "window_ms"},
            {[10, :minute], "window_ms"},
            {[10, 1000, [share: 0]], "share"},
            {[10, 1000, [share: 1.5]], "share"},
            {[10, 1000, [burst: 1]], "burst"},
            {[10, 1000, [burst: 0]], "burst"},
            {[10, 1000, [burst: "0.1"]], "burst"},
            {[10, 1000, [shar: 0.5]], ":shar"},
            {[10, 1000, :x], "keyword list"},
            {[10, 1000, [share: 0.5, share: 0.6]], "more than once"}
          ] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 apply(Limits, :size, args)

        assert message =~ word
      end
    end

    test "every bucket it sizes is one a check takes; past the core's bounds, an error" do
      {:ok, _} = start_supervised({Bourse.RateLimiter, name: :limits_test})
      key = {"binance", :public, "weight"}

      for {limit, window_ms} <- [{1.0e12, 60_000}, {1.0e12, 1}, {1.0e15, 1000}, {2.0e12, 60_000}] do
        case Limits.size(limit, window_ms) do
          {:ok, bucket} ->
            assert Bourse.RateLimiter.check_rate(key, bucket, 1, :limits_test) == :ok

          {:error, %Error{type: :invalid_parameters, message: message}} ->
            assert message =~ "1.0e12"
        end
      end

      assert {:ok, _} = Limits.size(1.0e12, 60_000)
      assert {:error, %Error{message: "limit must be" <> _}} = Limits.size(2.0e12, 60_000)

      assert {:error, %Error{message: "limit too large for its window" <> message}} =
               Limits.size(1.0e12, 1)

      assert message =~ "refill_per_sec"
    end

    test "a limit too small to size is refused, not rounded to zero" do
      assert {:error, %Error{type: :invalid_parameters}} =
               Limits.size(5.0e-324, 1000, burst: 1.0e-10)
    end
  end

  describe "from_binance_exchange_info/2" do
    test "one bucket per entry, as Fincode's field report prints them" do
      assert {:ok, buckets} = Limits.from_binance_exchange_info(@exchange_info)

      assert Map.keys(buckets) |> Enum.sort() == [
               {"ORDERS", 1, "DAY"},
               {"ORDERS", 10, "SECOND"},
               {"RAW_REQUESTS", 5, "MINUTE"},
               {"REQUEST_WEIGHT", 1, "MINUTE"}
             ]

      assert buckets[{"REQUEST_WEIGHT", 1, "MINUTE"}] == %{capacity: 480.0, refill_per_sec: 72.0}
      assert buckets[{"ORDERS", 10, "SECOND"}] == %{capacity: 8.0, refill_per_sec: 7.2}

      assert buckets[{"RAW_REQUESTS", 5, "MINUTE"}] == %{
               capacity: 24_000.0,
               refill_per_sec: 720.0
             }

      assert %{capacity: 16_000.0, refill_per_sec: daily} = buckets[{"ORDERS", 1, "DAY"}]
      assert_in_delta daily, 5 / 3, 1.0e-12
      assert 16_000.0 + daily * 86_400 <= 160_000
    end

    test "a limit past the core's bound is refused alike with and without exchange:" do
      info = %{
        "rateLimits" => [
          %{
            "rateLimitType" => "REQUEST_WEIGHT",
            "interval" => "MINUTE",
            "intervalNum" => 1,
            "limit" => 2.0e12
          }
        ]
      }

      assert {:error, %Error{type: :invalid_parameters, message: message}} =
               Limits.from_binance_exchange_info(info)

      assert message =~ "bad limit"

      assert {:error, %Error{message: ^message}} =
               Limits.from_binance_exchange_info(info, exchange: "limits-bound-test")
    end

    test "options reach the sizing" do
      assert {:ok, %{{"REQUEST_WEIGHT", 1, "MINUTE"} => %{capacity: 600.0, refill_per_sec: 90.0}}} =
               Limits.from_binance_exchange_info(@exchange_info, share: 1.0)
    end

    test "unknown options and options not in a keyword list are refused, naming them" do
      for {opts, word} <- [{[bogus: 1], ":bogus"}, {:x, "keyword list"}] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 Limits.from_binance_exchange_info(@exchange_info, opts)

        assert message =~ word
      end
    end

    test "exchange: the entries' limits bound that exchange's used-weight headers" do
      name = :"limits_#{System.unique_integer([:positive])}"
      start_supervised!({Bourse.RateLimiter, name: name})
      exchange = "binance_#{System.unique_integer([:positive])}"

      info = %{
        "rateLimits" => [
          entry(%{
            "rateLimitType" => "REQUEST_WEIGHT",
            "interval" => "MINUTE",
            "intervalNum" => 1,
            "limit" => 1200
          }),
          entry(%{"intervalNum" => 10, "limit" => 50})
        ]
      }

      assert {:ok, %{}} = Limits.from_binance_exchange_info(info, exchange: exchange)

      # Buckets sized at the limits themselves, so that only the exchange's limit bounds them.
      for {axis, limit, header, used, window_ms} <- [
            {"ip", %{requests: 1200, period: 60_000}, "x-mbx-used-weight-1m", 1100, 60_000},
            {"orders_10s", %{requests: 50, period: 10_000}, "x-mbx-order-count-10s", 40, 10_000}
          ] do
        key = {exchange, "k", axis}
        Bourse.Window.clear_of_edges(window_ms)
        assert :ok = Bourse.RateLimiter.check_rate(key, limit, 0, name)

        assert :ok =
                 Bourse.RateLimiter.observe_response(
                   exchange,
                   "k",
                   200,
                   [{header, "#{used}"}],
                   name
                 )

        left = Bourse.Window.left(window_ms)
        rate = limit.requests / (window_ms / 1000)
        expected = min(limit.requests, limit.requests - used - rate * left / 1000)
        tokens = Bourse.RateLimiter.inspect_key(key, name).tokens
        assert_in_delta tokens, expected, rate * 0.2, axis
      end
    end

    test "exchange: must be an exchange id" do
      assert {:error, %Error{type: :invalid_parameters, message: message}} =
               Limits.from_binance_exchange_info(@exchange_info, exchange: :binance)

      assert message =~ "exchange"
    end

    test "atom keys are accepted" do
      info = %{
        rateLimits: [%{rateLimitType: "ORDERS", interval: "SECOND", intervalNum: 10, limit: 100}]
      }

      assert Limits.from_binance_exchange_info(info) ==
               {:ok, %{{"ORDERS", 10, "SECOND"} => %{capacity: 8.0, refill_per_sec: 7.2}}}
    end

    test "HOUR intervals" do
      info = %{
        "rateLimits" => [entry(%{"interval" => "HOUR", "intervalNum" => 1, "limit" => 36_000})]
      }

      assert {:ok, %{{"ORDERS", 1, "HOUR"} => %{capacity: 2880.0, refill_per_sec: 7.2}}} =
               Limits.from_binance_exchange_info(info)
    end

    test "missing or empty rateLimits" do
      for info <- [%{}, %{"rateLimits" => []}, %{"rateLimits" => nil}, %{"rateLimits" => %{}}] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 Limits.from_binance_exchange_info(info)

        assert message =~ "rateLimits"
      end

      assert {:error, %Error{type: :invalid_parameters}} = Limits.from_binance_exchange_info([])
    end

    test "a duplicate entry" do
      info = %{"rateLimits" => [entry(%{}), entry(%{"limit" => 50})]}

      assert {:error, %Error{type: :invalid_parameters, message: message}} =
               Limits.from_binance_exchange_info(info)

      assert message =~ ~s(duplicate rateLimits entry {"ORDERS", 10, "SECOND"})
    end

    test "malformed entries" do
      for {entry, field} <- [
            {Map.delete(entry(%{}), "limit"), "limit"},
            {entry(%{"limit" => 0}), "limit"},
            {entry(%{"limit" => "100"}), "limit"},
            {entry(%{"intervalNum" => 0}), "intervalNum"},
            {entry(%{"intervalNum" => 1.5}), "intervalNum"},
            {entry(%{"interval" => "WEEK"}), "interval"},
            {entry(%{"interval" => :second}), "interval"},
            {Map.delete(entry(%{}), "rateLimitType"), "rateLimitType"},
            {entry(%{"rateLimitType" => ""}), "rateLimitType"}
          ] do
        info = %{"rateLimits" => [entry(%{"rateLimitType" => "RAW_REQUESTS"}), entry]}

        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 Limits.from_binance_exchange_info(info)

        assert message =~ "rateLimits entry 1 has a missing or bad #{field}"
      end

      for rate_limits <- [["ORDERS"], [entry(%{}) | :improper]] do
        assert {:error, %Error{type: :invalid_parameters}} =
                 Limits.from_binance_exchange_info(%{"rateLimits" => rate_limits})
      end
    end
  end

  defp entry(overrides) do
    Map.merge(
      %{"rateLimitType" => "ORDERS", "interval" => "SECOND", "intervalNum" => 10, "limit" => 100},
      overrides
    )
  end
end
