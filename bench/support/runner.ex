defmodule Bench.Runner do
  @moduledoc """
  Runs a workload on concurrent caller processes and times it with the monotonic clock.
  """

  @typedoc "What one measurement found: wall-clock ns per check (all callers together) and checks/s."
  @type result :: %{ns_per_check: float(), checks_per_second: float()}

  @typedoc "An implementation to time: a module using `Bench.Loop`, its handle and its keys."
  @type implementation :: {module(), term(), tuple()}

  @warm_up_checks 20_000
  @rounds 5

  @doc """
  Times `module.run/4` (see `Bench.Loop`) split over `callers` processes started
  together: a warm-up of #{@warm_up_checks} checks, which also sizes the runs so that each
  takes about `target_ms`, then #{@rounds} runs; returns the median.
  """
  @spec measure(module(), term(), tuple(), pos_integer(), pos_integer()) :: result()
  def measure(module, handle, keys, callers, target_ms),
    do: hd(compare([{module, handle, keys}], callers, target_ms))

  @doc """
  Times several implementations on the same workload, interleaved: each is warmed up
  and sized as in `measure/5`, then #{@rounds} rounds each run every implementation once,
  in turn, so that load from other programs hits them alike. Returns the median of each,
  in the order given.
  """
  @spec compare([implementation()], pos_integer(), pos_integer()) :: [result()]
  def compare(implementations, callers, target_ms) do
    sized =
      for {module, handle, keys} <- implementations do
        warm_up_ns = once(module, handle, keys, callers, @warm_up_checks)
        {module, handle, keys, max(round(target_ms * 1.0e6 / warm_up_ns), callers)}
      end

    rounds =
      for _ <- 1..@rounds do
        for {module, handle, keys, checks} <- sized,
            do: once(module, handle, keys, callers, checks)
      end

    rounds
    |> Enum.zip_with(& &1)
    |> Enum.map(fn times ->
      ns = Enum.at(Enum.sort(times), div(@rounds, 2))
      %{ns_per_check: ns, checks_per_second: 1.0e9 / ns}
    end)
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
  def keys(count), do: keys(count, "request")

  @doc "Like `keys/1`, on the bucket axis `axis`."
  @spec keys(pos_integer(), String.t()) :: tuple()
  def keys(count, axis) do
    List.to_tuple(for i <- 0..(count - 1), do: {"binance", "api-key-#{i}", axis})
  end
end
