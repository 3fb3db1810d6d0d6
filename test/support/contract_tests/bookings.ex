defmodule Bourse.ContractTests.Bookings do
  @moduledoc false
  # docs/CONTRACT.md §4: waiters book, queue, claim, come back early, lapse.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "bookings" do
        @describetag limiter_opts: [booking_slack_ms: 5_000]

        # A token every 2 s: each step may come up to a second after the one before it (a
        # loaded machine) and still find the queue it expects. Nothing here waits for it.
        test "a waiter books at once: later callers queue behind it", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 0.5}
          key = {"ex", "k"}
          drain(key, limit, 1, name)

          booked =
            assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 5_000), 1..2_000)

          # The booked token is already taken: about 2 borrowed, more than the capacity.
          assert get_cost(key, 1, name) > 1.2

          # A probe now waits for the booking and then for its own token. (From another
          # process: the same process asking the same check again is claiming its booking.)
          probe =
            Task.async(fn -> check_rate(key, limit, 1, name) end)
            |> Task.await()
            |> assert_delay(1..4_000)

          assert probe >= booked + 1_000, "probe #{probe} ms did not queue behind #{booked} ms"

          # Another waiter books behind the first one.
          other =
            Task.async(fn -> check_rates([{key, limit, 1}], name, max_wait_ms: 5_000) end)
            |> Task.await()
            |> assert_delay(1..4_000)

          assert other >= booked + 1_000, "waiter #{other} ms did not queue behind #{booked} ms"
          assert get_cost(key, 1, name) > 2.2
        end

        # A used-weight reading allows `allowance` more in the exchange's window: the
        # bookings due before it ends are paid here but not yet sent (not in the
        # exchange's count), so they take their part of it. Left out, waiters and new
        # callers together sent the bookings past the allowance (a 429).
        test "sync leaves room for the bookings due before the window ends", %{name: name} do
          limit = %{capacity: 10, refill_per_sec: 1}
          key = {"ex", "k"}
          drain(key, limit, 8, name)
          # 2 left, 3 booked: due in about a second.
          assert_delay(check_rates([{key, limit, 3}], name, max_wait_ms: 60_000), 900..1_000)
          # A window of 500 ms ends before it: only the allowance (0) less its refill.
          assert Bourse.RateLimiter.sync(key, 0, 500, name) < 0.05
          # Within 2 s: the refill (2) and the booking (3) take an allowance of 3, and 2 more:
          # the tokens go to -2.
          tokens = limit.capacity - get_cost(key, 1, name)
          assert_in_delta Bourse.RateLimiter.sync(key, 3, 2_000, name), tokens + 2, 0.05
        end

        test "sync holds the bookings the allowance cannot cover until the window ends",
             %{name: name} do
          limit = %{capacity: 10, refill_per_sec: 1}
          key = {"ex", "k"}
          drain(key, limit, 8, name)
          booked = System.monotonic_time(:millisecond)
          assert_delay(check_rates([{key, limit, 3}], name, max_wait_ms: 60_000), 900..1_000)
          # Nothing more in the window's next 1.5 s: the booking goes out after it.
          Bourse.RateLimiter.sync(key, 0, 1_500, name)
          Process.sleep(max(booked + 1_000 - System.monotonic_time(:millisecond), 0))
          ms = assert_delay(check_rates([{key, limit, 3}], name, max_wait_ms: 60_000), 1..600)
          Process.sleep(ms)
          assert :ok = check_rates([{key, limit, 3}], name, max_wait_ms: 60_000)
          assert System.monotonic_time(:millisecond) - booked >= 1_500
        end

        test "the same process comes back after the delay: :ok, not charged again",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 5}
          key = {"ex", "k"}
          drain(key, limit, 1, name)

          ms = assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 1_000), 1..200)
          Process.sleep(ms)

          before = get_cost(key, 1, name)
          assert :ok = check_rates([{key, limit, 1}], name, max_wait_ms: 1_000)
          assert get_cost(key, 1, name) <= before + 0.01

          # The booking is used up: the same call again is a new one, charged if admitted.
          assert_delay_or_charged(name, key, fn -> check_rates([{key, limit, 1}], name) end)
        end

        test "the claim works without a budget too, and for reordered checks", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 5}
          {a, b} = {{"ex", "a"}, {"ex", "b"}}
          drain(a, limit, 1, name)
          drain(b, limit, 1, name)

          ms =
            assert_delay(
              check_rates([{a, limit, 1}, {b, limit, 1}], name, max_wait_ms: 1_000),
              1..200
            )

          Process.sleep(ms)
          {cost_a, cost_b} = {get_cost(a, 1, name), get_cost(b, 1, name)}
          assert :ok = check_rates([{b, limit, 1}, {a, limit, 1}], name)
          assert get_cost(a, 1, name) <= cost_a + 0.01
          assert get_cost(b, 1, name) <= cost_b + 0.01
        end

        test "another process does not claim it", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 5}
          key = {"ex", "k"}
          drain(key, limit, 1, name)

          ms = assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 1_000), 1..200)
          Process.sleep(ms)

          # Strangers are delayed (or, if the bucket refilled meanwhile, charged).
          for stranger <- [
                fn -> check_rates([{key, limit, 1}], name) end,
                fn -> check_rate(key, limit, 1, name) end
              ] do
            assert_delay_or_charged(name, key, fn -> Task.await(Task.async(stranger)) end)
          end

          # Ours is still there.
          before = get_cost(key, 1, name)
          assert :ok = check_rates([{key, limit, 1}], name)
          assert get_cost(key, 1, name) <= before + 0.01
        end

        test "coming back early answers the remaining wait", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"ex", "k"}
          drained_at = now_ms()
          drain(key, limit, 1, name)

          booked_at = now_ms()
          ms = assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 5_000), 500..1_000)
          Process.sleep(100)
          early = check_rates([{key, limit, 1}], name, max_wait_ms: 5_000)

          if now_ms() - booked_at < ms - 50 do
            remaining = assert_delay(early, 1..(ms - 90))
            # Not booked a second time: 2 borrowed, less what refilled since the drain (a
            # second booking would be one more).
            borrowed = get_cost(key, 1, name)
            refilled = limit.refill_per_sec * (now_ms() - drained_at) / 1000
            assert borrowed <= 2.01 and borrowed >= 2 - refilled - 0.01, "borrowed #{borrowed}"
            Process.sleep(remaining)
            before = get_cost(key, 1, name)
            assert :ok = check_rates([{key, limit, 1}], name, max_wait_ms: 5_000)
            assert get_cost(key, 1, name) <= before + 0.01
          end
        end

        test "a delay over the budget books nothing and pays nothing", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"ex", "k"}
          drain(key, limit, 1, name)

          before = get_cost(key, 1, name)

          refused =
            assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 10), 500..1_000)

          assert get_cost(key, 1, name) <= before + 0.01

          # No queue formed behind the refusal (P3).
          assert_delay(check_rate(key, limit, 1, name), 1..refused)

          # Over capacity, on a fresh key: exact, and nothing reserved.
          okx = %{capacity: 1, refill_per_sec: 9.09}
          assert {:delay, 5391} = check_rates([{{"okx", "k"}, okx, 50}], name, max_wait_ms: 5_000)
          assert get_cost({"okx", "k"}, 1, name) == 0
          assert :ok = check_rate({"okx", "k"}, okx, 1, name)
        end

        # bourse_core's MAX_BOOKINGS.
        test "a bucket queues 256 bookings: a waiter beyond them books and pays nothing",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 10}
          key = {"ex", "k"}
          drain(key, limit, 1, name)
          # 10 tokens of debt: no token accrues for 1 s, however late the waiters come (one
          # coming after 100 ms would find a token and be admitted, not booked).
          assert :ok = record_request(key, 10, name)

          1..256
          |> Enum.map(fn _ ->
            Task.async(fn -> check_rates([{key, limit, 1}], name, max_wait_ms: 60_000) end)
          end)
          |> Task.await_many(10_000)
          |> Enum.each(&assert_delay(&1, 1..26_600))

          # Taken before the first reading: the refill counts from when the store read it.
          since = System.monotonic_time(:millisecond)
          borrowed = get_cost(key, 1, name)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: ms} = error} =
                   wait_for_capacity(key, limit, 1, name, max_wait_ms: 60_000)

          assert ms in 21_000..26_700
          assert error.message =~ "ex: waiters fill the queue of a bucket of this check"
          assert error.message =~ ~r/retry after \d+ ms, within max_wait_ms 60000$/
          assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 60_000), 21_000..26_700)
          # Nothing paid: the debt only refilled meanwhile (10 tokens/s).
          now = get_cost(key, 1, name)
          refilled = (System.monotonic_time(:millisecond) - since + 1) / 100

          assert now <= borrowed + 0.01 and now >= borrowed - refilled - 0.01,
                 "borrowed #{borrowed}, then #{now}"
        end

        @tag limiter_opts: [booking_slack_ms: 10]
        test "a booking not claimed within booking_slack_ms lapses; its cost stays paid",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"ex", "k"}
          drain(key, limit, 1, name)

          ms = assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 5_000), 500..1_000)
          Process.sleep(ms + 150)

          # Not admitted against the lapsed booking, and the booked token was not refunded:
          # the bucket is where it would be had the waiter been served at its ready time.
          assert_delay(check_rates([{key, limit, 1}], name), 1..900)
          borrowed = get_cost(key, 1, name)
          assert borrowed > 0.05 and borrowed <= 0.9, "borrowed #{borrowed}"
        end
      end
    end
  end
end
