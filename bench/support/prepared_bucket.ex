defmodule Bench.PreparedBucket do
  @moduledoc """
  Checks through `Bourse.RateLimiter.check_rate/2` of buckets made once with
  `Bourse.RateLimiter.bucket/3`: each "key" of the loop is a prepared bucket (`buckets/2`).
  """
  use Bench.Loop

  @doc "One check of cost 1; the limiter is the bucket's own."
  @spec check(GenServer.name(), Bourse.RateLimiter.bucket()) :: :ok | {:delay, pos_integer()}
  def check(_limiter, bucket), do: Bourse.RateLimiter.check_rate(bucket, 1)

  @doc "The buckets of `keys` (a tuple) on `limiter`, with `Bench.Loop.limit/0`, as a tuple."
  @spec buckets(GenServer.name(), tuple()) :: tuple()
  def buckets(limiter, keys) do
    keys
    |> Tuple.to_list()
    |> Enum.map(&prepared(limiter, &1, Bench.Loop.limit()))
    |> List.to_tuple()
  end

  @doc "Every check list of `checks` (a tuple, `Bench.CheckRates.checks/2`) with buckets."
  @spec check_lists(GenServer.name(), tuple()) :: tuple()
  def check_lists(limiter, checks) do
    checks
    |> Tuple.to_list()
    |> Enum.map(fn list ->
      for {key, limit, cost} <- list, do: {prepared(limiter, key, limit), cost}
    end)
    |> List.to_tuple()
  end

  defp prepared(limiter, key, limit) do
    {:ok, bucket} = Bourse.RateLimiter.bucket(key, limit, limiter)
    bucket
  end
end
