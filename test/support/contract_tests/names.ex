defmodule Bourse.ContractTests.Names do
  @moduledoc false
  # docs/CONTRACT.md §3: every call with every name form.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
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
    end
  end
end
