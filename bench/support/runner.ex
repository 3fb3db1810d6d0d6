defmodule Bench.Runner do
  @moduledoc """
  Runs a workload on concurrent caller processes and times it with the monotonic clock.
  """

  @typedoc "What one measurement found: wall-clock ns per check (all callers together) and checks/s."
  @type result :: %{ns_per_check: float(), checks_per_second: float()}

  @doc """
  Runs `total` checks of `module.run/4` (see `Bench.Loop`) split over `callers`
  processes started together, after one warm-up run of a tenth of them; repeats the
  measurement `rounds` times and keeps the median.
  """
  @spec measure(module(), term(), tuple(), pos_integer(), pos_integer(), pos_integer()) ::
          result()
  def measure(module, handle, keys, callers, total, rounds \\ 3) do
    once(module, handle, keys, callers, div(total, 10))
    times = for _ <- 1..rounds, do: once(module, handle, keys, callers, total)
    ns = Enum.at(Enum.sort(times), div(rounds, 2))
    %{ns_per_check: ns, checks_per_second: 1.0e9 / ns}
  end

  # Wall-clock ns per check of one run.
  defp once(module, handle, keys, callers, total) do
    per_caller = max(div(total, callers), 1)
    parent = self()

    pids =
      for caller <- 0..(callers - 1) do
        spawn_link(fn ->
          receive do: (:go -> :ok)
          :ok = module.run(handle, keys, caller * 7919, per_caller)
          send(parent, {:done, self()})
        end)
      end

    started = System.monotonic_time(:nanosecond)
    Enum.each(pids, &send(&1, :go))
    Enum.each(pids, fn pid -> receive do: ({:done, ^pid} -> :ok) end)
    (System.monotonic_time(:nanosecond) - started) / (per_caller * callers)
  end

  @doc "Keys as a tuple: `count` distinct `{\"binance\", \"api-key-N\", \"request\"}`."
  @spec keys(pos_integer()) :: tuple()
  def keys(count) do
    List.to_tuple(for i <- 0..(count - 1), do: {"binance", "api-key-#{i}", "request"})
  end
end
