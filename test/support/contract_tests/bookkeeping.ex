defmodule Bourse.ContractTests.Bookkeeping do
  @moduledoc false
  # docs/CONTRACT.md §3: `record_request`, `get_cost` and the resets.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "record_request and get_cost" do
        test "get_cost is 0 for an unknown key and ignores the period", %{name: name} do
          # The integer 0, as written: `0 = get_cost(...)` matches.
          assert get_cost({"ex", "k"}, 1_000, name) === 0
          assert get_cost({"ex", "k"}, nil, name) === 0
          assert get_cost({"ex", "k", "ip"}, :whatever, name) === 0
        end

        test "get_cost is what is borrowed: capacity - tokens", %{name: name} do
          drain({"ex", "k"}, @still, 1, name, 3.5)
          assert_about(get_cost({"ex", "k"}, 60_000, name), 3.5, 0.01)
          assert_about(get_cost({"ex", "k"}, nil, name), 3.5, 0.01)

          # It falls as the bucket refills, never below 0.
          fast = %{capacity: 2, refill_per_sec: 100}
          drain({"ex", "f"}, fast, 2, name)
          Process.sleep(100)
          assert get_cost({"ex", "f"}, 1, name) === 0
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
    end
  end
end
