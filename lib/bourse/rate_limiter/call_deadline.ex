defmodule Bourse.RateLimiter.CallDeadline do
  @moduledoc false
  # One timeout for a call made of several requests to a daemon or Redis
  # (`Bourse.RateLimiter.observe_response/6`: a pause, and per used-weight header a read
  # and a sync): within `shared/1`, a limiter's first request sets the deadline of its later
  # ones (`Bourse.RateLimiter.Backend.Connection` asks `deadline/2`), so the call answers
  # within one timeout however slow the store is. User code run meanwhile (event callbacks,
  # telemetry handlers: `outside/1`) keeps its own calls' timeouts. Kept in the calling
  # process's dictionary, for that process alone.

  @key {__MODULE__, :deadlines}

  @doc false
  # Runs `fun` with one deadline per limiter for its requests; within another such call,
  # `fun` shares its deadlines.
  @spec shared((() -> result)) :: result when result: term()
  def shared(fun) do
    if Process.get(@key) do
      fun.()
    else
      Process.put(@key, %{})

      try do
        fun.()
      after
        Process.delete(@key)
      end
    end
  end

  @doc false
  # Runs `fun` (the user's code) with its own requests' deadlines.
  @spec outside((() -> result)) :: result when result: term()
  def outside(fun) do
    case Process.delete(@key) do
      nil ->
        fun.()

      deadlines ->
        try do
          fun.()
        after
          Process.put(@key, deadlines)
        end
    end
  end

  @doc false
  # The deadline (monotonic ms) of a request to `limiter` (any term naming its
  # connection) whose own is `own`: the earlier one a shared call set for that limiter.
  @spec deadline(term(), integer()) :: integer()
  def deadline(limiter, own) do
    case Process.get(@key) do
      nil ->
        own

      deadlines ->
        case Map.fetch(deadlines, limiter) do
          {:ok, deadline} ->
            min(deadline, own)

          :error ->
            Process.put(@key, Map.put(deadlines, limiter, own))
            own
        end
    end
  end
end
