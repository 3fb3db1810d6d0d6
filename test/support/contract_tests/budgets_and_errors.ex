defmodule Bourse.ContractTests.BudgetsAndErrors do
  @moduledoc false
  # docs/CONTRACT.md §8 "Budgets" and "Errors": the bounds of max_wait_ms, a held booking and a
  # shorter budget, and what an error carries.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "budgets" do
        @describetag limiter_opts: [booking_slack_ms: 5_000]

        test "a held booking and a budget shorter than its remaining wait: rate_limit_exceeded at once; the booking stays",
             %{name: name} do
          limit = %{capacity: 1, refill_per_sec: 1}
          key = {"okx", "k"}
          drain(key, limit, 1, name)

          ms = assert_delay(check_rates([{key, limit, 1}], name, max_wait_ms: 5_000), 500..1_000)
          booked = get_cost(key, 1, name)

          for call <- [
                fn -> wait_for_capacity(key, limit, 1, name, max_wait_ms: 10) end,
                fn -> check_rates([{key, limit, 1}], name, max_wait_ms: 10) end
              ] do
            assert {:error,
                    %Bourse.Error{
                      type: :rate_limit_exceeded,
                      exchange: "okx",
                      retry_after: remaining,
                      message: message
                    }} = call.()

            # The remaining wait of the booking, not a new booking behind it.
            assert remaining in 11..ms
            assert message == "okx: waiting #{remaining} ms exceeds max_wait_ms 10"
          end

          # Nothing more was paid, and the booking is still ours: claimed, not charged again.
          assert get_cost(key, 1, name) <= booked + 0.01
          assert {:delay, remaining} = check_rates([{key, limit, 1}], name, max_wait_ms: 5_000)
          Process.sleep(remaining)
          before = get_cost(key, 1, name)
          assert :ok = wait_for_capacity(key, limit, 1, name, max_wait_ms: 10)
          assert get_cost(key, 1, name) <= before + 0.01
        end

        test "max_wait_ms is at most 4_294_967_295; above is :invalid_parameters, nothing raises after paying",
             %{name: name} do
          # A wait of 10^10 ms: more than Process.sleep/1 accepts.
          slow = %{capacity: 1, refill_per_sec: 1.0e-7}
          key = {"ex", "slow"}

          for budget <- [4_294_967_296, 10 ** 11, 10 ** 400] do
            assert_invalid(wait_for_capacity(key, slow, 2, name, max_wait_ms: budget))
            assert_invalid(check_rates([{key, slow, 2}], name, max_wait_ms: budget))
          end

          assert get_cost(key, 1, name) == 0

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: retry}} =
                   wait_for_capacity(key, slow, 2, name, max_wait_ms: 4_294_967_295)

          assert retry > 4_294_967_295
          # Shorter by the time since: the refusal started the accrual.
          assert {:delay, ms} = check_rates([{key, slow, 2}], name, max_wait_ms: 4_294_967_295)
          assert ms > 4_294_967_295 and ms <= retry

          assert get_cost(key, 1, name) == 0
        end

        test "max_wait_ms: nil is :invalid_parameters, also for check_rates", %{name: name} do
          key = {"ex", "k"}
          assert_invalid(check_rates([{key, @still, 1}], name, max_wait_ms: nil))
          assert_invalid(check_rates([{key, @still, 1}], max_wait_ms: nil))
          assert_invalid(wait_for_capacity(key, @still, 1, name, max_wait_ms: nil))
          assert get_cost(key, 1, name) == 0
        end
      end

      describe "errors" do
        test "every error whose key could be read carries its exchange", %{name: name} do
          limit = %{capacity: 10, refill_per_sec: 1}
          other = %{capacity: 10, refill_per_sec: 2}

          for {label, call} <- [
                {"bad limit", fn -> check_rate({"okx", "k"}, %{capacity: -1}, 1, name) end},
                {"bad cost", fn -> check_rate({"okx", "k"}, limit, -1, name) end},
                {"bad credential", fn -> check_rate({"okx", 123}, limit, 1, name) end},
                {"bad axis", fn -> check_rate({"okx", "k", :ip}, limit, 1, name) end},
                {"conflicting definitions",
                 fn -> check_rates([{{"okx", "k"}, limit, 1}, {{"okx", "k"}, other, 1}], name) end},
                {"bad check after a good one",
                 fn -> check_rates([{{"okx", "k"}, limit, 1}, {{"okx", "j"}, %{}, 1}], name) end},
                {"bad budget (check_rates)",
                 fn -> check_rates([{{"okx", "k"}, limit, 1}], name, max_wait_ms: 0) end},
                {"bad budget (wait_for_capacity)",
                 fn -> wait_for_capacity({"okx", "k"}, limit, 1, name, max_wait_ms: 0) end},
                {"bad cost (wait_for_capacity)",
                 fn -> wait_for_capacity({"okx", "k"}, limit, :x, name, []) end},
                {"bad cost (record_request)", fn -> record_request({"okx", "k"}, -1, name) end},
                {"bad credential (get_cost)", fn -> get_cost({"okx", 1}, 1, name) end},
                {"bad credential (reset)", fn -> reset({"okx", 1}, name) end},
                {"bad duration (pause)", fn -> pause({"okx", "k"}, -1, name) end},
                {"bad duration (pause an exchange)", fn -> pause("okx", -1, name) end},
                {"bad name", fn -> check_rate({"okx", "k"}, limit, 1, "not a name") end}
              ] do
            assert {:error, %Bourse.Error{type: :invalid_parameters, exchange: exchange}} =
                     call.(),
                   label

            assert exchange == "okx", "#{label}: exchange #{inspect(exchange)}"
          end

          # Nothing to read: no exchange.
          assert {:error, %Bourse.Error{exchange: nil}} = check_rate(:key, limit, 1, name)
          assert {:error, %Bourse.Error{exchange: nil}} = check_rate({1, "k"}, limit, 1, name)
        end

        test "check_rates errors name the exchange of the check at fault, or of every check",
             %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 0.001}
          bad_limit = %{capacity: 0, refill_per_sec: 1}

          for {checks, exchange} <- [
                # The check at fault names its exchange, also one that is no check but
                # starts with a key.
                {[{{"okx", "k"}, limit, 1}, {{"bybit", "k"}, limit, -1}], "bybit"},
                {[{{"okx", "k"}, limit, 1}, {{"bybit", "k"}, limit}], "bybit"},
                {[{{"okx", "k", "ip"}, limit, 1, 2}], "okx"},
                # It names none that can be read: neither does the error.
                {[{{:okx, "k"}, limit, 1}, {{"bybit", "k"}, bad_limit, 1}], nil},
                {[{{"okx", "k"}, limit, 1}, {"bybit", limit}], nil},
                {[{{"okx", "k"}, limit, 1}, {{<<255>>, "k"}, limit}], nil},
                # An error about the whole call: the one exchange of every check.
                {List.duplicate({{"okx", "k"}, limit, 1}, 1025), "okx"},
                {[{{"okx", "k"}, limit, 1} | :tail], nil}
              ] do
            assert {:error, %Bourse.Error{type: :invalid_parameters, exchange: ^exchange}} =
                     check_rates(checks, name)
          end

          assert get_cost({"okx", "k"}, 1, name) == 0
        end

        test "over the budget: the message names the exchange, the wait and the budget",
             %{name: name} do
          # A fresh key of capacity 1 at 1/s: cost 2 waits exactly 1000 ms.
          limit = %{capacity: 1, refill_per_sec: 1}

          assert {:error,
                  %Bourse.Error{
                    type: :rate_limit_exceeded,
                    exchange: "okx",
                    retry_after: 1_000,
                    message: "okx: waiting 1000 ms exceeds max_wait_ms 40"
                  }} = wait_for_capacity({"okx", "k"}, limit, 2, name, max_wait_ms: 40)
        end

        @tag skip: Bourse.ContractTests.skip(@contract_skip, :several_exchanges)
        test "over the budget, checks of several exchanges: the message names them",
             %{name: name} do
          # A booking, come back for with a shorter budget: the first three are named.
          limit = %{capacity: 1, refill_per_sec: 1}
          exchanges = ["binance", "okx", "bybit", "kraken", "okx"]

          for {count, named} <- [{2, "binance, okx"}, {5, "binance, okx, bybit and 1 more"}] do
            checks =
              for exchange <- Enum.take(exchanges, count), do: {{exchange, "k#{count}"}, limit, 2}

            assert {:delay, ms} = check_rates(checks, name, max_wait_ms: 5_000)
            assert ms > 40

            assert {:error, %Bourse.Error{exchange: nil, message: message}} =
                     check_rates(checks, name, max_wait_ms: 40)

            assert message =~ ~r/^#{named}: waiting \d+ ms exceeds max_wait_ms 40$/
          end
        end

        test "messages describe a bad option or name by its type and size", %{name: name} do
          huge = :binary.copy("SECRET", 100_000)

          for call <- [
                fn -> check_rates([], name, max_wait_ms: huge) end,
                fn -> wait_for_capacity({"ex", "k"}, @still, 1, name, max_wait_ms: huge) end,
                fn -> check_rate({"ex", "k"}, @still, 1, huge) end,
                fn -> Bourse.RateLimiter.busiest(huge, name) end
              ] do
            assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} = call.()
            assert byte_size(message) < 300, message
            refute message =~ "SECRET"
          end
        end
      end
    end
  end
end
