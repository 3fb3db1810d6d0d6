defmodule Bourse.ContractTests do
  @moduledoc """
  The `Bourse.RateLimiter` contract (docs/CONTRACT.md §1–6, P1–P6) as ExUnit tests through the
  public API, for one backend per test module:

      defmodule Bourse.RateLimiter.ContractNIFTest do
        use Bourse.ContractTests, backend: :nif
      end

  Options:

    * `:backend` – the `:backend` start option of every limiter (required);
    * `:extra_opts` – more start options for every limiter of the module (default `[]`);
    * `:async` – default `true`;
    * `:skip` – groups of tests that do not apply to the backend, each skipped with a
      reason: `:crash` (P6 by killing the limiter process), `:concurrency`, `:names`,
      `:table_options` (`:assume_busy_at_start` and `:booking_slack_ms` set per limiter:
      a shared daemon takes them from its own command line), `:own_table` (every limiter
      has buckets of its own: limiters on one daemon share them).

  Every test gets a fresh limiter with a unique name (see `Bourse.ContractCase`).
  Calls with the default name live in `Bourse.DefaultNameContractTests`.

  Timing: answers are asserted as `{:delay, ms}` ranges; a delay is exact only on a key
  seen for the first time in that very call (a fresh bucket holds exactly its capacity).
  Sleeps are never bounded above by less than several hundred ms.
  """

  @doc false
  def skip(skipped, group) do
    group in skipped && "#{inspect(group)} does not apply to this backend"
  end

  defmacro __using__(opts) do
    backend = Keyword.fetch!(opts, :backend)
    extra_opts = Keyword.get(opts, :extra_opts, [])
    async = Keyword.get(opts, :async, true)
    skipped = Keyword.get(opts, :skip, [])

    quote location: :keep do
      use Bourse.ContractCase,
        async: unquote(async),
        backend: unquote(backend),
        extra_opts: unquote(extra_opts)

      import Bourse.RateLimiter,
        only: [
          check_rate: 4,
          check_rates: 2,
          check_rates: 3,
          wait_for_capacity: 4,
          wait_for_capacity: 5,
          get_cost: 3,
          record_request: 3,
          reset: 2,
          reset_exchange: 2,
          reset_all: 1,
          pause: 3
        ]

      @contract_skip unquote(skipped)

      # Refills so slow that nothing accrues during a test: one token per 1000 s.
      @still %{capacity: 10, refill_per_sec: 0.001}
      @one_token_ms 1_000_000

      describe "keys" do
        test "a two-element key is the \"request\" axis", %{name: name} do
          limit = %{@still | capacity: 2}
          drain({"ex", "k"}, limit, 2, name)

          assert_delay(check_rate({"ex", "k", "request"}, limit, 1, name), 990_000..@one_token_ms)
          assert_delay(check_rate({"ex", "k"}, limit, 1, name), 990_000..@one_token_ms)
          assert :ok = check_rate({"ex", "k", "ip"}, limit, 1, name)
          assert_about(get_cost({"ex", "k", "request"}, 1_000, name), 2, 0.01)
          assert_about(get_cost({"ex", "k"}, 1_000, name), 2, 0.01)
        end

        test ":public is the shared pool, apart from every credential", %{name: name} do
          limit = %{@still | capacity: 1}
          drain({"ex", :public, "ip"}, limit, 1, name)

          assert {:delay, _} = check_rate({"ex", :public, "ip"}, limit, 1, name)
          assert :ok = check_rate({"ex", "public", "ip"}, limit, 1, name)
          assert :ok = check_rate({"ex", "k", "ip"}, limit, 1, name)
          assert :ok = check_rate({"ex", :public}, limit, 1, name)
          assert {:delay, _} = check_rate({"ex", :public}, limit, 1, name)
          assert_about(get_cost({"ex", :public, "request"}, 1, name), 1, 0.01)
        end

        test "exchanges, credentials and axes are separate buckets", %{name: name} do
          limit = %{@still | capacity: 1}
          drain({"a", "k", "x"}, limit, 1, name)

          assert {:delay, _} = check_rate({"a", "k", "x"}, limit, 1, name)

          for key <- [{"b", "k", "x"}, {"a", "k2", "x"}, {"a", "k", "y"}, {"a", "", "x"}] do
            assert :ok = check_rate(key, limit, 1, name), "#{inspect(key)} was not fresh"
          end
        end
      end

      describe "limit forms" do
        test "%{requests: n, period: ms} is %{capacity: n, refill_per_sec: n / (ms / 1000)}",
             %{name: name} do
          binance = %{requests: 1200, period: 60_000}
          same = %{capacity: 1200, refill_per_sec: 1200 / (60_000 / 1000)}

          # No conflict when both forms name one key in one call: one bucket, one charge.
          assert :ok =
                   check_rates(
                     [{{"binance", "k"}, binance, 4}, {{"binance", "k"}, same, 6}],
                     name
                   )

          assert_about(get_cost({"binance", "k"}, 60_000, name), 10, 2)

          odd = %{requests: 7, period: 3_000}
          odd_same = %{capacity: 7, refill_per_sec: 7 / (3_000 / 1000)}
          assert :ok = check_rates([{{"x", "k"}, odd, 1}, {{"x", "k"}, odd_same, 2}], name)

          # Across calls, too: the other form is the same definition (nothing is clamped).
          drain({"y", "k"}, %{requests: 10, period: 1_000_000}, 5, name)
          assert :ok = check_rate({"y", "k"}, %{capacity: 10, refill_per_sec: 0.01}, 5, name)
          assert {:delay, _} = check_rate({"y", "k"}, %{requests: 10, period: 1_000_000}, 1, name)
        end

        test "%{requests: n} is n per second", %{name: name} do
          per_sec = %{requests: 5}

          assert :ok =
                   check_rates(
                     [
                       {{"x", "k"}, per_sec, 1},
                       {{"x", "k"}, %{capacity: 5, refill_per_sec: 5}, 1},
                       {{"x", "k"}, %{requests: 5, period: 1000}, 1}
                     ],
                     name
                   )

          # On a key seen for the first time the delay is exact: (cost - capacity) / rate.
          assert {:delay, 500} = check_rate({"y", "k"}, %{requests: 2}, 3, name)
          assert {:delay, 200} = check_rate({"z", "k"}, %{requests: 3, period: 600}, 4, name)
        end

        test "a nil limit is :ok and records nothing", %{name: name} do
          key = {"ex", "k"}
          assert :ok = check_rate(key, nil, 1, name)
          assert :ok = check_rate(key, nil, 1_000_000, name)
          assert :ok = check_rates([{key, nil, 5}], name)
          assert :ok = wait_for_capacity(key, nil, 3, name)
          assert :ok = wait_for_capacity(key, nil, 3, name, max_wait_ms: 1)
          assert get_cost(key, 1, name) == 0

          # nil checks are dropped from a multi-bucket check, the others are paid.
          assert :ok = check_rates([{key, nil, 5}, {{"ex", "other"}, @still, 1}], name)
          assert get_cost(key, 1, name) == 0
          assert_about(get_cost({"ex", "other"}, 1, name), 1, 0.01)

          # ... even when the same key is limited in another call.
          drain(key, %{@still | capacity: 1}, 1, name)
          assert :ok = check_rate(key, nil, 1, name)
          assert :ok = check_rates([{key, nil, 1}, {key, nil, 2}], name)
        end

        test "an empty check list is :ok", %{name: name} do
          assert :ok = check_rates([], name)
          assert :ok = check_rates([], name, [])
          assert :ok = check_rates([], name, max_wait_ms: 10)
        end
      end

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
          assert :ok = check_rate(key, limit, 3, name)

          # Paying left the bucket at zero: at most the capacity is borrowed, not the cost.
          borrowed = get_cost(key, 1, name)
          assert borrowed <= 2.0 and borrowed > 1.0, "borrowed #{borrowed}"
          assert_delay(check_rate(key, limit, 2, name), 1..1_000)
        end

        test "cheap traffic never sees more than the capacity", %{name: name} do
          limit = %{capacity: 2, refill_per_sec: 4}
          key = {"ex", "k"}

          # A heavy probe starts an accrual of 4 ...
          assert {:delay, 500} = check_rate(key, limit, 4, name)
          Process.sleep(600)
          # ... but a cheap request finds only the capacity, and spends all of it.
          assert :ok = check_rate(key, limit, 2, name)
          assert_delay(check_rate(key, limit, 2, name), 1..500)
          assert_delay(check_rate(key, limit, 4, name), 501..1_000)
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
      end

      describe "check_rates" do
        test "all or nothing over several buckets (P4)", %{name: name} do
          one = %{@still | capacity: 1}
          drain({"ex", "b"}, one, 1, name)

          assert_delay(
            check_rates([{{"ex", "a"}, @still, 3}, {{"ex", "b"}, one, 1}], name),
            990_000..@one_token_ms
          )

          assert get_cost({"ex", "a"}, 1, name) == 0

          assert :ok = check_rates([{{"ex", "a"}, @still, 3}, {{"ex", "c"}, one, 1}], name)
          assert_about(get_cost({"ex", "a"}, 1, name), 3, 0.01)
          assert_about(get_cost({"ex", "c"}, 1, name), 1, 0.01)
        end

        test "the delay is the longest wait", %{name: name} do
          drain({"ex", "slow"}, %{@still | capacity: 1}, 1, name)
          drain({"ex", "fast"}, %{capacity: 1, refill_per_sec: 10}, 1, name)

          checks = [
            {{"ex", "fast"}, %{capacity: 1, refill_per_sec: 10}, 1},
            {{"ex", "slow"}, %{@still | capacity: 1}, 1}
          ]

          assert_delay(check_rates(checks, name), 990_000..@one_token_ms)
          assert_delay(check_rates(Enum.reverse(checks), name), 990_000..@one_token_ms)
        end

        test "repeated checks of one key are charged once at their combined cost",
             %{name: name} do
          key = {"ex", "k"}

          assert :ok =
                   check_rates(
                     [{key, @still, 3}, {{"ex", "o"}, @still, 1}, {key, @still, 4}],
                     name
                   )

          assert_about(get_cost(key, 1, name), 7, 0.01)

          # 2 + 2 does not fit in the 3 left, although 2 alone does.
          assert_delay(
            check_rates([{key, @still, 2}, {key, @still, 2}], name),
            990_000..@one_token_ms
          )

          assert_about(get_cost(key, 1, name), 7, 0.01)
          assert :ok = check_rates([{key, @still, 2}], name)

          # The delay is computed for the combined cost: here over the capacity.
          fresh = %{capacity: 5, refill_per_sec: 10}

          assert {:delay, 100} =
                   check_rates([{{"ex", "f"}, fresh, 3}, {{"ex", "f"}, fresh, 3}], name)
        end

        test "two definitions of one key in one call are invalid and pay nothing",
             %{name: name} do
          a = %{capacity: 10, refill_per_sec: 1}
          b = %{capacity: 10, refill_per_sec: 2}

          assert_invalid(
            check_rates([{{"ex", "o"}, a, 1}, {{"ex", "k"}, a, 1}, {{"ex", "k"}, b, 1}], name)
          )

          assert_invalid(
            check_rates([{{"ex", "k"}, %{requests: 10}, 1}, {{"ex", "k"}, a, 1}], name)
          )

          assert_invalid(
            check_rates(
              [{{"ex", "o"}, a, 1}, {{"ex", "k"}, a, 1}, {{"ex", "k", "request"}, b, 1}],
              name,
              max_wait_ms: 1_000
            )
          )

          assert get_cost({"ex", "k"}, 1, name) == 0
          assert get_cost({"ex", "o"}, 1, name) == 0
        end
      end

      describe "bookings" do
        @describetag limiter_opts: [booking_slack_ms: 5_000]

        test "a waiter books at once: later callers queue behind it", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 2}
          key = {"ex", "k"}
          drain(key, limit, 1, name)

          booked = assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 2_000), 1..500)

          # The booked token is already taken: about 2 borrowed, more than the capacity.
          assert get_cost(key, 1, name) > 1.2

          # A probe now waits for the booking and then for its own token. (From another
          # process: the same process asking the same check again is claiming its booking.)
          probe =
            Task.async(fn -> check_rate(key, limit, 1, name) end)
            |> Task.await()
            |> assert_delay(1..1_000)

          assert probe >= booked + 200, "probe #{probe} ms did not queue behind #{booked} ms"

          # Another waiter books behind the first one.
          other =
            Task.async(fn -> check_rates([{key, limit, 1}], name, max_wait_ms: 2_000) end)
            |> Task.await()
            |> assert_delay(1..1_000)

          assert other >= booked + 200, "waiter #{other} ms did not queue behind #{booked} ms"
          assert get_cost(key, 1, name) > 2.2
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
          drain(key, limit, 1, name)

          booked_at = now_ms()
          ms = assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 5_000), 500..1_000)
          Process.sleep(100)
          early = check_rates([{key, limit, 1}], name, max_wait_ms: 5_000)

          if now_ms() - booked_at < ms - 50 do
            remaining = assert_delay(early, 1..(ms - 90))
            # Not booked a second time.
            assert_about(get_cost(key, 1, name), 2, 0.3)
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

        @tag limiter_opts: [booking_slack_ms: 10]
        @tag skip: Bourse.ContractTests.skip(@contract_skip, :table_options)
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

      describe "wait_for_capacity" do
        test "admits at once when the bucket holds the cost, and pays", %{name: name} do
          {ms, answer} = timed(fn -> wait_for_capacity({"ex", "k"}, @still, 3, name) end)
          assert answer == :ok
          assert ms < 1_000
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

        test "over max_wait_ms: rate_limit_exceeded at once, with retry_after, paying nothing",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"ex", "k"}
          drain(key, limit, 1, name)
          before = get_cost(key, 1, name)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: retry}} =
                   wait_for_capacity(key, limit, 1, name, max_wait_ms: 100)

          assert retry in 500..1_000
          assert get_cost(key, 1, name) <= before + 0.01
          assert_delay(check_rate(key, limit, 1, name), 1..retry)

          # At once: not after sleeping part of the 5391 ms.
          okx = %{capacity: 1, refill_per_sec: 9.09}

          {ms, answer} =
            timed(fn -> wait_for_capacity({"okx", "k"}, okx, 50, name, max_wait_ms: 5_000) end)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: 5391}} = answer
          assert ms < 2_000, "took #{ms} ms to refuse"
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
              Task.async(fn -> hammer_until_stopped(key, limit, name, stop, 0) end)
            end

          Process.sleep(50)
          # Cost 8 needs 400 ms of refill; without bookings, the cost-1 loop would take
          # every token as it accrues.
          {ms, answer} =
            timed(fn -> wait_for_capacity(key, limit, 8, name, max_wait_ms: 5_000) end)

          :atomics.put(stop, 1, 1)
          Task.await_many(hammers, 10_000)

          assert answer == :ok
          assert ms < 2_000, "the cost-8 waiter waited #{ms} ms (about 400 expected)"
        end
      end

      describe "record_request and get_cost" do
        test "get_cost is 0 for an unknown key and ignores the period", %{name: name} do
          assert get_cost({"ex", "k"}, 1_000, name) == 0
          assert get_cost({"ex", "k"}, nil, name) == 0
          assert get_cost({"ex", "k", "ip"}, :whatever, name) == 0
        end

        test "get_cost is what is borrowed: capacity - tokens", %{name: name} do
          drain({"ex", "k"}, @still, 1, name, 3.5)
          assert_about(get_cost({"ex", "k"}, 60_000, name), 3.5, 0.01)
          assert_about(get_cost({"ex", "k"}, nil, name), 3.5, 0.01)

          # It falls as the bucket refills, never below 0.
          fast = %{capacity: 2, refill_per_sec: 100}
          drain({"ex", "f"}, fast, 2, name)
          Process.sleep(100)
          assert get_cost({"ex", "f"}, 1, name) == 0
        end

        test "record_request debits without checking; the bucket may go into debt",
             %{name: name} do
          key = {"ex", "k"}
          assert :ok = check_rate(key, @still, 1, name)
          assert :ok = record_request(key, 15, name)

          # 16 borrowed from a capacity of 10: 6 tokens in debt.
          assert_about(get_cost(key, 1, name), 16, 0.01)
          assert_delay(check_rate(key, @still, 1, name), 6_990_000..7_000_000)

          assert :ok = record_request(key, 0, name)
          assert :ok = record_request(key, 0.5, name)
          assert_about(get_cost(key, 1, name), 16.5, 0.01)
        end

        test "debt on a key without a definition is kept, then applied at its first check",
             %{name: name} do
          key = {"ex", "k"}
          assert :ok = record_request(key, 2, name)
          assert :ok = record_request(key, 1, name)
          assert_about(get_cost(key, 1, name), 3, 1.0e-9)

          limit = %{capacity: 5, refill_per_sec: 0.001}
          assert :ok = check_rate(key, limit, 1, name)
          assert_about(get_cost(key, 1, name), 4, 0.01)
          assert {:delay, _} = check_rate(key, limit, 2, name)
          assert :ok = check_rate(key, limit, 1, name)
        end
      end

      describe "resets" do
        @describetag limiter_opts: [booking_slack_ms: 5_000]

        test "reset: the key is as new and its bookings are dropped", %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"ex", "k"}
          drain({"ex", "other"}, @still, 2, name)
          drain(key, limit, 1, name)
          assert {:delay, _} = check_rates([{key, limit, 1}], name, max_wait_ms: 5_000)

          assert :ok = reset(key, name)
          assert get_cost(key, 1, name) == 0
          assert_about(get_cost({"ex", "other"}, 1, name), 2, 0.01)

          # Coming back is no claim: the bucket is new and full, and this call pays.
          assert :ok = check_rates([{key, limit, 1}], name, max_wait_ms: 5_000)
          assert get_cost(key, 1, name) > 0.5

          # A two-element key resets the "request" axis.
          assert :ok = reset({"ex", "other"}, name)
          assert get_cost({"ex", "other", "request"}, 1, name) == 0
        end

        test "reset_exchange: every key of that exchange, no other", %{name: name} do
          keys_a = [{"a", "k"}, {"a", "k", "ip"}, {"a", :public, "ip"}]
          keys_b = [{"b", "k"}, {"ab", "k"}, {"A", "k"}]
          one = %{@still | capacity: 1}
          for key <- keys_a ++ keys_b, do: drain(key, one, 1, name)
          assert :ok = record_request({"a", "undefined"}, 5, name)

          assert :ok = reset_exchange("a", name)

          for key <- [{"a", "undefined"} | keys_a] do
            assert get_cost(key, 1, name) == 0, "#{inspect(key)} was not reset"
          end

          for key <- keys_b do
            assert_about(get_cost(key, 1, name), 1, 0.01)
            assert {:delay, _} = check_rate(key, one, 1, name)
          end

          for key <- keys_a, do: assert(:ok = check_rate(key, one, 1, name))
          assert :ok = reset_exchange("nobody", name)
        end

        test "reset_all: everything is as new", %{name: name} do
          keys = [{"a", "k"}, {"b", :public, "ip"}, {"c", "k", "uid"}]
          one = %{@still | capacity: 1}
          for key <- keys, do: drain(key, one, 1, name)
          assert :ok = record_request({"d", "k"}, 5, name)

          assert :ok = reset_all(name)

          for key <- [{"d", "k"} | keys] do
            assert get_cost(key, 1, name) == 0
          end

          for key <- keys, do: assert(:ok = check_rate(key, one, 1, name))
        end
      end

      describe "start options" do
        @tag limiter_opts: [assume_busy_at_start: true]
        @tag skip: Bourse.ContractTests.skip(@contract_skip, :table_options)
        test "assume_busy_at_start: a bucket seen within its fill time starts as if empty at start",
             %{name: name} do
          # Fill time 100 s: first seen right after the start, the bucket is about empty.
          limit = %{capacity: 10, refill_per_sec: 0.1}
          assert_delay(check_rate({"ex", "k"}, limit, 1, name), 1..10_000)
          borrowed = get_cost({"ex", "k"}, 1, name)
          assert borrowed > 9 and borrowed <= 10, "borrowed #{borrowed}"

          # Fill time 10 ms: seen after it, the bucket is full.
          Process.sleep(20)
          fast = %{capacity: 5, refill_per_sec: 500}
          drain({"ex", "f"}, fast, 5, name)
        end

        test "without assume_busy_at_start the same bucket starts full", %{name: name} do
          drain({"ex", "k"}, %{capacity: 10, refill_per_sec: 1}, 10, name)
        end
      end

      describe "pause" do
        test "a key: probes answer the remaining pause; nothing is paid", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          key = {"ex", "k", "request"}
          assert :ok = pause(key, 5_000, name)

          first = assert_delay(check_rate(key, limit, 1, name), 4_000..5_000)
          assert_delay(check_rate({"ex", "k"}, limit, 1, name), 1..first)

          assert_delay(
            check_rates([{key, limit, 1}, {{"ex", "k", "ip"}, limit, 1}], name),
            1..first
          )

          assert get_cost(key, 1, name) == 0
          assert get_cost({"ex", "k", "ip"}, 1, name) == 0

          # Other axes, credentials and exchanges are not held.
          assert :ok = check_rate({"ex", "k", "ip"}, limit, 1, name)
          assert :ok = check_rate({"ex", "k2", "request"}, limit, 1, name)
          assert :ok = check_rate({"other", "k", "request"}, limit, 1, name)
        end

        test "after a pause the bucket is as it was: nothing was paid", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 0.001}
          key = {"ex", "k"}
          assert :ok = pause("ex", 0, name)
          assert :ok = pause(key, 500, name)
          paused_at = now_ms()
          for _ <- 1..20, do: assert({:delay, _} = check_rate(key, limit, 1, name))

          Process.sleep(max(0, paused_at + 550 - now_ms()))
          assert :ok = check_rate(key, limit, 5, name)
        end

        test "{exchange_id, credential_key}: every axis of that credential", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          assert :ok = pause({"ex", "k"}, 5_000, name)
          assert :ok = pause({"ex", :public}, 5_000, name)

          for key <- [{"ex", "k"}, {"ex", "k", "ip"}, {"ex", "k", "uid"}, {"ex", :public, "ip"}] do
            assert_delay(check_rate(key, limit, 1, name), 1..5_000)
          end

          for key <- [{"ex", "k2", "ip"}, {"ex", "public", "ip"}, {"other", "k", "ip"}] do
            assert :ok = check_rate(key, limit, 1, name)
          end
        end

        test "an exchange id: every key of the exchange", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          assert :ok = pause("ex", 5_000, name)

          for key <- [{"ex", "k"}, {"ex", "k2", "ip"}, {"ex", :public, "uid"}] do
            assert_delay(check_rate(key, limit, 1, name), 1..5_000)
          end

          for key <- [{"ex2", "k"}, {"e", "k"}], do: assert(:ok = check_rate(key, limit, 1, name))
        end

        test "waiters book behind a pause; the later end of overlapping pauses holds",
             %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          key = {"ex", "k"}
          paused_at = System.monotonic_time(:microsecond)
          assert :ok = pause(key, 300, name)

          # Not admitted before the pause ends.
          assert :ok = wait_for_capacity(key, limit, 1, name)
          waited = (System.monotonic_time(:microsecond) - paused_at) / 1000
          assert waited >= 299, "admitted #{waited} ms into a 300 ms pause"
          assert :ok = check_rate(key, limit, 1, name)

          assert :ok = pause({"ex", "o"}, 5_000, name)
          assert :ok = pause({"ex", "o"}, 50, name)
          assert_delay(check_rate({"ex", "o"}, limit, 1, name), 1_000..5_000)
        end

        test "bad targets and durations are invalid", %{name: name} do
          for target <- [
                :ex,
                1,
                {"ex"},
                {"ex", 1},
                {"ex", "k", :ip},
                {"ex", "k", "ip", "x"},
                ["ex"]
              ] do
            assert_invalid(pause(target, 100, name))
          end

          for ms <- [-1, 1.5, :infinity, "100", nil] do
            assert_invalid(pause("ex", ms, name))
          end

          assert :ok = check_rate({"ex", "k"}, @still, 1, name)
        end
      end

      describe "concurrency" do
        @describetag timeout: 60_000

        @tag skip: Bourse.ContractTests.skip(@contract_skip, :concurrency)
        test "48 processes on one key: admitted within C + r * elapsed, and most of it (P1)",
             %{name: name} do
          limit = %{capacity: 20, refill_per_sec: 200}
          key = {"ex", "k"}
          started = System.monotonic_time(:microsecond)
          deadline = now_ms() + 1_000

          admitted =
            for(_ <- 1..48, do: Task.async(fn -> hammer_until(key, limit, name, deadline, 0) end))
            |> Task.await_many(30_000)
            |> Enum.sum()

          elapsed = (System.monotonic_time(:microsecond) - started) / 1.0e6
          assert admitted <= 20 + 200 * elapsed, "#{admitted} admitted in #{elapsed} s"
          assert admitted >= 0.8 * 200 * elapsed, "only #{admitted} admitted in #{elapsed} s"
        end

        @tag skip: Bourse.ContractTests.skip(@contract_skip, :concurrency)
        test "concurrent multi-bucket checks pay on all their buckets or none (P4)",
             %{name: name} do
          shared = {"ex", "shared"}
          shared_limit = %{@still | capacity: 30}

          counts =
            for i <- 1..16 do
              Task.async(fn ->
                own = {"ex", "own-#{i}"}

                admitted =
                  Enum.count(1..50, fn _ ->
                    check_rates([{shared, shared_limit, 1}, {own, @still, 0.25}], name) == :ok
                  end)

                {own, admitted}
              end)
            end
            |> Task.await_many(30_000)

          total = counts |> Enum.map(&elem(&1, 1)) |> Enum.sum()
          assert total == 30
          assert_about(get_cost(shared, 1, name), 30, 0.01)

          for {own, admitted} <- counts do
            assert_about(get_cost(own, 1, name), admitted * 0.25, 0.01)
          end
        end
      end

      describe "crash of the limiter process (P6)" do
        for form <- [:local, :global, :via] do
          @tag name_form: form
          @tag skip: Bourse.ContractTests.skip(@contract_skip, :crash)
          test "spent budget stays spent after a restart (#{form} name)",
               %{name: name, start_name: start_name} do
            limit = %{@still | capacity: 5}
            key = {"ex", "k"}
            drain(key, limit, 5, name)
            assert :ok = record_request({"ex", "debt"}, 3, name)
            spent = get_cost(key, 1, name)

            pid = limiter_pid(start_name)
            ref = Process.monitor(pid)
            Process.exit(pid, :kill)
            assert_receive {:DOWN, ^ref, :process, ^pid, :killed}, 5_000

            restarted =
              eventually(fn ->
                case limiter_pid(start_name) do
                  new when is_pid(new) and new != pid -> new
                  _ -> nil
                end
              end)

            assert Process.alive?(restarted)
            assert_delay(check_rate(key, limit, 1, name), 990_000..@one_token_ms)
            assert_about(get_cost(key, 1, name), spent, 0.01)
            assert_about(get_cost({"ex", "debt"}, 1, name), 3, 0.01)
            assert :ok = check_rate({"ex", "fresh"}, limit, 1, name)
          end
        end
      end

      describe "malformed input (P5)" do
        for form <- [:local, :via] do
          @tag name_form: form
          test "each is :invalid_parameters with a message, pays nothing, crashes nothing (#{form} name)",
               %{name: name, start_name: start_name} do
            probe = {"probe", "k", "request"}
            assert :ok = check_rate(probe, @still, 1, name)
            spent = get_cost(probe, 1, name)
            pid = limiter_pid(start_name)

            calls = malformed_calls(name, probe, @still)
            assert length(calls) >= 30
            failures = failing_malformed(calls)

            assert failures == [],
                   "#{length(failures)} of #{length(calls)} malformed calls were not " <>
                     "answered with :invalid_parameters:\n" <>
                     Enum.map_join(failures, "\n", fn {label, got} -> "  #{label}: #{got}" end)

            assert Process.alive?(pid), "the limiter process died"
            assert limiter_pid(start_name) == pid, "the limiter process was restarted"
            assert_about(get_cost(probe, 1, name), spent, 0.01)
            assert :ok = check_rate(probe, @still, 1, name)
          end
        end
      end

      describe "names" do
        for form <- [:local, :global, :via, :node] do
          @tag name_form: form
          @tag limiter_opts: [booking_slack_ms: 5_000]
          @tag skip: Bourse.ContractTests.skip(@contract_skip, :names)
          test "every call works with a #{form} name", %{name: name} do
            limit = %{@still | capacity: 2}
            key = {"ex", "k"}

            assert :ok = check_rate(key, limit, 1, name)
            assert :ok = check_rates([{key, limit, 1}], name)
            assert {:delay, _} = check_rate(key, limit, 1, name)
            assert {:delay, _} = check_rates([{key, limit, 1}], name, [])
            assert_about(get_cost(key, 1, name), 2, 0.01)

            # Waiters: fresh keys with over-capacity costs have exact delays (100 ms).
            fast = %{capacity: 1, refill_per_sec: 10}
            assert :ok = wait_for_capacity({"ex", "w1"}, fast, 2, name)
            assert :ok = wait_for_capacity({"ex", "w2"}, fast, 2, name, max_wait_ms: 1_000)

            assert {:delay, 100} =
                     check_rates([{{"ex", "w3"}, fast, 2}], name, max_wait_ms: 1_000)

            Process.sleep(100)
            claimed = get_cost({"ex", "w3"}, 1, name)
            assert :ok = check_rates([{{"ex", "w3"}, fast, 2}], name, max_wait_ms: 1_000)
            assert get_cost({"ex", "w3"}, 1, name) <= claimed + 0.01

            assert :ok = record_request({"ex", "d"}, 4, name)
            assert_about(get_cost({"ex", "d"}, 1, name), 4, 1.0e-9)
            assert :ok = pause({"ex", "p"}, 10_000, name)
            assert_delay(check_rate({"ex", "p"}, limit, 1, name), 9_000..10_000)
            assert :ok = reset(key, name)
            assert get_cost(key, 1, name) == 0
            assert :ok = reset_exchange("ex", name)
            assert get_cost({"ex", "d"}, 1, name) == 0
            assert :ok = check_rate({"other", "k"}, limit, 2, name)
            assert :ok = reset_all(name)
            assert get_cost({"other", "k"}, 1, name) == 0

            assert_invalid(check_rate({"ex"}, limit, 1, name))
            assert_invalid(check_rates([{key, limit, -1}], name))
          end
        end
      end

      describe "child_spec/1 and start_link/1" do
        test "the child id is the name", %{backend: backend} do
          assert %{id: :some_limiter, start: {Bourse.RateLimiter, :start_link, [opts]}} =
                   Bourse.RateLimiter.child_spec(name: :some_limiter, backend: backend)

          assert opts[:name] == :some_limiter
          assert %{id: {:global, :g}} = Bourse.RateLimiter.child_spec(name: {:global, :g})
          assert %{id: Bourse.RateLimiter} = Bourse.RateLimiter.child_spec([])
        end

        @tag skip: Bourse.ContractTests.skip(@contract_skip, :own_table)
        test "several limiters fit under one supervisor, each with its own buckets",
             %{backend: backend} do
          {a, b} = {unique_name(), unique_name()}
          start_supervised!({Bourse.RateLimiter, name: a, backend: backend})
          start_supervised!({Bourse.RateLimiter, name: b, backend: backend})
          drain({"ex", "k"}, %{@still | capacity: 1}, 1, a)
          assert {:delay, _} = check_rate({"ex", "k"}, %{@still | capacity: 1}, 1, a)
          assert :ok = check_rate({"ex", "k"}, %{@still | capacity: 1}, 1, b)
        end

        test "start_link/1 starts a named limiter", %{backend: backend} do
          name = unique_name()
          assert {:ok, pid} = Bourse.RateLimiter.start_link(name: name, backend: backend)
          assert Process.whereis(name) == pid
          assert :ok = check_rate({"ex", "k"}, @still, 1, name)

          assert {:error, {:already_started, ^pid}} =
                   Bourse.RateLimiter.start_link(name: name, backend: backend)

          GenServer.stop(pid)
        end

        test "start_link/1 refuses bad options with :invalid_parameters", %{backend: backend} do
          bad = [
            [backend: :no_such_backend],
            [backend: "nif"],
            [backend: nil],
            [booking_slack_ms: -1],
            [booking_slack_ms: 1.5],
            [booking_slack_ms: :x],
            [booking_slack_ms: nil],
            [assume_busy_at_start: :yes],
            [assume_busy_at_start: nil],
            [assume_busy_at_start: 1],
            [sweep_interval_ms: 0],
            [name: "string"],
            [name: 123],
            [name: nil],
            [name: {:not_global, :x}],
            [name: {:via, "Registry", :x}],
            [name: {:x, node()}]
          ]

          for opts <- bad do
            name = unique_name()

            assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
                     Bourse.RateLimiter.start_link(opts ++ [name: name, backend: backend]),
                   "accepted #{inspect(opts)}"

            assert is_binary(message) and message != ""
            assert Process.whereis(name) == nil
          end

          for opts <- [[:name], %{name: unique_name()}, "opts", [{"name", :x}]] do
            assert {:error, %Bourse.Error{type: :invalid_parameters}} =
                     Bourse.RateLimiter.start_link(opts)
          end
        end
      end

      defp unique_name, do: :"limiter_#{System.unique_integer([:positive])}"

      defp hammer_until(key, limit, name, deadline, admitted) do
        if now_ms() >= deadline do
          admitted
        else
          case check_rate(key, limit, 1, name) do
            :ok -> hammer_until(key, limit, name, deadline, admitted + 1)
            {:delay, _} -> hammer_until(key, limit, name, deadline, admitted)
          end
        end
      end

      defp hammer_until_stopped(key, limit, name, stop, admitted) do
        if :atomics.get(stop, 1) == 1 do
          admitted
        else
          case check_rate(key, limit, 1, name) do
            :ok -> hammer_until_stopped(key, limit, name, stop, admitted + 1)
            {:delay, _} -> hammer_until_stopped(key, limit, name, stop, admitted)
          end
        end
      end
    end
  end
end
