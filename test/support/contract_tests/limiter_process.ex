defmodule Bourse.ContractTests.LimiterProcess do
  @moduledoc false
  # docs/CONTRACT.md §8 "The limiter process": unknown messages, names of other processes, a stopped
  # limiter, unknown and out-of-range start options.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "the limiter process" do
        @describetag :capture_log

        test "unknown messages, casts and calls are logged and ignored",
             %{name: name, start_name: start_name} do
          pid = limiter_pid(start_name)
          assert :ok = check_rate({"ex", "k"}, @still, 1, name)

          log =
            ExUnit.CaptureLog.capture_log(fn ->
              send(pid, :cleanup)
              send(pid, {:sweep, "SECRET-KEY-IN-A-MESSAGE"})
              send(pid, {:EXIT, self(), :normal})
              send(pid, {:EXIT, self(), :boom})
              GenServer.cast(pid, {:bogus, "SECRET-KEY-IN-A-MESSAGE"})

              assert {:error, %Bourse.Error{type: :invalid_parameters}} =
                       GenServer.call(pid, {:bogus, "SECRET-KEY-IN-A-MESSAGE"})

              for run <- [{:run, :sweep, []}, {:run, :reset_all, [:extra]}, {:run, :reset, :x}] do
                assert {:error, %Bourse.Error{type: :invalid_parameters}} =
                         GenServer.call(pid, run)
              end

              # Calls of the right arity whose arguments no caller would send: answered,
              # the limiter lives on.
              for {fun, arity} <- Bourse.RateLimiter.Backend.behaviour_info(:callbacks),
                  fun not in [:options, :attach, :stats, :sweep, :reset_all],
                  bad <- [:garbage, "SECRET-KEY-IN-A-MESSAGE", {}] do
                run = {:run, fun, List.duplicate(bad, arity - 1)}
                answer = GenServer.call(pid, run)
                assert Process.alive?(pid), "#{fun}(#{inspect(bad)}) stopped the limiter"

                refute match?(
                         {:error, %Bourse.Error{type: type}} when type != :invalid_parameters,
                         answer
                       )
              end

              # Everything before it has been handled once a call is answered.
              assert is_map(Bourse.RateLimiter.stats(name))
            end)

          assert Process.alive?(pid)
          assert limiter_pid(start_name) == pid
          assert log =~ "ignored an unexpected message"
          refute log =~ "SECRET-KEY-IN-A-MESSAGE"
          assert_about(get_cost({"ex", "k"}, 1, name), 1, 0.01)
          assert :ok = check_rate({"ex", "k"}, @still, 1, name)
        end

        test "a pid or name of another process is :invalid_parameters; it is left alone",
             %{name: name} do
          id = System.unique_integer([:positive])
          registry = :"process_registry_#{id}"
          start_supervised!({Registry, keys: :unique, name: registry})
          agent_name = :"agent_#{id}"

          agent =
            start_supervised!(%{
              id: :agent,
              start: {Agent, :start_link, [fn -> :untouched end, [name: agent_name]]}
            })

          :yes = :global.register_name({:agent, id}, agent)
          {:ok, _} = Registry.register(registry, :me, nil)
          server = start_supervised!({Task, fn -> Process.sleep(:infinity) end}, id: :task)
          port = Port.open({:spawn, "cat"}, [:binary])
          port_name = :"port_#{id}"
          true = Process.register(port, port_name)

          others = [
            agent,
            agent_name,
            {agent_name, node()},
            {:global, {:agent, id}},
            {:via, Registry, {registry, :me}},
            server,
            self(),
            port_name,
            {port_name, node()}
          ]

          for other <- others, {label, call} <- every_call(other) do
            answer = call.()

            assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} = answer,
                   "#{label} with #{inspect(other)} answered #{inspect(answer)}"

            assert message =~ "not a limiter"
            assert Process.alive?(agent), "#{label} with #{inspect(other)} killed the Agent"
          end

          assert Agent.get(agent, & &1) == :untouched
          assert Process.alive?(server)
          assert Port.info(port)

          # A :via module that does not exist, or that cannot resolve names: refused too.
          for bad <- [{:via, NotAModule, :x}, {:via, :no_such_module, :x}, {:via, Registry, :x}] do
            for {label, call} <- every_call(bad) do
              assert {:error, %Bourse.Error{type: :invalid_parameters}} = call.(),
                     "#{label} with #{inspect(bad)}"
            end
          end

          # The limiter itself still answers, by name and by pid.
          assert :ok = check_rate({"ex", "k"}, @still, 1, name)
          assert :ok = check_rate({"ex", "k"}, @still, 1, GenServer.whereis(name))
        end

        test "a stopped limiter answers like one never started", %{backend: backend} do
          name = :"stopped_#{System.unique_integer([:positive])}"
          never = :"never_started_#{System.unique_integer([:positive])}"
          children = [{Bourse.RateLimiter, name: name, backend: backend}]
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          assert :ok = check_rate({"ex", "k"}, @still, 1, name)

          Supervisor.stop(supervisor)

          for {label, call} <- every_call(name) do
            assert {:noproc, _} = catch_exit(call.()), "#{label} after the stop"
          end

          for {label, call} <- every_call(never) do
            assert {:noproc, _} = catch_exit(call.()), "#{label} on a limiter never started"
          end

          # Nothing of it is left once a successor could no longer take its table over.
          eventually(
            fn -> :persistent_term.get({Bourse.RateLimiter, name}, nil) == nil end,
            15_000
          )
        end

        test "malformed input is answered as such also when the limiter is not running",
             %{name: name, backend: backend} do
          stopped = :"stopped_#{System.unique_integer([:positive])}"
          never = :"never_started_#{System.unique_integer([:positive])}"
          children = [{Bourse.RateLimiter, name: stopped, backend: backend}]
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          Supervisor.stop(supervisor)

          for {label, call} <- every_bad_call(name) do
            assert {:error, %Bourse.Error{type: :invalid_parameters} = running} = call.(name),
                   label

            for absent <- [stopped, never] do
              assert {:error, ^running} = call.(absent), "#{label} on #{inspect(absent)}"
            end
          end
        end

        test "a waiter whose limiter stops while it sleeps is admitted against its paid booking, once",
             %{backend: backend} do
          name = :"stopped_while_waiting_#{System.unique_integer([:positive])}"
          # A slack that a loaded machine's late wake-up stays within: the booking holds.
          children = [{Bourse.RateLimiter, name: name, backend: backend, booking_slack_ms: 5_000}]
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          # A token every 2 s: the next check comes within that, on a loaded machine too.
          limit = %{capacity: 1, refill_per_sec: 0.5}
          assert :ok = check_rate({"ex", "k"}, limit, 1, name)
          test = self()

          waiter =
            Task.async(fn ->
              waited = wait_for_capacity({"ex", "k"}, limit, 1, name, max_wait_ms: 5_000)
              admitted_at = System.monotonic_time(:millisecond)
              send(test, {:waited, waited})

              receive do
                :again ->
                  answer = check_rate({"ex", "k"}, limit, 1, name)
                  {answer, System.monotonic_time(:millisecond) - admitted_at}
              end
            end)

          eventually(fn -> Bourse.RateLimiter.inspect_key({"ex", "k"}, name).bookings == 1 end)
          Supervisor.stop(supervisor)

          # Neither an exit nor an :unavailable refusal after paying.
          assert_receive {:waited, :ok}, 8_000

          # Started again, the limiter takes its table back, the booking in it: the waiter
          # was admitted against it already, and its next check pays (unless a token came
          # back meanwhile).
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          send(waiter.pid, :again)

          case Task.await(waiter) do
            {{:delay, _}, _since_ms} -> :ok
            {:ok, since_ms} -> assert since_ms >= 2_000, "admitted again after #{since_ms} ms"
          end

          Supervisor.stop(supervisor)
        end

        test "a waiter whose limiter stops while it sleeps is not admitted before a pause recorded since ends",
             %{backend: backend} do
          name = :"paused_while_waiting_#{System.unique_integer([:positive])}"
          children = [{Bourse.RateLimiter, name: name, backend: backend, booking_slack_ms: 5_000}]
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          # Ready in 2 s: the pause and the stop come before, on a loaded machine too.
          limit = %{capacity: 1, refill_per_sec: 0.5}
          assert :ok = check_rate({"ex", "k"}, limit, 1, name)

          waiter =
            Task.async(fn ->
              answer = wait_for_capacity({"ex", "k"}, limit, 1, name, max_wait_ms: 8_000)
              {answer, System.monotonic_time(:millisecond)}
            end)

          eventually(fn -> Bourse.RateLimiter.inspect_key({"ex", "k"}, name).bookings == 1 end)
          # The pause holds the booking to its end, past its ready time.
          pause_ends = System.monotonic_time(:millisecond) + 4_000
          assert :ok = Bourse.RateLimiter.pause({"ex", "k"}, 4_000, name)
          Supervisor.stop(supervisor)

          # Admitted only by a table that still answers (the NIF's), once the pause ended;
          # else refused, its booking in the store it could not ask.
          case Task.await(waiter, 10_000) do
            {:ok, at} -> assert at >= pause_ends
            {answer, _at} -> assert {:error, %Bourse.Error{type: :unavailable}} = answer
          end
        end

        test "a killed limiter that is not restarted answers like one never started",
             %{backend: backend} do
          name = :"killed_#{System.unique_integer([:positive])}"
          {:ok, pid} = Bourse.RateLimiter.start_link(name: name, backend: backend)
          Process.unlink(pid)
          assert :ok = check_rate({"ex", "k"}, @still, 1, name)
          ref = Process.monitor(pid)
          Process.exit(pid, :kill)
          assert_receive {:DOWN, ^ref, :process, ^pid, :killed}, 5_000

          for {label, call} <- every_call(name) do
            assert {:noproc, _} = catch_exit(call.()), "#{label} after the kill"
          end

          eventually(
            fn -> :persistent_term.get({Bourse.RateLimiter, name}, nil) == nil end,
            15_000
          )
        end

        test "a limiter started again soon under the name of a stopped one keeps its spent tokens",
             %{backend: backend} do
          name = :"restarted_#{System.unique_integer([:positive])}"
          limit = %{@still | capacity: 2}
          children = [{Bourse.RateLimiter, name: name, backend: backend}]
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          drain({"ex", "k"}, limit, 2, name)
          Supervisor.stop(supervisor)

          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          assert {:delay, _} = check_rate({"ex", "k"}, limit, 1, name)
          Supervisor.stop(supervisor)
        end

        test "unknown and out-of-range start options are refused, naming the option",
             %{backend: backend} do
          name = :"refused_#{System.unique_integer([:positive])}"

          for {opts, named} <- [
                {[backned: :port], ":backned"},
                {[name_: :x], ":name_"},
                {[max_wait_ms: 100], ":max_wait_ms"},
                {[booking_slack_ms: 10 ** 30], "booking_slack_ms"},
                {[booking_slack_ms: 86_400_001], "booking_slack_ms"},
                {[sweep_interval_ms: 10 ** 30], "sweep_interval_ms"},
                {[on_event: fn -> :ok end], "on_event"}
              ] do
            assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
                     Bourse.RateLimiter.start_link([name: name, backend: backend] ++ opts),
                   "accepted #{inspect(opts)}"

            assert message =~ named
            assert Process.whereis(name) == nil
          end

          # A :via module that cannot look the name up: refused, the caller unharmed.
          for {via, module} <- [
                {{:via, NotAModule, :x}, "NotAModule"},
                {{:via, :erlang, :x}, ":erlang"},
                {{:via, Registry, :x}, "Registry"},
                {{:via, Bourse.ContractTests.OnlyWhereis, :x}, "Bourse.ContractTests.OnlyWhereis"}
              ] do
            assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
                     Bourse.RateLimiter.start_link(name: via, backend: backend)

            assert message =~ "{:via, #{module}, term}"
          end

          # A bad value is described, not printed whole.
          assert {:error, %Bourse.Error{message: message}} =
                   Bourse.RateLimiter.start_link(name: String.duplicate("k", 10_000))

          assert byte_size(message) < 200
        end
      end

      # Public calls of `Bourse.RateLimiter` with a malformed argument, for a limiter name.
      defp every_bad_call(name) do
        key = {"ex", "k"}

        [
          {"check_rate with a name for the cost",
           fn name -> Bourse.RateLimiter.check_rate(key, @still, name) end},
          {"check_rate", fn name -> check_rate(key, @still, -1, name) end},
          {"check_rates", fn name -> check_rates([{key, %{capacity: 0}, 1}], name) end},
          {"check_rates with a budget",
           fn name -> check_rates([{key, @still, 1}], name, max_wait_ms: 0) end},
          {"wait_for_capacity", fn name -> wait_for_capacity({"ex"}, @still, 1, name, []) end},
          {"bucket", fn name -> Bourse.RateLimiter.bucket(key, %{requests: -1}, name) end},
          {"get_cost", fn name -> get_cost({:ex, "k"}, 1, name) end},
          {"record_request", fn name -> record_request(key, :nan, name) end},
          {"reset", fn name -> reset({"ex", 1}, name) end},
          {"reset_exchange", fn name -> reset_exchange(7, name) end},
          {"pause", fn name -> pause("ex", -10, name) end},
          {"inspect_key", fn name -> Bourse.RateLimiter.inspect_key({"ex", 1, 2}, name) end},
          {"sync", fn name -> Bourse.RateLimiter.sync(key, :five, 1_000, name) end}
        ]
      end

      # Every public call of `Bourse.RateLimiter` on the limiter `name`.
      defp every_call(name) do
        key = {"ex", "k"}

        [
          {"check_rate", fn -> check_rate(key, @still, 1, name) end},
          {"check_rates", fn -> check_rates([{key, @still, 1}], name) end},
          {"check_rates with a budget",
           fn -> check_rates([{key, @still, 1}], name, max_wait_ms: 10) end},
          {"wait_for_capacity", fn -> wait_for_capacity(key, @still, 1, name, []) end},
          {"get_cost", fn -> get_cost(key, 1, name) end},
          {"record_request", fn -> record_request(key, 1, name) end},
          {"reset", fn -> reset(key, name) end},
          {"reset_exchange", fn -> reset_exchange("ex", name) end},
          {"reset_all", fn -> reset_all(name) end},
          {"pause", fn -> pause("ex", 10, name) end},
          {"stats", fn -> Bourse.RateLimiter.stats(name) end},
          {"busiest", fn -> Bourse.RateLimiter.busiest(5, name) end},
          {"inspect_key", fn -> Bourse.RateLimiter.inspect_key(key, name) end},
          {"sync", fn -> Bourse.RateLimiter.sync(key, 5, 1_000, name) end},
          {"observe_response 500",
           fn -> Bourse.RateLimiter.observe_response("ex", "k", 500, [], name) end},
          {"observe_response 429",
           fn -> Bourse.RateLimiter.observe_response("ex", "k", 429, [], name) end}
        ]
      end
    end
  end
end

defmodule Bourse.ContractTests.OnlyWhereis do
  @moduledoc false
  # A `:via` module that looks names up but cannot register them.
  def whereis_name(_name), do: :undefined
end
