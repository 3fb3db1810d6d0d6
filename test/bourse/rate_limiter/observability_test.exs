defmodule Bourse.RateLimiter.ObservabilityTest do
  use ExUnit.Case, async: true

  import ExUnit.CaptureLog

  alias Bourse.{Error, Fingerprint, RateLimiter}
  alias Bourse.RateLimiter.Events

  @credential "obs-api-key"
  @key {"binance", @credential, "ip"}
  @slow %{capacity: 2, refill_per_sec: 0.001}

  setup context do
    name = :"observability_#{System.unique_integer([:positive])}"
    test = self()
    on_event = fn event, measurements, metadata -> send(test, {event, measurements, metadata}) end
    opts = [name: name, on_event: on_event] ++ Map.get(context, :limiter_opts, [])
    start_supervised!({RateLimiter, opts})
    %{name: name}
  end

  describe "inspect_key/2" do
    test "describes a bucket, nil for an unknown key", %{name: name} do
      assert RateLimiter.inspect_key(@key, name) == nil
      assert :ok = RateLimiter.check_rate(@key, @slow, 1, name)

      assert %{
               limit: %{capacity: 2.0, refill_per_sec: 0.001},
               tokens: tokens,
               borrowed: borrowed,
               debt: +0.0,
               bookings: 0,
               booked_cost: +0.0,
               next_ready_ms: nil,
               pause_ms: nil
             } = RateLimiter.inspect_key(@key, name)

      assert_in_delta tokens, 1.0, 0.01
      assert_in_delta borrowed, 1.0, 0.01
    end

    test "a two-element key is the request axis", %{name: name} do
      assert :ok = RateLimiter.check_rate({"okx", :public}, @slow, 2, name)
      assert %{tokens: tokens} = RateLimiter.inspect_key({"okx", :public, "request"}, name)
      assert_in_delta tokens, 0.0, 0.01
    end

    test "shows bookings, debt and pauses", %{name: name} do
      drained_at = System.monotonic_time(:millisecond)
      assert :ok = RateLimiter.check_rate(@key, %{capacity: 1, refill_per_sec: 1}, 1, name)

      assert {:delay, _} =
               RateLimiter.check_rates([{@key, %{capacity: 1, refill_per_sec: 1}, 1}], name,
                 max_wait_ms: 5_000
               )

      assert %{bookings: 1, booked_cost: 1.0, next_ready_ms: ready, debt: debt} =
               RateLimiter.inspect_key(@key, name)

      assert ready in 1..1_000
      # The booked token, less what refilled (1 a second) since the bucket was drained.
      refilled = (System.monotonic_time(:millisecond) - drained_at) / 1000
      assert debt <= 1.01 and debt >= 1.0 - refilled - 0.01, "debt #{debt}"

      assert :ok = RateLimiter.pause({"binance", @credential}, 60_000, name)
      assert %{pause_ms: pause} = RateLimiter.inspect_key(@key, name)
      assert pause in 50_000..60_000

      assert :ok = RateLimiter.record_request({"kraken", :public}, 3, name)
      assert %{limit: nil, debt: 3.0} = RateLimiter.inspect_key({"kraken", :public}, name)
    end

    test "malformed keys are invalid_parameters", %{name: name} do
      for key <- [{"binance"}, {"binance", 1, "ip"}, "binance", {:binance, :public}] do
        assert {:error, %Error{type: :invalid_parameters}} = RateLimiter.inspect_key(key, name)
      end
    end
  end

  describe "stats/1" do
    test "counts outcomes since start and what is live now", %{name: name} do
      assert %{admitted: 0, buckets: 0, bookings: 0, event_failures: 0} = RateLimiter.stats(name)

      assert :ok = RateLimiter.check_rate(@key, @slow, 2, name)
      assert {:delay, _} = RateLimiter.check_rate(@key, @slow, 1, name)
      assert {:delay, _} = RateLimiter.check_rates([{@key, @slow, 1}], name, max_wait_ms: 100)

      other = {"binance", :public, "ip"}
      assert :ok = RateLimiter.check_rate(other, %{capacity: 1, refill_per_sec: 1}, 1, name)

      assert {:delay, _} =
               RateLimiter.check_rates([{other, %{capacity: 1, refill_per_sec: 1}, 1}], name,
                 max_wait_ms: 5_000
               )

      assert :ok = RateLimiter.record_request(@key, 1, name)

      assert {:error, _} =
               RateLimiter.check_rate(@key, %{capacity: -1, refill_per_sec: 1}, 1, name)

      assert {:error, _} = RateLimiter.wait_for_capacity(@key, @slow, 1, name, max_wait_ms: 0)
      assert {:error, _} = RateLimiter.busiest(0, name)

      assert %{
               admitted: 2,
               delayed: 1,
               over_budget: 1,
               booked: 1,
               claimed: 0,
               debited: 1,
               invalid: 3,
               buckets: 2,
               bookings: 1,
               lapsed: 0,
               paused: 0,
               event_failures: 0
             } = RateLimiter.stats(name)
    end

    test "counts answers held back by a pause", %{name: name} do
      assert :ok = RateLimiter.pause("binance", 60_000, name)
      assert {:delay, _} = RateLimiter.check_rate(@key, @slow, 1, name)
      assert %{paused: 1, delayed: 1} = RateLimiter.stats(name)
    end

    test "an unknown limiter exits like a GenServer call" do
      assert catch_exit(RateLimiter.stats(:no_such_limiter)) |> elem(0) == :noproc
    end
  end

  describe "busiest/2" do
    test "lists the busiest keys first, with fingerprints", %{name: name} do
      assert :ok = RateLimiter.check_rate(@key, @slow, 2, name)
      assert :ok = RateLimiter.check_rate({"binance", :public}, @slow, 1, name)

      assert :ok =
               RateLimiter.check_rate(
                 {"okx", "idle"},
                 %{capacity: 1.0e6, refill_per_sec: 1.0e6},
                 1,
                 name
               )

      assert [first, second] = RateLimiter.busiest(5, name) |> Enum.take(2)

      assert %{exchange: "binance", credential: credential, axis: "ip", bookings: 0} = first
      assert credential == Fingerprint.of(@credential)
      assert %{exchange: "binance", credential: :public, axis: "request"} = second
      assert [%{exchange: "binance", axis: "ip"}] = RateLimiter.busiest(1, name)
    end

    test "rejects a bad count", %{name: name} do
      for count <- [0, -1, 10_001, 1.5, "10", nil] do
        assert {:error, %Error{type: :invalid_parameters}} = RateLimiter.busiest(count, name)
      end
    end
  end

  describe "events" do
    test "the :ok path emits nothing", %{name: name} do
      assert :ok = RateLimiter.check_rate(@key, @slow, 1, name)
      assert :ok = RateLimiter.check_rates([{@key, @slow, 1}], name)
      assert :ok = RateLimiter.wait_for_capacity({"okx", :public}, @slow, 1, name)
      refute_received {_, _, _}
    end

    test "a refused probe", %{name: name} do
      assert :ok = RateLimiter.check_rate(@key, @slow, 2, name)
      assert {:delay, ms} = RateLimiter.check_rate(@key, @slow, 1, name)
      fingerprint = Fingerprint.of(@credential)

      assert_received {[:bourse, :rate_limiter, :refused], %{delay_ms: ^ms},
                       %{
                         limiter: ^name,
                         exchange: "binance",
                         credential: ^fingerprint,
                         axis: "ip",
                         cost: 1,
                         reason: :delay,
                         max_wait_ms: nil
                       }}
    end

    test "a waiter over its budget", %{name: name} do
      assert :ok = RateLimiter.check_rate(@key, @slow, 2, name)

      assert {:error, %Error{type: :rate_limit_exceeded, retry_after: ms}} =
               RateLimiter.wait_for_capacity(@key, @slow, 1, name, max_wait_ms: 10)

      assert_received {[:bourse, :rate_limiter, :refused], %{delay_ms: ^ms},
                       %{reason: :over_budget, max_wait_ms: 10, axis: "ip"}}
    end

    # A token refills in 1 s: the call still books when a loaded machine is slow between them.
    test "wait_for_capacity books, sleeps and reports the wait", %{name: name} do
      limit = %{capacity: 1, refill_per_sec: 1}
      assert :ok = RateLimiter.check_rate(@key, limit, 1, name)
      assert :ok = RateLimiter.wait_for_capacity(@key, limit, 1, name)

      assert_received {[:bourse, :rate_limiter, :booked], %{delay_ms: delay},
                       %{exchange: "binance", axis: "ip", cost: 1}}

      assert_received {[:bourse, :rate_limiter, :admitted_after_wait], %{waited_ms: waited},
                       %{exchange: "binance", axis: "ip", cost: 1}}

      assert delay in 1..1_000
      assert waited >= delay - 1
    end

    test "check_rates describes every check", %{name: name} do
      public = {"binance", :public, "ip"}
      assert :ok = RateLimiter.check_rate(public, @slow, 2, name)

      assert {:delay, _} =
               RateLimiter.check_rates(
                 [{@key, @slow, 1}, {public, @slow, 1}, {@key, nil, 5}],
                 name
               )

      fingerprint = Fingerprint.of(@credential)

      assert_received {[:bourse, :rate_limiter, :refused], _,
                       %{
                         exchange: "binance",
                         credential: nil,
                         axis: "ip",
                         cost: 2,
                         reason: :delay,
                         checks: [
                           %{credential: ^fingerprint, cost: 1},
                           %{credential: :public, cost: 1}
                         ]
                       }}

      assert {:delay, ms} =
               RateLimiter.check_rates([{public, @slow, 1}], name, max_wait_ms: 10_000_000)

      assert_received {[:bourse, :rate_limiter, :booked], %{delay_ms: ^ms},
                       %{credential: :public}}
    end

    test "pause/3", %{name: name} do
      fingerprint = Fingerprint.of(@credential)
      assert :ok = RateLimiter.pause({"binance", @credential}, 1_500, name)

      assert_received {[:bourse, :rate_limiter, :paused], %{ms: 1_500},
                       %{exchange: "binance", credential: ^fingerprint, axis: nil}}

      assert :ok = RateLimiter.pause("okx", 10, name)

      assert_received {[:bourse, :rate_limiter, :paused], %{ms: 10},
                       %{exchange: "okx", credential: nil}}

      assert :ok = RateLimiter.pause(@key, 10, name)

      assert_received {[:bourse, :rate_limiter, :paused], _,
                       %{axis: "ip", credential: ^fingerprint}}

      assert {:error, _} = RateLimiter.pause({"okx", :public}, -1, name)
      refute_received {[:bourse, :rate_limiter, :paused], _, _}
    end

    # A token refills in 1 s: the second call books even when a loaded machine is slow.
    @tag limiter_opts: [booking_slack_ms: 0, sweep_interval_ms: 20]
    test "lapsed bookings are reported by the sweep", %{name: name} do
      limit = %{capacity: 1, refill_per_sec: 1}
      assert :ok = RateLimiter.check_rate(@key, limit, 1, name)
      assert {:delay, _} = RateLimiter.check_rates([{@key, limit, 1}], name, max_wait_ms: 5_000)
      assert_receive {[:bourse, :rate_limiter, :lapsed], %{count: 1}, metadata}, 10_000
      assert metadata == %{limiter: name}
      assert %{lapsed: 1} = RateLimiter.stats(name)
    end

    test "Events.emit/4 fingerprints credentials it is given", %{name: name} do
      fingerprint = Fingerprint.of(@credential)

      assert :ok =
               Events.emit(name, :rate_limited, %{retry_after_ms: 2_000}, %{
                 key: {"binance", @credential},
                 http_status: 429
               })

      assert_received {[:bourse, :rate_limiter, :rate_limited], %{retry_after_ms: 2_000},
                       %{
                         limiter: ^name,
                         exchange: "binance",
                         credential: ^fingerprint,
                         axis: "request",
                         http_status: 429
                       }}

      assert :ok = Events.emit(name, :rate_limited, %{}, fn -> %{credential: @credential} end)
      assert_received {_, %{}, %{credential: ^fingerprint}}

      # An API key that looks like a fingerprint is no exception.
      assert :ok = Events.emit(name, :rate_limited, %{}, %{credential: fingerprint})
      shown = Fingerprint.of(fingerprint)
      assert shown != fingerprint
      assert_received {_, %{}, %{credential: ^shown}}

      assert :ok = Events.emit(:no_such_limiter, :rate_limited, %{}, %{})
    end

    test "a {module, function, args} callback gets the extra arguments" do
      name = :"observability_mfa_#{System.unique_integer([:positive])}"

      start_supervised!({RateLimiter, name: name, on_event: {__MODULE__, :forward, [self()]}},
        id: :mfa
      )

      assert :ok = RateLimiter.pause("okx", 5, name)

      assert_received {:forwarded, [:bourse, :rate_limiter, :paused], %{ms: 5},
                       %{exchange: "okx"}}
    end

    test "a callback that raises does not break the caller and is logged once" do
      name = :"observability_raise_#{System.unique_integer([:positive])}"
      on_event = fn _, _, metadata -> raise "handler failed on #{inspect(metadata)}" end
      start_supervised!({RateLimiter, name: name, on_event: on_event}, id: :raising)

      log =
        capture_log(fn ->
          for _ <- 1..3, do: assert(:ok = RateLimiter.pause(@key, 5, name))
        end)

      assert log =~ "the :on_event callback failed"
      assert log =~ Fingerprint.of(@credential)
      assert length(String.split(log, "the :on_event callback failed")) == 2
      assert %{event_failures: 3} = RateLimiter.stats(name)
    end

    test "a bad :on_event is invalid_parameters" do
      for bad <- [fn -> :ok end, {:m, :f}, "callback", {"m", :f, []}] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 RateLimiter.start_link(name: :never_started, on_event: bad)

        assert message =~ "on_event"
      end
    end

    test "events and counters survive a restart of the limiter's process", %{name: name} do
      assert {:error, _} = RateLimiter.check_rates([{@key, @slow, 1}], name, max_wait_ms: 0)
      pid = GenServer.whereis(name)
      Process.exit(pid, :kill)
      wait_for_restart(name, pid)
      assert %{invalid: 1} = RateLimiter.stats(name)
      assert :ok = RateLimiter.pause("okx", 5, name)
      assert_received {[:bourse, :rate_limiter, :paused], _, _}
    end

    test "limiters reached through their process emit from the caller's node" do
      name = {:global, {:observability, System.unique_integer([:positive])}}
      test = self()

      start_supervised!(
        {RateLimiter, name: name, on_event: fn e, m, md -> send(test, {:remote, e, m, md}) end},
        id: :global
      )

      assert :ok = RateLimiter.check_rate(@key, @slow, 2, name)
      assert {:delay, _} = RateLimiter.check_rate(@key, @slow, 1, name)
      fingerprint = Fingerprint.of(@credential)

      assert_receive {:remote, [:bourse, :rate_limiter, :refused], _,
                      %{credential: ^fingerprint, limiter: ^name}}

      assert {:error, _} = RateLimiter.check_rates([], name, max_wait_ms: -5)
      assert %{admitted: 1, delayed: 1, invalid: 1} = RateLimiter.stats(name)
      assert [%{credential: ^fingerprint}] = RateLimiter.busiest(3, name)
      assert %{bookings: 0} = RateLimiter.inspect_key(@key, name)
    end
  end

  @doc false
  def forward(event, measurements, metadata, test),
    do: send(test, {:forwarded, event, measurements, metadata})

  defp wait_for_restart(name, old_pid) do
    case GenServer.whereis(name) do
      pid when is_pid(pid) and pid != old_pid ->
        :ok

      _ ->
        Process.sleep(5)
        wait_for_restart(name, old_pid)
    end
  end
end

defmodule Bourse.RateLimiter.TelemetryStandInTest do
  # Not async: the stand-in `:telemetry` module below is global while it exists. It
  # passes on the events of this test's two limiters only: limiters of other tests, still
  # running or winding down, may emit while it exists.
  use ExUnit.Case, async: false

  alias Bourse.RateLimiter

  describe "telemetry" do
    # `:telemetry` is not a dependency; a stand-in module of that name proves the limiter
    # calls it when it is loadable at start, and not otherwise.
    test "events go to :telemetry.execute/3 when it is loaded at start" do
      Process.register(self(), :bourse_telemetry_test)
      name = :"observability_telemetry_#{System.unique_integer([:positive])}"
      without = :"#{name}_without"

      Code.compile_string("""
      defmodule :telemetry do
        def execute(event, measurements, metadata) do
          pid = Process.whereis(:bourse_telemetry_test)

          if pid && metadata[:limiter] in #{inspect([name, without])},
            do: send(pid, {:telemetry, event, measurements, metadata})
        end
      end
      """)

      try do
        start_supervised!({RateLimiter, name: name}, id: :telemetry)
        assert :ok = RateLimiter.pause("okx", 7, name)

        assert_received {:telemetry, [:bourse, :rate_limiter, :paused], %{ms: 7},
                         %{exchange: "okx", limiter: ^name}}
      after
        :code.purge(:telemetry)
        :code.delete(:telemetry)
        :code.purge(:telemetry)
      end

      stop_supervised!(:telemetry)
      start_supervised!({RateLimiter, name: without}, id: :no_telemetry)
      assert :ok = RateLimiter.pause("okx", 7, without)
      refute_received {:telemetry, _, _, _}
    end
  end
end
