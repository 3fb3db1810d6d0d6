defmodule Bourse.ContractTests.KeysAndLimits do
  @moduledoc false
  # docs/CONTRACT.md §1: keys, and the forms of a limit.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
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

          # No conflict when both forms name one key in one call: one bucket, one charge (10
          # borrowed, less what refilled since at 20 a second).
          checked_at = now_ms()

          assert :ok =
                   check_rates(
                     [{{"binance", "k"}, binance, 4}, {{"binance", "k"}, same, 6}],
                     name
                   )

          borrowed = get_cost({"binance", "k"}, 60_000, name)
          refilled = same.refill_per_sec * (now_ms() - checked_at) / 1000
          assert borrowed <= 10.01 and borrowed >= 10 - refilled - 0.01, "borrowed #{borrowed}"

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

        test "a map that is no limit is named by its size, and by its limit keys up to 2 keys, and counts one invalid input",
             %{name: name} do
          not_a_limit =
            "limit must be %{capacity: c, refill_per_sec: r}, %{requests: n, period: ms}, " <>
              "%{requests: n} or nil, got "

          others = "other than :capacity, :refill_per_sec, :requests and :period"
          many = Map.new(1..5_000, &{:"k#{&1}", &1})

          cases = [
            {Map.new(1..5_000, &{&1, &1}), "a map of 5000 keys"},
            {Map.merge(many, %{capacity: 10, refill_per_sec: 1}), "a map of 5002 keys"},
            {%{capacity: 10, refill_per_sec: 1, requests: 10}, "a map of 3 keys"},
            {%{:"$key1" => 1, "x" => 2}, "a map of 2 keys #{others}"},
            {%{:"$key0" => 10, :requests => 10}, "a map of :requests and 1 key #{others}"},
            {%{:requests => 10, "period" => 1000}, "a map of :requests and 1 key #{others}"},
            {%{capacity: 10, refil_per_sec: 1}, "a map of :capacity and 1 key #{others}"},
            {%{"capacity" => 10, "refill_per_sec" => 1}, "a map of 2 keys #{others}"},
            {%{capacity: 10}, "a map of :capacity alone"},
            {%{refill_per_sec: 1}, "a map of :refill_per_sec alone"},
            {%{capacity: 10, requests: 10}, "a map of :capacity and :requests"},
            {%{period: 10}, "a map of :period alone"},
            # A struct's __struct__ is a key like any other.
            {struct(Bourse.ContractTests.OneField, capacity: 10),
             "a map of :capacity and 1 key #{others}"},
            {%{__struct__: :capacity}, "a map of 1 key #{others}"}
          ]

          %{invalid: before} = stats(name)

          for {limit, got} <- cases do
            message = assert_invalid(check_rate({"ex", "k"}, limit, 1, name))
            assert message == not_a_limit <> got
          end

          assert %{invalid: counted} = stats(name)
          assert counted == before + length(cases)
        end

        test "an empty check list is :ok", %{name: name} do
          assert :ok = check_rates([], name)
          assert :ok = check_rates([], name, [])
          assert :ok = check_rates([], name, max_wait_ms: 10)
        end
      end
    end
  end
end
