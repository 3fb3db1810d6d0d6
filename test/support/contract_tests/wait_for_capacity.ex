defmodule Bourse.ContractTests.WaitForCapacity do
  @moduledoc false
  # docs/CONTRACT.md §3-4: `wait_for_capacity`: book, sleep in the caller, claim; budgets; P2.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "wait_for_capacity" do
        test "admits at once when the bucket holds the cost, and pays", %{name: name} do
          {ms, answer} = timed(fn -> wait_for_capacity({"ex", "k"}, @still, 3, name) end)
          assert answer == :ok
          # A wait would be 1000 s (@still): anything short of that is "at once".
          assert ms < 5_000
          assert_about(get_cost({"ex", "k"}, 1, name), 3, 0.01)
          assert :ok = wait_for_capacity({"ex", "k"}, @still, 3, name, max_wait_ms: 1)
          assert_about(get_cost({"ex", "k"}, 1, name), 6, 0.01)
        end

        test "blocks the caller until admitted, then :ok, charged once", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 2}
          key = {"ex", "k"}
          drained_at = System.monotonic_time(:microsecond)
          drain(key, limit, 1, name)

          # A token accrues in 500 ms: never admitted earlier (delays are rounded up).
          assert :ok = wait_for_capacity(key, limit, 1, name)
          waited = (System.monotonic_time(:microsecond) - drained_at) / 1000
          assert waited >= 499 and waited < 5_000, "admitted after #{waited} ms"
          # Charged once: the booking paid, the claim did not pay again.
          assert get_cost(key, 1, name) <= 1.01

          assert :ok = wait_for_capacity(key, limit, 1, name, max_wait_ms: 2_000)
          waited = (System.monotonic_time(:microsecond) - drained_at) / 1000
          assert waited >= 999, "two tokens admitted after #{waited} ms"
        end

        @tag limiter_opts: [booking_slack_ms: 0]
        test "a waiter that wakes after its booking lapsed books again only within its budget",
             %{name: name} do
          # With no slack a booking lapses at its ready time, before its waiter (which sleeps
          # whole milliseconds, rounded up) can claim it: each pass pays and books again.
          limit = %{capacity: 1, refill_per_sec: 10}
          key = {"ex", "k"}
          drain(key, limit, 1, name)
          waiter = Task.async(fn -> wait_for_capacity(key, limit, 1, name, max_wait_ms: 500) end)

          case Task.yield(waiter, 5_000) || Task.shutdown(waiter, :brutal_kill) do
            {:ok, :ok} ->
              :ok

            {:ok, answer} ->
              assert {:error, %Bourse.Error{type: :rate_limit_exceeded, message: message}} =
                       answer

              assert message =~ ~r/max_wait_ms 500(, already waited)?$/

            nil ->
              flunk("wait_for_capacity with max_wait_ms: 500 still waited after 5 s")
          end

          # A token every 2 ms: each pass wakes within a millisecond or two of its ready
          # time, which a budget left of 1 ms would still cover; spent, it only probes.
          fast = %{capacity: 1, refill_per_sec: 500}

          for n <- 1..5 do
            key = {"ex", "fast-#{n}"}
            drain(key, fast, 1, name)
            {ms, _answer} = timed(fn -> wait_for_capacity(key, fast, 1, name, max_wait_ms: 5) end)
            assert ms < 500, "wait_for_capacity with max_wait_ms: 5 took #{ms} ms"
          end
        end

        test "over max_wait_ms: rate_limit_exceeded at once, with retry_after, paying nothing",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"ex", "k"}
          drain(key, limit, 1, name)
          before = get_cost(key, 1, name)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: retry}} =
                   wait_for_capacity(key, limit, 1, name, max_wait_ms: 100)

          # More than the budget: a token in at most 1000 ms.
          assert retry in 101..1_000
          assert get_cost(key, 1, name) <= before + 0.01
          assert_delay(check_rate(key, limit, 1, name), 1..retry)

          # At once: not after sleeping part of the 5391 ms.
          okx = %{capacity: 1, refill_per_sec: 9.09}

          {ms, answer} =
            timed(fn -> wait_for_capacity({"okx", "k"}, okx, 50, name, max_wait_ms: 5_000) end)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: 5391}} = answer
          assert ms < 4_000, "took #{ms} ms to refuse"
          assert get_cost({"okx", "k"}, 1, name) == 0
          assert :ok = check_rate({"okx", "k"}, okx, 1, name)
        end

        test "max_wait_ms must be a positive integer", %{name: name} do
          key = {"ex", "k"}

          for bad <- [0, -1, 1.5, :x, "100", nil, 10.0] do
            assert_invalid(wait_for_capacity(key, @still, 1, name, max_wait_ms: bad))
          end

          for bad <- [0, -1, 1.5, :x, "100", 10.0] do
            assert_invalid(check_rates([{key, @still, 1}], name, max_wait_ms: bad))
          end

          assert get_cost(key, 1, name) == 0
        end

        test "waiters are not starved by cheaper traffic (P2)", %{name: name} do
          limit = %{capacity: 10, refill_per_sec: 20}
          key = {"ex", "k"}
          stop = :atomics.new(1, [])

          hammers =
            for _ <- 1..8 do
              Task.async(fn -> hammer(key, limit, name, fn -> :atomics.get(stop, 1) == 1 end) end)
            end

          Process.sleep(50)
          # Cost 8 needs 400 ms of refill; without bookings, the cost-1 loop would take
          # every token as it accrues.
          {ms, answer} =
            timed(fn -> wait_for_capacity(key, limit, 8, name, max_wait_ms: 5_000) end)

          :atomics.put(stop, 1, 1)
          Task.await_many(hammers, 10_000)

          assert answer == :ok
          # Starved, it would be refused past its 5 s budget.
          assert ms < 4_000, "the cost-8 waiter waited #{ms} ms (about 400 expected)"
        end
      end
    end
  end
end
