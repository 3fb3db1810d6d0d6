defmodule Bench.AtomicsTokenBucket do
  @moduledoc """
  A lock-free token bucket on `:atomics`: a public ETS table maps each key to an atomics
  array of two signed words, the tokens (in thousandths of a token) and the time of the
  last refill (native monotonic units).

  A check first claims the refill since the last one with a compare-exchange on the time
  word (only one of several concurrent callers wins it, so a refill is counted once), then
  adds that refill and takes its cost with a compare-exchange loop on the token word, the
  sum capped at the capacity. A refused check adds its refill and takes nothing.
  """
  use Bench.Loop

  @native_per_second System.convert_time_unit(1, :second, :native)
  @milli 1000

  @doc "A new public table, tuned for concurrent readers."
  @spec new() :: :ets.tid()
  def new, do: :ets.new(__MODULE__, [:set, :public, read_concurrency: true])

  @doc "One check of cost 1: `:ok` (paid) or `{:delay, ms}`."
  @spec check(:ets.tid(), term()) :: :ok | {:delay, pos_integer()}
  def check(table, key), do: check(table, key, Bench.Loop.limit(), 1)

  @doc "One check of `cost` against `limit`."
  @spec check(:ets.tid(), term(), map(), number()) :: :ok | {:delay, pos_integer()}
  def check(table, key, %{capacity: capacity, refill_per_sec: refill}, cost) do
    now = System.monotonic_time()
    cap = round(capacity * @milli)
    bucket = bucket(table, key, cap, now)
    last = :atomics.get(bucket, 2)
    accrued = div((now - last) * round(refill * @milli), @native_per_second)

    added =
      if accrued > 0 and :atomics.compare_exchange(bucket, 2, last, now) == :ok,
        do: accrued,
        else: 0

    take(bucket, :atomics.get(bucket, 1), added, cap, round(cost * @milli), refill)
  end

  defp take(bucket, tokens, added, cap, cost, refill) do
    available = min(tokens + added, cap)
    paid = if available >= cost, do: available - cost, else: available

    case :atomics.compare_exchange(bucket, 1, tokens, paid) do
      :ok when available >= cost -> :ok
      :ok -> {:delay, max(1, ceil((cost - available) / @milli / refill * 1000))}
      current -> take(bucket, current, added, cap, cost, refill)
    end
  end

  # The key's atomics, created full on first use (by whichever caller inserts it first).
  defp bucket(table, key, cap, now) do
    case :ets.lookup(table, key) do
      [{_, bucket}] ->
        bucket

      [] ->
        bucket = :atomics.new(2, signed: true)
        :atomics.put(bucket, 1, cap)
        :atomics.put(bucket, 2, now)
        if :ets.insert_new(table, {key, bucket}), do: bucket, else: bucket(table, key, cap, now)
    end
  end
end
