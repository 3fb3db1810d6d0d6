defmodule Bench.PublicAPI do
  @moduledoc """
  Checks through `Bourse.RateLimiter.check_rate/4`. The handle is a limiter's name, or a
  tuple of names: each key then goes to one of them, by its hash.
  """
  use Bench.Loop

  @doc "One check of cost 1."
  @spec check(GenServer.name() | tuple(), Bourse.RateLimiter.key()) ::
          :ok | {:delay, pos_integer()}
  def check(limiters, key) when is_tuple(limiters),
    do: check(elem(limiters, :erlang.phash2(key, tuple_size(limiters))), key)

  def check(limiter, key), do: Bourse.RateLimiter.check_rate(key, Bench.Loop.limit(), 1, limiter)
end
