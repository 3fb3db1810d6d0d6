defmodule Bench.Loop do
  @moduledoc """
  The compiled loop every implementation runs. `use Bench.Loop` in a module that defines
  `check(handle, key)` (answering `:ok`) gives it `run(handle, keys, first, count)`:
  `count` checks, tail-recursive, over the keys of the tuple `keys` from index `first`.
  """

  @doc """
  The limit of every workload: so large that every check is admitted, also by a peer
  whose caller was held up for long between reading the clock and paying (a burst of
  1,000 s at the refill rate).
  """
  defmacro limit, do: Macro.escape(%{capacity: 1.0e12, refill_per_sec: 1.0e9})

  defmacro __using__(_opts) do
    quote do
      require Bench.Loop

      @doc "Runs `count` checks over the keys in `keys`, starting at index `first`."
      @spec run(term(), tuple(), non_neg_integer(), non_neg_integer()) :: :ok
      def run(handle, keys, first, count), do: loop(handle, keys, tuple_size(keys), first, count)

      defp loop(_handle, _keys, _size, _index, 0), do: :ok

      defp loop(handle, keys, size, index, left) do
        :ok = check(handle, elem(keys, rem(index, size)))
        loop(handle, keys, size, index + 1, left - 1)
      end
    end
  end
end
