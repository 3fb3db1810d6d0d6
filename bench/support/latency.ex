defmodule Bench.Latency do
  @moduledoc """
  Throughput and latency of `Bourse.RateLimiter.check_rate/4` on concurrent callers: each
  caller checks its share of the keys in a loop until a deadline and times one check in 8.
  """

  require Bench.Loop

  alias Bourse.RateLimiter

  @typedoc """
  Checks per second of all callers together, the p50 and p99 of one check in µs, and the
  CPU time per check (user and system, µs) of this VM and of the OS process `measure/5`
  was given (`nil` without one, or where `/proc` cannot tell).
  """
  @type result :: %{
          checks_per_second: float(),
          p50_us: float(),
          p99_us: float(),
          vm_cpu_us: float() | nil,
          os_process_cpu_us: float() | nil
        }

  @sample_every 8
  @rounds 3
  @warm_up_ms 200

  @doc """
  A warm-up of #{@warm_up_ms} ms, then #{@rounds} runs of `run_ms` each: the median
  throughput, the percentiles of the latencies sampled in every run, and the CPU time
  per check over all runs of this VM and of the OS process `os_pid` (the daemon serving
  the limiter). CPU time per check does not depend on the other programs' load as much
  as checks/s does: on a machine of N CPUs, N seconds over the sum of the two bound the
  checks per second however idle it is.
  """
  @spec measure(GenServer.name(), tuple(), pos_integer(), pos_integer(), pos_integer() | nil) ::
          result()
  def measure(limiter, keys, callers, run_ms, os_pid \\ nil) do
    once(limiter, keys, callers, @warm_up_ms)
    vm_before = cpu_ticks(System.pid())
    os_before = os_pid && cpu_ticks(os_pid)
    runs = for _ <- 1..@rounds, do: once(limiter, keys, callers, run_ms)
    checks = runs |> Enum.map(&elem(&1, 2)) |> Enum.sum()
    rates = runs |> Enum.map(&elem(&1, 0)) |> Enum.sort()
    latencies = runs |> Enum.flat_map(&elem(&1, 1)) |> Enum.sort() |> List.to_tuple()

    %{
      checks_per_second: Enum.at(rates, div(@rounds, 2)),
      p50_us: percentile(latencies, 0.50),
      p99_us: percentile(latencies, 0.99),
      vm_cpu_us: cpu_per_check(vm_before, cpu_ticks(System.pid()), checks),
      os_process_cpu_us: cpu_per_check(os_before, os_pid && cpu_ticks(os_pid), checks)
    }
  end

  # User and system time of an OS process, in clock ticks (`/proc/PID/stat`, Linux).
  defp cpu_ticks(os_pid) do
    with {:ok, stat} <- File.read("/proc/#{os_pid}/stat"),
         # Fields after the command name, which is in parentheses and may hold spaces.
         [_, after_name] <- String.split(stat, ") ", parts: 2),
         [utime, stime] <- after_name |> String.split(" ") |> Enum.slice(11, 2) do
      String.to_integer(utime) + String.to_integer(stime)
    else
      _ -> nil
    end
  end

  # Linux counts CPU time in ticks of 10 ms (USER_HZ 100).
  defp cpu_per_check(before, later, checks)
       when is_integer(before) and is_integer(later) and checks > 0,
       do: (later - before) * 10_000 / checks

  defp cpu_per_check(_before, _later, _checks), do: nil

  defp once(limiter, keys, callers, run_ms) do
    parent = self()

    pids =
      for caller <- 0..(callers - 1) do
        spawn_link(fn ->
          receive do:
                    ({:go, deadline} ->
                       send(parent, {:done, self(), loop(limiter, keys, caller * 7919, deadline)}))
        end)
      end

    started = System.monotonic_time(:nanosecond)
    deadline = started + run_ms * 1_000_000
    Enum.each(pids, &send(&1, {:go, deadline}))

    {checks, latencies} =
      Enum.reduce(pids, {0, []}, fn pid, {checks, latencies} ->
        receive do: ({:done, ^pid, {n, sampled}} -> {checks + n, sampled ++ latencies})
      end)

    {checks * 1.0e9 / (System.monotonic_time(:nanosecond) - started), latencies, checks}
  end

  defp loop(limiter, keys, index, deadline), do: loop(limiter, keys, index, deadline, 0, [])

  defp loop(limiter, keys, index, deadline, count, sampled) do
    before = System.monotonic_time(:nanosecond)

    if before >= deadline do
      {count, sampled}
    else
      key = elem(keys, rem(index, tuple_size(keys)))
      :ok = RateLimiter.check_rate(key, Bench.Loop.limit(), 1, limiter)

      sampled =
        if rem(count, @sample_every) == 0,
          do: [System.monotonic_time(:nanosecond) - before | sampled],
          else: sampled

      loop(limiter, keys, index + 1, deadline, count + 1, sampled)
    end
  end

  defp percentile({}, _q), do: 0.0

  defp percentile(sorted, q),
    do: elem(sorted, min(trunc(q * tuple_size(sorted)), tuple_size(sorted) - 1)) / 1000
end
