defmodule Bourse.RateLimiter.CallDeadline do
  @moduledoc false
  # One timeout for a call made of several requests to a daemon or Redis
  # (`Bourse.RateLimiter.observe_response/6`: a pause, and per used-weight header a read
  # and a sync): within `shared/1`, a limiter's first request sets the deadline of its later
  # ones (`Bourse.RateLimiter.Backend.Connection` asks `deadline/2`), so the call answers
  # within one timeout however slow the store is; a request answered `:unavailable` after
  # waiting for it (the daemon's store did not answer within its own timeout) gives that
  # answer to the later ones at once (`slow/2`), as their store could not answer them in
  # time either. User code run meanwhile (event callbacks,
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
  # connection) whose own is `own`: the earlier one a shared call set for that limiter; or
  # `{:answered, answer}`, the `:unavailable` answer an earlier request of the call got.
  @spec deadline(term(), integer()) :: integer() | {:answered, term()}
  def deadline(limiter, own) do
    case Process.get(@key) do
      nil ->
        own

      deadlines ->
        case Map.fetch(deadlines, limiter) do
          {:ok, deadline} when is_integer(deadline) ->
            min(deadline, own)

          {:ok, answered} ->
            answered

          :error ->
            Process.put(@key, Map.put(deadlines, limiter, own))
            own
        end
    end
  end

  @doc false
  # Notes the answer of a request to `limiter` that was slow to come (the connection
  # judges), and returns it: within a shared call, an `:unavailable` one answers the call's
  # later requests to `limiter`. One that came at once (a key of another type in Redis,
  # say) is not noted: the later requests cost little, and a limited reply's pause must
  # not be lost to it.
  @spec slow(term(), answer) :: answer when answer: term()
  def slow(limiter, answer) do
    with deadlines when is_map(deadlines) <- Process.get(@key),
         true <- unavailable?(answer) do
      Process.put(@key, Map.put(deadlines, limiter, {:answered, answer}))
    end

    answer
  end

  defp unavailable?(%{"ok" => false, "error" => %{"type" => "unavailable"}}), do: true
  defp unavailable?({:error, %Bourse.Error{type: :unavailable}}), do: true
  defp unavailable?(_answer), do: false
end
