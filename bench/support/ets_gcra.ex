defmodule Bench.EtsGcra do
  @moduledoc """
  A pure-Elixir GCRA (generic cell rate algorithm) on `:ets.update_counter/4`: the table
  holds each key's theoretical arrival time (TAT) in native monotonic time units.

  One `update_counter` call moves the TAT atomically to `max(TAT, now) + cost * interval`
  (`interval` = time per token); the check is admitted when the new TAT is at most
  `capacity * interval` ahead of now, which is a token bucket of that capacity and rate.
  A refused check takes its increment back with a second `update_counter`: in between a
  concurrent check may see the higher TAT and be refused too, but never wrongly admitted.
  """
  use Bench.Loop

  @native_per_second System.convert_time_unit(1, :second, :native)
  @native_per_ms System.convert_time_unit(1, :millisecond, :native)

  @doc "A new public table, tuned for concurrent writers."
  @spec new() :: :ets.tid()
  def new,
    do: :ets.new(__MODULE__, [:set, :public, write_concurrency: true, read_concurrency: true])

  @doc "One check of cost 1: `:ok` (paid) or `{:delay, ms}`."
  @spec check(:ets.tid(), term()) :: :ok | {:delay, pos_integer()}
  def check(table, key), do: check(table, key, Bench.Loop.limit(), 1)

  @doc "One check of `cost` against `limit`."
  @spec check(:ets.tid(), term(), map(), number()) :: :ok | {:delay, pos_integer()}
  def check(table, key, %{capacity: capacity, refill_per_sec: refill}, cost) do
    now = System.monotonic_time()
    interval = @native_per_second / refill
    increment = ceil(cost * interval)
    burst = floor(capacity * interval)
    # max(TAT, now): TAT - 1 below now means TAT <= now, so it becomes now - 1; then + 1.
    ops = [{2, -1, now, now - 1}, {2, increment + 1}]
    [_, tat] = :ets.update_counter(table, key, ops, {key, now})

    if tat - now <= burst do
      :ok
    else
      :ets.update_counter(table, key, {2, -increment})
      {:delay, max(1, ceil((tat - now - burst) / @native_per_ms))}
    end
  end
end
