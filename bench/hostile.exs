# How long NIF calls take on hostile input and while the table grows and is swept,
# printed, never asserted: `mix run bench/hostile.exs`.
#
#   1. The median and the slowest of 20 calls for each malformed input (a 10 MB binary as
#      a cost, lists of 10,000,000 checks, a bignum, deep terms...): every one runs on a
#      normal scheduler, so none may take much more than 100 µs. Times are wall time in
#      the caller: on a loaded machine the slowest includes waits for a scheduler.
#   2. Valid check lists of the most checks answered inline, and of the most allowed: the
#      call's time, and the longest stretch its process ran on a normal scheduler (from
#      tracing its scheduling): a long list continues on a dirty scheduler.
#   3. The slowest hot-key check_rate/4 while another process checks 1,000,000 new keys,
#      while the limiter's sweep drops them again, and while reset_all drops 1,000,000
#      busy ones (with another process checking new keys meanwhile, whose table grows).

defmodule Bench.Hostile do
  alias Bourse.RateLimiter

  @limiter Bench.Hostile.Limiter
  @limit %{capacity: 10, refill_per_sec: 10}
  @key {"binance", "api-key", "request"}
  @keys 1_000_000

  def main do
    {:ok, _} = RateLimiter.start_link(name: @limiter, sweep_interval_ms: 100)
    malformed()
    scheduler_hold()
    growth_and_sweep()
  end

  defp malformed do
    huge = :binary.copy("s", 10 * 1024 * 1024)
    long = List.duplicate({@key, @limit, 1}, 10_000_000)
    improper = Enum.reduce(1..1_000_000, :tail, fn _, tail -> [{@key, @limit, 1} | tail] end)
    deep = Enum.reduce(1..100_000, "x", fn _, inner -> {inner} end)
    wide_map = Map.new(1..100_000, &{&1, &1})

    cases = [
      {"a 10 MB binary as cost", fn -> RateLimiter.check_rate(@key, @limit, huge, @limiter) end},
      {"a 10 MB binary as exchange_id",
       fn -> RateLimiter.check_rate({huge, "k"}, @limit, 1, @limiter) end},
      {"10,000,000 checks", fn -> RateLimiter.check_rates(long, @limiter) end},
      {"an improper list of 1,000,000 checks",
       fn -> RateLimiter.check_rates(improper, @limiter) end},
      {"10 ** 400 as cost", fn -> RateLimiter.check_rate(@key, @limit, 10 ** 400, @limiter) end},
      {"a tuple nested 100,000 deep as key",
       fn -> RateLimiter.check_rate(deep, @limit, 1, @limiter) end},
      {"a map of 100,000 keys as limit",
       fn -> RateLimiter.check_rate(@key, wide_map, 1, @limiter) end},
      {"1,024 valid checks (the most allowed)",
       fn -> RateLimiter.check_rates(Enum.take(long, 1024), @limiter) end}
    ]

    IO.puts("## 20 calls per malformed input: median and slowest (µs)\n")

    for {label, call} <- cases do
      times = Enum.sort(for _ <- 1..20, do: elem(:timer.tc(call), 0))
      columns = Enum.map([Enum.at(times, 10), List.last(times)], &String.pad_leading("#{&1}", 8))
      IO.puts(String.pad_trailing(label, 40) <> Enum.join(columns))
    end

    IO.puts("")
  end

  defp scheduler_hold do
    max_checks = Bourse.Native.bound(:max_checks)
    inline = Bourse.Native.bound(:max_inline_checks)
    limit = %{capacity: 1.0e12, refill_per_sec: 1.0e12}

    IO.puts("""
    ## Valid check lists: the call, and its longest stretch on a normal scheduler (µs)
    Median and slowest of 20 calls, each from a process of its own whose scheduling is
    traced. Lists of up to #{inline} checks are answered inline; longer ones continue on a
    dirty scheduler.
    """)

    for count <- [inline, max_checks] do
      list = for i <- 1..count, do: {{"binance", "list-key-#{i}"}, limit, 1}
      runs = for _ <- 1..20, do: traced_call(fn -> RateLimiter.check_rates(list, @limiter) end)
      {calls, stretches} = Enum.unzip(runs)

      columns =
        for times <- [calls, stretches],
            at <- [10, 19],
            do: String.pad_leading("#{Enum.at(Enum.sort(times), at)}", 8)

      IO.puts(
        String.pad_trailing("#{count} checks: call; normal scheduler", 40) <> Enum.join(columns)
      )
    end

    IO.puts("")
  end

  # Runs `call` in a new process: its wall time, and the longest time the process ran on
  # a normal scheduler without leaving it (a dirty NIF call leaves it), in µs.
  defp traced_call(call) do
    parent = self()

    pid =
      spawn(fn ->
        receive do: (:go -> :ok)
        {took, _answer} = :timer.tc(call)
        send(parent, {:took, took})
      end)

    :erlang.trace(pid, true, [:running, :exiting, :monotonic_timestamp])
    send(pid, :go)
    took = receive do: ({:took, took} -> took)
    {took, longest_stretch(pid, nil, 0)}
  end

  defp longest_stretch(pid, since, longest) do
    receive do
      {:trace_ts, ^pid, :in, {:erts_internal, :dirty_nif_finalizer, 1}, at} ->
        longest_stretch(pid, at, longest)

      {:trace_ts, ^pid, :in, {Bourse.Native, _, _}, _at} ->
        # Resumed on a dirty scheduler: not a normal one's time.
        longest_stretch(pid, nil, longest)

      {:trace_ts, ^pid, into, _mfa, at} when into in [:in, :in_exiting] ->
        longest_stretch(pid, at, longest)

      {:trace_ts, ^pid, out, _mfa, at} when out in [:out, :out_exiting, :out_exited] ->
        stretch =
          if since, do: System.convert_time_unit(at - since, :native, :microsecond), else: 0

        longest = max(longest, stretch)
        if out == :out_exited, do: longest, else: longest_stretch(pid, nil, longest)
    after
      1_000 -> longest
    end
  end

  defp growth_and_sweep do
    parent = self()
    phases = %{inserting: [], sweeping: [], filling: [], resetting: []}
    hot = spawn_link(fn -> hot_loop(parent, :inserting, phases) end)

    # Capacity 1 refilled in a microsecond: each key can be swept right after its check.
    quick = %{capacity: 1, refill_per_sec: 1_000_000}
    inserter = Task.async(fn -> touch(quick, 0) end)
    Task.await(inserter, :infinity)
    send(hot, {:phase, :sweeping})
    wait_for_sweep()
    send(hot, {:phase, :filling})
    busy = %{capacity: 10, refill_per_sec: 0.001}
    Task.await(Task.async(fn -> touch(busy, 0) end), :infinity)
    send(hot, {:phase, :resetting})
    fresh = spawn_link(fn -> fresh_loop(parent, 0, []) end)
    :ok = RateLimiter.reset_all(@limiter)
    send(fresh, :stop)
    send(hot, :stop)

    fresh_latencies =
      receive do
        {:fresh, latencies} -> latencies
      end

    latencies =
      receive do
        {:latencies, latencies} -> latencies
      end

    IO.puts("## Hot-key check_rate/4 while another process works on the same table (µs)\n")

    rows = [
      {"inserting #{@keys} keys", latencies.inserting},
      {"sweeping #{@keys} keys", latencies.sweeping},
      {"reset_all of #{@keys} busy keys", latencies.resetting},
      {"the same, a new key per check", fresh_latencies}
    ]

    for {label, times} <- rows do
      sorted = Enum.sort(times)
      at = fn q -> Enum.at(sorted, round((length(sorted) - 1) * q)) end

      IO.puts(
        "#{label}: slowest #{at.(1.0)}, p99.99 #{at.(0.9999)}, " <>
          "median #{at.(0.5)} (#{length(sorted)} checks)"
      )
    end
  end

  # Checks a new key at a time until told to stop, then sends the latencies.
  defp fresh_loop(parent, i, latencies) do
    receive do
      :stop -> send(parent, {:fresh, latencies})
    after
      0 ->
        started = System.monotonic_time(:microsecond)
        RateLimiter.check_rate({"okx", "fresh-#{i}", "request"}, @limit, 1, @limiter)
        took = System.monotonic_time(:microsecond) - started
        fresh_loop(parent, i + 1, [took | latencies])
    end
  end

  defp touch(_limit, @keys), do: :ok

  defp touch(limit, i) do
    :ok = RateLimiter.check_rate({"binance", "key-#{i}", "request"}, limit, 1, @limiter)
    touch(limit, i + 1)
  end

  defp wait_for_sweep do
    Process.sleep(100)
    if RateLimiter.stats(@limiter).buckets > 1, do: wait_for_sweep()
  end

  defp hot_loop(parent, phase, latencies) do
    receive do
      {:phase, next} ->
        hot_loop(parent, next, latencies)

      :stop ->
        send(parent, {:latencies, latencies})
    after
      0 ->
        started = System.monotonic_time(:microsecond)
        RateLimiter.check_rate(@key, %{capacity: 1.0e12, refill_per_sec: 1.0e12}, 1, @limiter)
        took = System.monotonic_time(:microsecond) - started
        hot_loop(parent, phase, Map.update!(latencies, phase, &[took | &1]))
    end
  end
end

Bench.Hostile.main()
