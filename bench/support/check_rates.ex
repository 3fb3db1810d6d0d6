defmodule Bench.CheckRates do
  @moduledoc """
  Multi-bucket checks through `Bourse.RateLimiter.check_rates/2`: each "key" of the loop
  is a whole list of `{key, limit, cost}` checks, built once (`checks/2`).
  """
  use Bench.Loop

  @doc "One all-or-nothing check of every bucket in `checks`."
  @spec check(GenServer.name(), [Bourse.RateLimiter.bucket_check()]) ::
          :ok | {:delay, pos_integer()}
  def check(limiter, checks), do: Bourse.RateLimiter.check_rates(checks, limiter)

  @doc """
  `count` check lists of cost 1 each: one credential per list, one bucket per axis of
  `axes`, all with `Bench.Loop.limit/0`.
  """
  @spec checks(pos_integer(), [String.t()]) :: tuple()
  def checks(count, axes) do
    List.to_tuple(
      for i <- 0..(count - 1) do
        for axis <- axes, do: {{"binance", "api-key-#{i}", axis}, Bench.Loop.limit(), 1}
      end
    )
  end
end
