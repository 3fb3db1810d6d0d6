defmodule Bourse.ContractTests.Bucket do
  @moduledoc false
  # docs/CONTRACT.md §2: one bucket: full at start, rounding, over-capacity costs, changed definitions.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "the bucket" do
        test "a new key's bucket starts full", %{name: name} do
          limit = %{@still | capacity: 5}
          assert get_cost({"ex", "k"}, 1, name) == 0
          drain({"ex", "k"}, limit, 5, name)
          assert_delay(check_rate({"ex", "k"}, limit, 1, name), 990_000..@one_token_ms)
          assert_about(get_cost({"ex", "k"}, 1, name), 5, 0.01)

          # Fractional costs too.
          drain({"ex", "f"}, limit, 4, name, 1.25)
          assert {:delay, _} = check_rate({"ex", "f"}, limit, 0.01, name)
        end

        test "delays are whole milliseconds, rounded up, never below 1", %{name: name} do
          # Keys seen for the first time: exactly (cost - capacity) / refill_per_sec.
          assert {:delay, 334} =
                   check_rate({"r", "1"}, %{capacity: 1, refill_per_sec: 3}, 2, name)

          assert {:delay, 500} =
                   check_rate({"r", "2"}, %{capacity: 1, refill_per_sec: 2}, 2, name)

          assert {:delay, 1} =
                   check_rate({"r", "3"}, %{capacity: 1, refill_per_sec: 1.0e6}, 1.5, name)

          assert {:delay, 1} =
                   check_rate({"r", "4"}, %{capacity: 4, refill_per_sec: 1000}, 4.000001, name)

          assert {:delay, 1_000_001} =
                   check_rate({"r", "5"}, %{capacity: 1, refill_per_sec: 0.001}, 2.000001, name)
        end

        test "tiny limits and costs admit no more than the bound (P1)", %{name: name} do
          # Any positive number is a valid capacity, refill and cost; float noise is
          # forgiven relative to the cost, not as a fixed amount.
          for tiny <- [1.0e-9, 1.0e-12] do
            limit = %{capacity: tiny, refill_per_sec: tiny}
            assert :ok = check_rate({"tiny", "#{tiny}"}, limit, tiny, name)
            answers = for _ <- 1..20, do: check_rate({"tiny", "#{tiny}"}, limit, tiny, name)
            assert Enum.all?(answers, &match?({:delay, _}, &1)), inspect(answers)
          end

          # A drained bucket refilling 1e-9 per second accrues one cost of 1e-12 a ms.
          limit = %{capacity: 10, refill_per_sec: 1.0e-9}

          {elapsed_us, answers} =
            :timer.tc(fn ->
              assert :ok = check_rate({"tiny", "drained"}, limit, 10, name)
              for _ <- 1..50, do: check_rate({"tiny", "drained"}, limit, 1.0e-12, name)
            end)

          assert Enum.count(answers, &(&1 == :ok)) <= div(elapsed_us, 1_000) + 1, inspect(answers)
        end

        test "an over-capacity cost is limited, not exempt (okx: capacity 1, 9.09/s, cost 50)",
             %{name: name} do
          okx = %{capacity: 1, refill_per_sec: 9.09}
          key = {"okx", "k", "request"}

          # 49 tokens to accrue at 9.09/s: 5390.5 ms, rounded up. Nothing paid.
          assert {:delay, 5391} = check_rate(key, okx, 50, name)
          assert get_cost(key, 1, name) == 0

          # The refused probe started the accrual: coming back later, the wait is shorter.
          Process.sleep(100)
          assert_delay(check_rate(key, okx, 50, name), 1..5_300)
          assert get_cost(key, 1, name) == 0

          # Cheap traffic is not blocked by a refused heavy probe.
          assert :ok = check_rate(key, okx, 1, name)
        end

        test "an over-capacity cost is admitted once accrued, and empties the bucket",
             %{name: name} do
          limit = %{capacity: 2, refill_per_sec: 2}
          key = {"ex", "k"}

          assert {:delay, 500} = check_rate(key, limit, 3, name)
          Process.sleep(550)
          paid_at = System.monotonic_time(:millisecond)
          assert :ok = check_rate(key, limit, 3, name)

          # Paying left the bucket at zero: at most the capacity is borrowed, not the cost,
          # less what refilled since (2 a second: a loaded machine may be slow).
          borrowed = get_cost(key, 1, name)
          elapsed = System.monotonic_time(:millisecond) - paid_at

          assert borrowed <= 2.0 and borrowed >= 2.0 - 2 * elapsed / 1000 - 0.01,
                 "borrowed #{borrowed} #{elapsed} ms after paying"

          if elapsed < 900, do: assert_delay(check_rate(key, limit, 2, name), 1..1_000)
        end

        @tag limiter_opts: [sweep_interval_ms: 10]
        test "an over-capacity probe back a little late after its delay, swept meanwhile, finds its accrual",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 10}
          key = {"ex", "late"}

          # Full after 100 ms; told 300 ms, back 20 ms late while sweeps run every 10 ms.
          assert {:delay, 300} = check_rate(key, limit, 4, name)
          Process.sleep(320)
          assert :ok = check_rate(key, limit, 4, name)
        end

        @tag limiter_opts: [sweep_interval_ms: 10]
        test "an over-capacity probe finds its accrual whatever shorter waits others are told meanwhile",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 2}
          key = {"ex", "told"}

          # Empty, then told 2 s for a cost of 4; a cheap probe 100 ms on is told 400 ms (less
          # when a loaded machine wakes it late).
          emptied_at = System.monotonic_time(:millisecond)
          assert :ok = check_rate(key, limit, 1, name)
          assert {:delay, heavy} = check_rate(key, limit, 4, name)
          told = System.monotonic_time(:millisecond)
          assert heavy in 1_500..2_000
          Process.sleep(100)
          cheap = check_rate(key, limit, 1, name)

          # Unless a loaded machine took so long that a token refilled meanwhile (500 ms).
          if System.monotonic_time(:millisecond) - emptied_at < 500 do
            assert {:delay, cheap} = cheap
            assert cheap in 1..400
            # Back 20 ms late: past the cheap probe's wait and fill time by more than 1 s.
            Process.sleep(max(told + heavy + 20 - System.monotonic_time(:millisecond), 0))
            assert :ok = check_rate(key, limit, 4, name)
          end
        end

        test "cheap traffic never sees more than the capacity", %{name: name} do
          limit = %{capacity: 2, refill_per_sec: 4}
          key = {"ex", "k"}

          # A heavy probe starts an accrual of 4 ...
          assert {:delay, 500} = check_rate(key, limit, 4, name)
          Process.sleep(600)
          # ... but a cheap request finds only the capacity, and spends all of it.
          emptied_at = System.monotonic_time(:millisecond)
          assert :ok = check_rate(key, limit, 2, name)
          cheap = check_rate(key, limit, 2, name)
          heavy = check_rate(key, limit, 4, name)

          # Unless a loaded machine took so long that the bucket refilled in between.
          if System.monotonic_time(:millisecond) - emptied_at < 400 do
            assert_delay(cheap, 1..500)
            assert_delay(heavy, 501..1_000)
          end
        end

        test "binance: %{requests: 1200, period: 60_000} admits 300 of cost 4, then delays",
             %{name: name} do
          limit = %{requests: 1200, period: 60_000}
          key = {"binance", "api-key", "request"}

          {ms, answers} =
            timed(fn ->
              answers = for _ <- 1..300, do: check_rate(key, limit, 4, name)
              [check_rate(key, limit, 4, name) | answers]
            end)

          [next | first_300] = answers
          assert Enum.all?(first_300, &(&1 == :ok))

          # Refill is 20/s: a fifth cost-4 request accrues in 200 ms.
          if ms < 150, do: assert_delay(next, 1..200)
        end

        test "a key whose definition changes takes it only when admitted", %{name: name} do
          big = %{capacity: 10, refill_per_sec: 0.001}
          small = %{capacity: 3, refill_per_sec: 0.001}

          # Refused under a new definition: the old one stays.
          assert :ok = check_rate({"ex", "a"}, big, 8, name)
          assert {:delay, _} = check_rate({"ex", "a"}, small, 3, name)
          assert_about(get_cost({"ex", "a"}, 1, name), 8, 0.01)
          assert :ok = check_rate({"ex", "a"}, big, 2, name)

          # Admitted under a new definition: tokens are clamped to the new capacity.
          assert :ok = check_rate({"ex", "b"}, big, 2, name)
          assert :ok = check_rate({"ex", "b"}, small, 1, name)
          assert_about(get_cost({"ex", "b"}, 1, name), 1, 0.01)
          assert {:delay, _} = check_rate({"ex", "b"}, big, 3, name)
          assert :ok = check_rate({"ex", "b"}, big, 2, name)
          assert_about(get_cost({"ex", "b"}, 1, name), 10, 0.01)
        end

        test "a refused probe keeps no old definition for another: it finds the key as new (P3)",
             %{name: name} do
          small = %{capacity: 4, refill_per_sec: 10}
          big = %{capacity: 100, refill_per_sec: 10}
          assert :ok = check_rate({"ex", "refused"}, small, 4, name)
          assert :ok = check_rate({"ex", "quiet"}, small, 4, name)
          # Told about 4 s on one key only, which keeps it (P7); both are full after 400 ms.
          assert {:delay, _} = check_rate({"ex", "refused"}, small, 40, name)
          Process.sleep(600)
          # Under a new definition each starts as a new key: full.
          assert :ok = check_rate({"ex", "refused"}, big, 100, name)
          assert :ok = check_rate({"ex", "quiet"}, big, 100, name)
        end

        test "a refused call gives a new key no definition: a later one finds it as new",
             %{name: name} do
          tight = %{capacity: 1, refill_per_sec: 0.001}
          roomy = %{capacity: 100, refill_per_sec: 100}

          # A probe, a waiter over its budget, a check refused by its other bucket.
          assert {:delay, _} = check_rate({"ex", "probe"}, tight, 2, name)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded}} =
                   wait_for_capacity({"ex", "waiter"}, tight, 2, name, max_wait_ms: 10)

          assert :ok = check_rate({"ex", "ip"}, tight, 1, name)

          assert {:delay, _} =
                   check_rates([{{"ex", "multi"}, tight, 1}, {{"ex", "ip"}, tight, 1}], name)

          for credential <- ["probe", "waiter", "multi"] do
            assert get_cost({"ex", credential}, 1, name) == 0, credential
            since = System.monotonic_time(:millisecond)
            assert :ok = check_rate({"ex", credential}, roomy, 50, name), credential
            # 50 paid, less what refilled since (100/s).
            borrowed = get_cost({"ex", credential}, 1, name)
            refilled = (System.monotonic_time(:millisecond) - since + 1) / 10
            assert borrowed <= 50.01 and borrowed >= 50 - refilled - 0.01, "#{borrowed}"
          end
        end

        @tag limiter_opts: [sweep_interval_ms: 10]
        test "a debit on a key without a definition keeps a refused caller's accrual",
             %{name: name} do
          # Told 2 s: longer than a key without debt is kept unless a refusal asks.
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"ex", "debited"}
          assert {:delay, 2_000} = check_rate(key, limit, 3, name)
          # No debt reads 0, not -0.0.
          assert inspect(get_cost(key, 1, name)) in ["0", "0.0"]
          assert :ok = record_request(key, 0, name)
          # Back 20 ms late while sweeps run every 10 ms.
          Process.sleep(2_020)
          assert :ok = check_rate(key, limit, 3, name)
        end

        @tag limiter_opts: [sweep_interval_ms: 10]
        test "keys without a definition or debt are dropped (P7)", %{name: name} do
          before = stats(name).buckets
          for i <- 1..50, do: :ok = record_request({"ex", "k#{i}"}, 0, name)
          # Told 100 ms: kept for that caller that long, and 1 s more.
          assert {:delay, 100} =
                   check_rate({"ex", "refused"}, %{capacity: 1, refill_per_sec: 10}, 2, name)

          eventually(fn -> stats(name).buckets == before end, 10_000)
          assert get_cost({"ex", "refused"}, 1, name) == 0
        end
      end
    end
  end
end
