defmodule Bourse.ContractTests.Supervision do
  @moduledoc false
  # docs/CONTRACT.md §6 and P6: start options, `child_spec/1`, `start_link/1`, a crash of the limiter process.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "start options" do
        @tag limiter_opts: [assume_busy_at_start: true]
        test "assume_busy_at_start: a bucket seen within its fill time starts as if empty at start",
             %{name: name} do
          # Fill time 100 s: first seen right after the start, the bucket is about empty.
          limit = %{capacity: 10, refill_per_sec: 0.1}
          assert {:delay, first} = check_rate({"ex", "k"}, limit, 1, name)
          assert first in 1..10_000
          # Refused, the key has no definition yet: nothing borrowed is known, and the next
          # check finds the bucket as empty as the first did.
          assert get_cost({"ex", "k"}, 1, name) == 0
          assert_delay(check_rate({"ex", "k"}, limit, 1, name), 1..first)

          # Fill time 10 ms: seen after it, the bucket is full.
          Process.sleep(20)
          fast = %{capacity: 5, refill_per_sec: 500}
          drain({"ex", "f"}, fast, 5, name)
        end

        @tag limiter_opts: [assume_busy_at_start: true]
        @tag skip: Bourse.ContractTests.skip(@contract_skip, :new_exchange_when_busy)
        test "assume_busy_at_start: a new exchange's bucket seen after its fill time starts full",
             %{name: name} do
          # Fill time 10 ms; on a shared store the exchange is new to it too.
          Process.sleep(50)
          exchange = "new#{System.unique_integer([:positive])}"
          drain({exchange, "f"}, %{capacity: 5, refill_per_sec: 500}, 5, name)
        end

        test "without assume_busy_at_start the same bucket starts full", %{name: name} do
          drain({"ex", "k"}, %{capacity: 10, refill_per_sec: 1}, 10, name)
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

      describe "end of the limiter process (P6)" do
        # A supervisor restarts a limiter with its siblings by stopping it (`:shutdown`); a
        # limiter may also be stopped and started again. Within 5 s the new one takes over.
        @tag skip: Bourse.ContractTests.skip(@contract_skip, :crash)
        test "restarted with its siblings: spent budget and pauses stay",
             %{limiter_opts: opts} do
          name = unique_name()
          sibling = :"#{name}_sibling"

          children = [
            {Bourse.RateLimiter, Keyword.put(opts, :name, name)},
            %{id: :sibling, start: {Agent, :start_link, [fn -> 0 end, [name: sibling]]}}
          ]

          supervisor =
            start_supervised!(%{
              id: :supervisor,
              start: {Supervisor, :start_link, [children, [strategy: :one_for_all]]},
              type: :supervisor
            })

          ended_with_pauses(name, fn -> Process.exit(Process.whereis(sibling), :kill) end)
          assert Process.alive?(supervisor)
        end

        @tag skip: Bourse.ContractTests.skip(@contract_skip, :crash)
        test "stopped and started again within 5 s: spent budget and pauses stay",
             %{limiter_opts: opts} do
          opts = Keyword.put(opts, :name, unique_name())
          {:ok, _} = Bourse.RateLimiter.start_link(opts)

          ended_with_pauses(opts[:name], fn ->
            GenServer.stop(opts[:name])
            {:ok, _} = Bourse.RateLimiter.start_link(opts)
          end)

          GenServer.stop(opts[:name])
        end
      end

      # Spends and pauses through `name`, runs `restart`, and finds both held by the limiter
      # running under `name` since.
      defp ended_with_pauses(name, restart) do
        limit = %{@still | capacity: 5}
        drain({"ex", "k"}, limit, 5, name)
        assert :ok = pause({"ex", "paused"}, 60_000, name)
        assert :ok = pause("banned", 60_000, name)
        before = limiter_pid(name)

        restart.()

        eventually(fn -> limiter_pid(name) not in [nil, before] end)
        assert_delay(check_rate({"ex", "k"}, limit, 1, name), 990_000..@one_token_ms)
        assert_about(get_cost({"ex", "k"}, 1, name), 5, 0.01)
        assert_delay(check_rate({"ex", "paused"}, limit, 1, name), 50_000..60_000)
        assert_delay(check_rate({"banned", "k"}, limit, 1, name), 50_000..60_000)
        assert :ok = check_rate({"ex", "fresh"}, limit, 1, name)
      end

      describe "child_spec/1 and start_link/1" do
        test "the child id is the name", %{backend: backend} do
          assert %{id: :some_limiter, start: {Bourse.RateLimiter, :start_link, [opts]}} =
                   Bourse.RateLimiter.child_spec(name: :some_limiter, backend: backend)

          assert opts[:name] == :some_limiter
          assert %{id: {:global, :g}} = Bourse.RateLimiter.child_spec(name: {:global, :g})
          assert %{id: Bourse.RateLimiter} = Bourse.RateLimiter.child_spec([])
        end

        test "child_spec/1 takes any term; start_link/1 answers bad options with its error" do
          for opts <- [:bad, %{}, %{name: :x}, [:name], "opts"] do
            assert %{id: Bourse.RateLimiter, start: {Bourse.RateLimiter, :start_link, [^opts]}} =
                     Bourse.RateLimiter.child_spec(opts)

            assert {:error, {%Bourse.Error{type: :invalid_parameters}, _child}} =
                     start_supervised({Bourse.RateLimiter, opts})
          end
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
                     Bourse.RateLimiter.start_link(
                       Keyword.merge([name: name, backend: backend], opts)
                     ),
                   "accepted #{inspect(opts)}"

            assert is_binary(message) and message != ""
            refute message =~ "more than once"
            assert Process.whereis(name) == nil
          end

          for opts <- [[:name], %{name: unique_name()}, "opts", [{"name", :x}]] do
            assert {:error, %Bourse.Error{type: :invalid_parameters}} =
                     Bourse.RateLimiter.start_link(opts)
          end
        end
      end

      defp unique_name, do: :"limiter_#{System.unique_integer([:positive])}"
    end
  end
end
