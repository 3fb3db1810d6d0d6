defmodule Bourse.ContractTests.Malformed do
  @moduledoc false
  # P5: malformed input is `:invalid_parameters`, pays nothing, crashes nothing.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
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

        @tag timeout: 300_000
        test "#{@fuzz_calls} random malformed calls: each :invalid_parameters, then correct answers",
             %{name: name, start_name: start_name} do
          probe = {"probe", "k", "request"}
          assert :ok = check_rate(probe, @still, 1, name)
          spent = get_cost(probe, 1, name)
          started = now_ms()
          # What the probe refilled since, when the calls take long (a loaded machine).
          refilled = fn -> (now_ms() - started) / 1000 * @still.refill_per_sec end
          pid = limiter_pid(start_name)
          seed = ExUnit.configuration()[:seed]

          # In rounds, each followed by correct answers on the probe.
          for round <- 1..10 do
            count = div(@fuzz_calls, 10)
            calls = Bourse.Fuzz.calls(name, probe, @still, count, seed + round)
            failures = failing_malformed(calls)

            assert failures == [],
                   "seed #{seed + round}: #{length(failures)} of #{length(calls)} calls were " <>
                     "not answered with :invalid_parameters:\n" <>
                     Enum.map_join(Enum.take(failures, 20), "\n", fn {label, got} ->
                       "  #{label}: #{got}"
                     end)

            assert Process.alive?(pid), "the limiter process died"
            assert limiter_pid(start_name) == pid, "the limiter process was restarted"
            assert_about(get_cost(probe, 1, name), spent, 0.01 + refilled.())
            # A fresh key's delay is exact: (2 - 1) / 10 s.
            fresh = {"fresh", "round #{round}"}
            assert {:delay, 100} = check_rate(fresh, %{capacity: 1, refill_per_sec: 10}, 2, name)
          end

          assert :ok = check_rate(probe, @still, 1, name)
          assert_about(get_cost(probe, 1, name), spent + 1, 0.01 + refilled.())
        end
      end
    end
  end
end
