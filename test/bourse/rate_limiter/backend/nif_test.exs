defmodule Bourse.RateLimiter.Backend.NIFTest do
  # The NIF's answers to malformed input: the core's rules and messages, in Elixir syntax,
  # bounded in size, with the exchange id when it could be read.
  use ExUnit.Case, async: true

  alias Bourse.RateLimiter.Backend.NIF

  @limit %{capacity: 10, refill_per_sec: 10}
  @key {"binance", "api-key", "request"}

  setup do
    {:ok, table} = NIF.attach(nil, assume_busy_at_start: false, booking_slack_ms: 250)
    %{table: table}
  end

  defp invalid(answer) do
    assert {:error, %Bourse.Error{type: :invalid_parameters} = error} = answer
    error
  end

  test "a bad value is described by its type and size, never printed", %{table: t} do
    huge = :binary.copy("s", 10 * 1024 * 1024)
    error = invalid(NIF.check_rate(t, self(), @key, @limit, huge, nil))

    assert error.message ==
             "cost must be a finite number >= 0 and at most 1.0e12, got a binary of 10485760 bytes"

    assert error.exchange == "binance"

    assert invalid(NIF.check_rate(t, self(), {:binance, "k"}, @limit, 1, nil)).message ==
             "exchange_id must be a UTF-8 binary of at most 1024 bytes, got an atom"

    error = invalid(NIF.check_rate(t, self(), {"binance", <<"k", 0xFF>>}, @limit, 1, nil))

    assert error.message ==
             "credential_key must be :public or a UTF-8 binary of at most 1024 bytes, " <>
               "got a binary of 2 bytes that is not UTF-8"

    assert error.exchange == "binance"

    error = invalid(NIF.check_rate(t, self(), @key, %{foo: 1}, 1, nil))
    assert error.message =~ ~r/or nil, got a map of 1 key other than :capacity, .* and :period$/
    assert error.exchange == "binance"

    assert invalid(NIF.check_rate(t, self(), @key, @limit, -1, nil)).message =~ ~r/got -1$/
    assert invalid(NIF.check_rate(t, self(), @key, @limit, -0.5, nil)).message =~ ~r/got -0.5$/

    assert invalid(NIF.check_rate(t, self(), @key, @limit, 10 ** 400, nil)).message =~
             "outside the signed 64-bit range"

    assert invalid(NIF.check_rate(t, self(), @key, @limit, 1.0e13, nil)).message =~
             inspect(1.0e13)
  end

  test "a credential never appears in a message", %{table: t} do
    secret = "secret-" <> :binary.copy("x", 2000)

    for answer <- [
          NIF.check_rate(t, self(), {"binance", secret}, @limit, 1, nil),
          NIF.check_rate(t, self(), {"binance", "secret-key", secret}, @limit, 1, nil),
          NIF.check_rate(t, self(), {"binance", "secret-key", :axis}, @limit, 1, nil),
          NIF.check_rate(t, self(), {"binance", "secret-key", "request", 4}, @limit, 1, nil),
          NIF.check_rates(t, self(), [{{"binance", "secret-key"}, @limit}], nil),
          NIF.record_request(t, {"binance", "secret-key"}, "secret-key"),
          NIF.pause(t, {"binance", "secret-key"}, "secret-key")
        ] do
      error = invalid(answer)
      refute error.message =~ "secret"
      assert byte_size(error.message) < 200
    end
  end

  test "conflicting definitions are written as Elixir maps and name the exchange", %{table: t} do
    checks = [{@key, @limit, 1}, {@key, %{capacity: 5, refill_per_sec: 1}, 1}]
    error = invalid(NIF.check_rates(t, self(), checks, nil))

    assert error.message ==
             "conflicting bucket definitions for one key in a single check: " <>
               "%{capacity: 10.0, refill_per_sec: 10.0} and %{capacity: 5.0, refill_per_sec: 1.0}"

    assert error.exchange == "binance"
  end

  test "check lists are bounded before they are walked", %{table: t} do
    long = List.duplicate({@key, @limit, 1}, 2_000_000)
    error = invalid(NIF.check_rates(t, self(), long, nil))
    assert error.message =~ "got a list of more than 1024 elements"

    assert invalid(NIF.check_rates(t, self(), [{@key, @limit, 1} | :tail], nil)).message =~
             "got an improper list"

    assert invalid(NIF.check_rates(t, self(), [{@key, @limit}], nil)).message ==
             "each check must be {key, limit, cost} or {bucket, cost}, got a tuple of 2 elements"

    assert :ok = NIF.check_rates(t, self(), List.duplicate({@key, @limit, 0}, 1024), nil)
  end

  test "budgets, pauses and windows are bounded", %{table: t} do
    assert invalid(NIF.check_rate(t, self(), @key, @limit, 1, 4_294_967_296)).message ==
             "max_wait_ms must be an integer from 1 to 4294967295, got 4294967296"

    assert {:booked, _} = NIF.check_rate(t, self(), @key, @limit, 20, 4_294_967_295)
    assert invalid(NIF.pause(t, "binance", 4_294_967_296)).exchange == "binance"
    assert invalid(NIF.sync(t, @key, 1, -1)).message =~ "window_left_ms must be an integer"
    assert invalid(NIF.sync(t, @key, :nan, 0)).message =~ "got an atom"
    assert invalid(NIF.busiest(t, 10_001)).message =~ "count must be an integer from 1 to 10000"
  end

  describe "prepared buckets" do
    test "are checked in the table given, as their key and limit in another", %{table: t} do
      {:ok, other} = NIF.attach(nil, assume_busy_at_start: false, booking_slack_ms: 250)
      # Refilling 1 token in 1,000 s: what a loaded machine's delays refill stays far below 0.1.
      slow = %{capacity: 10, refill_per_sec: 0.001}
      bucket = NIF.prepare(t, @key, slow)
      assert is_reference(bucket)
      assert :ok = NIF.check_prepared(t, self(), bucket, 4, nil)
      assert :ok = NIF.check_prepared(other, self(), bucket, 3, nil)
      assert_in_delta(NIF.get_cost(t, @key), 4, 0.1)
      assert_in_delta(NIF.get_cost(other, @key), 3, 0.1)
      assert NIF.prepare(t, @key, nil) == nil

      assert invalid(NIF.prepare(t, @key, %{capacity: 0, refill_per_sec: 1})).exchange ==
               "binance"
    end

    test "what is not a bucket is refused, never trusted", %{table: t} do
      assert invalid(NIF.check_rates(t, self(), [{%{prepared: make_ref()}, 1}], nil)).message ==
               "each check must be {key, limit, cost} or {bucket, cost}, got a tuple of 2 elements"

      forged =
        struct!(Bourse.RateLimiter.Bucket, name: nil, key: :k, limit: nil, route: nil, prepared: t)

      assert invalid(NIF.check_rates(t, self(), [{forged, 1}], nil)).message =~
               "key must be {exchange_id, credential_key, bucket_axis}"

      # A reference that is no prepared bucket (here, the table's) is not taken for one.
      assert NIF.check_prepared(t, self(), t, 1, nil) == :not_prepared
      assert NIF.check_prepared(t, self(), make_ref(), 1, nil) == :not_prepared
    end
  end

  describe "long check lists" do
    # A list longer than the NIF answers inline continues on a dirty scheduler, so that no
    # normal scheduler is held for its whole walk (docs/CONTRACT.md §8, "Cost of bad input").
    @inline Bourse.Native.bound(:max_inline_checks)
    @max Bourse.Native.bound(:max_checks)
    # Nothing accrues during the test.
    @still %{capacity: 10, refill_per_sec: 0.001}

    # Whether `call`, run in a process of its own, left its normal scheduler for a dirty
    # one (its scheduling, traced, shows the dirty NIF's finalizer), and its answer.
    # The lengths (native time units) of the slices the traced process ran, until :done.
    defp collect_slices(to, slices, since \\ nil) do
      receive do
        {:trace_ts, _, :in, _, at} -> collect_slices(to, slices, at)
        {:trace_ts, _, :out, _, at} when since != nil -> collect_slices(to, [at - since | slices])
        {:trace_ts, _, _, _, _} -> collect_slices(to, slices, since)
        :done -> send(to, {:slices, slices})
      end
    end

    defp scheduled(call) do
      parent = self()

      pid =
        spawn(fn ->
          receive do: (:go -> send(parent, {:answer, call.()}))
        end)

      :erlang.trace(pid, true, [:running])
      send(pid, :go)
      answer = receive do: ({:answer, answer} -> answer)
      ref = Process.monitor(pid)
      receive do: ({:DOWN, ^ref, :process, ^pid, _} -> :ok)
      # Trace messages of a process arrive before the monitor's message.
      dirty = receive_dirty(pid, false)
      {if(dirty, do: :dirty, else: :normal), answer}
    end

    defp receive_dirty(pid, dirty) do
      receive do
        {:trace, ^pid, _, {:erts_internal, :dirty_nif_finalizer, 1}} -> receive_dirty(pid, true)
        {:trace, ^pid, _, _} -> receive_dirty(pid, dirty)
      after
        0 -> dirty
      end
    end

    defp distinct(count, limit, cost),
      do: for(i <- 1..count, do: {{"binance", "long-#{i}"}, limit, cost})

    test "up to the inline bound stay on a normal scheduler; longer ones go dirty",
         %{table: t} do
      assert @inline < @max

      assert {:normal, :ok} =
               scheduled(fn -> NIF.check_rates(t, self(), distinct(@inline, @limit, 1), nil) end)

      for count <- [@inline + 1, @max] do
        assert {:dirty, :ok} =
                 scheduled(fn -> NIF.check_rates(t, self(), distinct(count, @limit, 1), nil) end)
      end
    end

    test "are answered on a dirty scheduler as inline: paid all or nothing, coalesced, refused",
         %{table: t} do
      checks = distinct(@max, @still, 2)
      assert {:dirty, :ok} = scheduled(fn -> NIF.check_rates(t, self(), checks, nil) end)
      for {key, _, _} <- checks, do: assert_in_delta(NIF.get_cost(t, key), 2, 0.01)

      # One bucket that cannot pay: a delay, and nothing paid on any other.
      one = %{capacity: 1, refill_per_sec: 0.001}
      short = [{{"binance", "drained"}, one, 1}]
      assert :ok = NIF.check_rates(t, self(), short, nil)
      long = distinct(@max - 1, @still, 1) ++ short
      assert {:dirty, {:delay, _}} = scheduled(fn -> NIF.check_rates(t, self(), long, nil) end)
      for {key, _, _} <- checks, do: assert_in_delta(NIF.get_cost(t, key), 2, 0.01)

      # Repeated keys coalesced: 700 checks of one key at cost 0.01 pay 7 at once.
      repeated = List.duplicate({{"binance", "repeated"}, @still, 0.01}, 700)
      assert {:dirty, :ok} = scheduled(fn -> NIF.check_rates(t, self(), repeated, nil) end)
      assert_in_delta(NIF.get_cost(t, {"binance", "repeated"}), 7, 0.01)

      # Malformed input and conflicts: the same errors as inline, nothing paid.
      bad = distinct(@max - 1, @still, 1) ++ [{{"binance", "bad"}, @still, -1}]
      assert {:dirty, answer} = scheduled(fn -> NIF.check_rates(t, self(), bad, nil) end)
      assert invalid(answer).message =~ "cost must be a finite number >= 0"
      assert invalid(answer).exchange == "binance"

      conflict = [{{"binance", "long-1"}, one, 1} | Enum.take(checks, @max - 1)]
      assert {:dirty, answer} = scheduled(fn -> NIF.check_rates(t, self(), conflict, nil) end)
      assert invalid(answer).message =~ "conflicting bucket definitions"
      for {key, _, _} <- checks, do: assert_in_delta(NIF.get_cost(t, key), 2, 0.01)

      # A waiter's long list books, and is claimed by the same caller.
      booked = distinct(@max - 1, @still, 1) ++ [{{"binance", "drained"}, one, 1}]
      owner = self()

      assert {:dirty, {:booked, _}} =
               scheduled(fn -> NIF.check_rates(t, owner, booked, 4_294_967_295) end)
    end

    test "lists of long multi-byte keys go dirty, as checks or as buckets not prepared",
         %{table: t} do
      # 64 checks of three 1 KiB parts of "€": checking and hashing them takes over 100 µs.
      part = fn i -> String.duplicate("€", 340) <> String.pad_leading("#{i}", 4, "0") end
      keys = for i <- 1..@inline, do: {part.(i), part.(i), part.(i)}
      checks = for key <- keys, do: {key, @still, 1}

      buckets =
        for key <- keys,
            do:
              {%Bourse.RateLimiter.Bucket{
                 name: :t,
                 key: key,
                 limit: @still,
                 route: nil,
                 prepared: nil
               }, 1}

      assert {:dirty, :ok} = scheduled(fn -> NIF.check_rates(t, self(), checks, nil) end)
      assert {:dirty, :ok} = scheduled(fn -> NIF.check_rates(t, self(), buckets, nil) end)
      for key <- keys, do: assert_in_delta(NIF.get_cost(t, key), 2, 0.01)
    end

    test "checks of buckets holding more bookings than the inline bound go dirty",
         %{table: t} do
      bound = Bourse.Native.bound(:max_inline_bookings)
      per_bucket = div(bound, 2)
      slow = %{capacity: 1, refill_per_sec: 1}
      buckets = for i <- 1..3, do: {{"binance", "booked-#{i}"}, slow, 1}

      # One caller admitted, then `per_bucket - 1` waiters booked on all three buckets.
      filled_from = System.monotonic_time(:millisecond)

      [first | booked] =
        for _ <- 1..per_bucket,
            do: NIF.check_rates(t, spawn(fn -> :ok end), buckets, 4_294_967_295)

      assert first == :ok
      assert Enum.all?(booked, &match?({:booked, _}, &1))

      two = Enum.take(buckets, 2)
      assert {:normal, {:delay, _}} = scheduled(fn -> NIF.check_rates(t, self(), two, nil) end)

      asked_at = System.monotonic_time(:millisecond)

      assert {:dirty, {:delay, ms}} =
               scheduled(fn -> NIF.check_rates(t, self(), buckets, nil) end)

      # Answered as inline: the delay after every booking, nothing paid. The first booking
      # was made at most `elapsed` ms before this answer (a loaded machine may take over a
      # second to fill the buckets).
      elapsed = System.monotonic_time(:millisecond) - filled_from
      assert ms in (per_bucket * 1_000 - elapsed - 1)..(per_bucket * 1_000 + 1)
      assert {:delay, again} = NIF.check_rates(t, self(), buckets, nil)
      between = System.monotonic_time(:millisecond) - asked_at
      assert again in (ms - between - 2)..(ms + 2), "#{again} ms, #{ms} ms #{between} ms before"
    end

    # A long list on a dirty scheduler holds the locks of every shard its keys fall in. A
    # check of another key on a normal scheduler waited for them there: 11 ms for the first
    # check of 1,024 buckets holding 255 bookings each after a pause (2 vCPUs), its whole
    # run. Now such calls continue on a dirty scheduler until it ends. Rounds of one long
    # check each, beside a process checking another key in a loop whose scheduling is
    # traced: before, that process ran about as long as the long check on a normal
    # scheduler without leaving it, in every round.
    test "checks beside a long list that holds the shards' locks do not wait on a normal scheduler",
         %{table: t} do
      slow = %{capacity: 1, refill_per_sec: 1}
      held = for i <- 1..@max, do: {{"held", "key-#{i}"}, slow, 1}
      forever = 4_294_967_295

      # One caller admitted, then 255 waiters booked on every bucket.
      for _ <- 1..256, do: NIF.check_rates(t, spawn(fn -> :ok end), held, forever)
      assert %{bookings: 255} = NIF.inspect(t, {"held", "key-1"})

      rounds =
        for round <- 1..3 do
          # Each pause lasts longer: the bookings are re-planned behind it once more.
          :ok = NIF.pause(t, "held", round * 10_000_000)
          beside_long_check(t, fn -> NIF.check_rates(t, self(), held, nil) end)
        end

      assert Enum.any?(rounds, fn {long_us, slice_us} -> slice_us < long_us / 2 end),
             "long check and longest normal-scheduler slice beside it (µs): #{inspect(rounds)}"
    end

    # Runs `long` beside a process checking another key in a loop: the time `long` took
    # and the longest slice that process ran on a normal scheduler meanwhile (µs).
    defp beside_long_check(t, long) do
      me = self()
      huge = %{capacity: 1.0e12, refill_per_sec: 1.0e12}
      tracer = spawn_link(fn -> collect_normal_slices(me, []) end)

      prober =
        spawn_link(fn ->
          Stream.repeatedly(fn -> NIF.check_rate(t, self(), {"other", "k"}, huge, 1, nil) end)
          |> Stream.take_while(fn _ -> not_told_to_stop() end)
          |> Stream.run()

          send(me, :stopped)
        end)

      Process.sleep(20)
      :erlang.trace(prober, true, [:running, :monotonic_timestamp, tracer: tracer])
      {long_us, _answer} = :timer.tc(long)
      :erlang.trace(prober, false, [:running])
      send(prober, :stop)
      assert_receive :stopped, 5_000
      send(tracer, :done)
      assert_receive {:slices, slices}, 5_000
      longest = slices |> Enum.max(fn -> 0 end)
      {long_us, System.convert_time_unit(longest, :native, :microsecond)}
    end

    # As `collect_slices/3`, without the slices run on a dirty scheduler: those begin in a
    # NIF of `Bourse.Native`.
    defp collect_normal_slices(to, slices, since \\ nil) do
      receive do
        {:trace_ts, _, :in, {Bourse.Native, _, _}, _} ->
          collect_normal_slices(to, slices)

        {:trace_ts, _, :in, _, at} ->
          collect_normal_slices(to, slices, at)

        {:trace_ts, _, :out, _, at} when since != nil ->
          collect_normal_slices(to, [at - since | slices])

        {:trace_ts, _, _, _, _} ->
          collect_normal_slices(to, slices, since)

        :done ->
          send(to, {:slices, slices})
      end
    end

    defp not_told_to_stop do
      receive do
        :stop -> false
      after
        0 -> true
      end
    end

    # Owners are a pid or `{pid, integer}`; anything else is one owner, not hashed whole
    # (before, a 64 MB binary held a normal scheduler 86 ms on a 2-vCPU machine, 100 ms
    # here; now a few µs). Its slices are read from a trace of its scheduling.
    test "a huge owner term is not walked on the normal scheduler", %{table: t} do
      huge = :binary.copy(<<1>>, 256 * 1024 * 1024)
      me = self()
      tracer = spawn_link(fn -> collect_slices(me, []) end)
      :erlang.trace(me, true, [:running, :monotonic_timestamp, tracer: tracer])

      for owner <- [huge, {me, huge}, {huge, 1}] do
        assert :ok = NIF.check_rate(t, owner, {"binance", "owned"}, @still, 1, nil)
        Process.sleep(1)
        assert :ok = NIF.check_rates(t, owner, [{{"binance", "owned"}, @still, 1}], nil)
        Process.sleep(1)
      end

      :erlang.trace(me, false, [:running])
      send(tracer, :done)
      assert_receive {:slices, slices}, 5_000
      longest = slices |> Enum.max() |> System.convert_time_unit(:native, :millisecond)
      # Far above a few µs, far below the hundreds of ms a walk of 256 MB takes.
      assert longest < 100, "a slice of #{longest} ms"
      # `{pid, integer}` owners are told apart, and from the pid alone.
      slow = %{capacity: 1, refill_per_sec: 0.001}
      ready = {{"binance", "waited"}, slow, 1}
      assert :ok = NIF.check_rates(t, self(), [ready], nil)
      assert {:booked, _} = NIF.check_rates(t, {self(), 1}, [ready], 4_294_967_295)
      assert {:booked, _} = NIF.check_rates(t, {self(), 2}, [ready], 4_294_967_295)
      assert {:booked, _} = NIF.check_rates(t, self(), [ready], 4_294_967_295)
    end

    test "lists too long or improper are refused on the normal scheduler, as short ones are",
         %{table: t} do
      valid = {{"binance", "hostile"}, @still, 1}
      too_long = List.duplicate(valid, @max + 1)
      huge = List.duplicate(valid, 1_000_000)
      improper = Enum.reduce(1..@max, :tail, fn _, tail -> [valid | tail] end)
      improper_huge = Enum.reduce(1..1_000_000, :tail, fn _, tail -> [valid | tail] end)

      # Measured over at most 1025 cells: an improper list longer than that is "too long".
      for list <- [too_long, huge, improper_huge] do
        assert {:normal, answer} = scheduled(fn -> NIF.check_rates(t, self(), list, nil) end)
        assert invalid(answer).message =~ "more than 1024"
      end

      short_improper = [valid | :tail]

      for list <- [improper, short_improper] do
        assert {:normal, answer} = scheduled(fn -> NIF.check_rates(t, self(), list, nil) end)
        assert invalid(answer) == invalid(NIF.check_rates(t, self(), short_improper, nil))
      end

      # The same malformed check gets the same error in a short list and in a long one.
      bad = {{"binance", "bad"}, @still, :one}
      short = NIF.check_rates(t, self(), [bad], nil)

      assert {:dirty, long} =
               scheduled(fn ->
                 NIF.check_rates(t, self(), [bad | distinct(@max - 1, @still, 1)], nil)
               end)

      assert invalid(long) == invalid(short)
      assert NIF.get_cost(t, {"binance", "hostile"}) == 0
      assert NIF.get_cost(t, {"binance", "long-1"}) == 0
    end
  end
end
