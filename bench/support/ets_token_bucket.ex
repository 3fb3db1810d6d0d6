defmodule Bench.EtsTokenBucket do
  @moduledoc """
  A token bucket in a public ETS table, read with `:ets.lookup/2` and written back with
  `:ets.insert/2`: each key holds its tokens and the time they were counted (native
  monotonic units). The read and the write are two operations, so concurrent checks of
  one key can overwrite each other's payment (lost updates admit more than the bucket
  allows); that is the price of the design, kept here as it is.
  """
  use Bench.Loop

  @native_per_second System.convert_time_unit(1, :second, :native)

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

    tokens =
      case :ets.lookup(table, key) do
        [{_, tokens, last}] -> min(capacity, tokens + (now - last) * refill / @native_per_second)
        [] -> capacity
      end

    if tokens >= cost do
      :ets.insert(table, {key, tokens - cost, now})
      :ok
    else
      :ets.insert(table, {key, tokens, now})
      {:delay, max(1, ceil((cost - tokens) / refill * 1000))}
    end
  end
end
