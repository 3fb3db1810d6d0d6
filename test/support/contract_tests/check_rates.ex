defmodule Bourse.ContractTests.CheckRates do
  @moduledoc false
  # docs/CONTRACT.md §3: `check_rates`: all or nothing, the longest wait, coalescing, conflicts.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
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

        test "the largest call taken: 1024 checks of the longest keys, on every backend",
             %{name: name} do
          part = &String.pad_trailing(&1, 1024, ".")
          {exchange, credential} = {part.("ex"), part.("k")}
          checks = for i <- 1..1024, do: {{exchange, credential, part.("a#{i}")}, @still, 1}

          assert :ok = check_rates(checks, name)
          assert_about(get_cost({exchange, credential, part.("a1024")}, 1, name), 1, 0.01)
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

        test "each refused call counts one invalid input, conflicts included", %{name: name} do
          a = %{capacity: 10, refill_per_sec: 1}
          b = %{capacity: 10, refill_per_sec: 2}
          %{invalid: before} = stats(name)

          assert_invalid(check_rates([{{"ex", "k"}, a, 1}, {{"ex", "k"}, b, 1}], name))
          assert %{invalid: counted} = stats(name)
          assert counted == before + 1

          assert_invalid(check_rates([{{"ex", "k"}, a, -1}, {{"ex", "o"}, a, 1}], name))
          assert_invalid(check_rate({"ex", "k"}, a, -1, name))
          assert %{invalid: counted} = stats(name)
          assert counted == before + 3

          # Checks without a limit too.
          assert_invalid(check_rate({"ex", 1}, nil, 1, name))
          assert_invalid(check_rates([{{"ex", "k"}, nil, 1}, {{"ex", "o"}, nil, -1}], name))
          assert :ok = check_rates([{{"ex", "k"}, nil, 1}], name)
          assert %{invalid: counted} = stats(name)
          assert counted == before + 5
        end
      end
    end
  end
end
