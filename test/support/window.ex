defmodule Bourse.Window do
  @moduledoc """
  The exchange windows of header sync in tests: wall-clock multiples of `window_ms`.
  """

  @doc "Milliseconds until the current window of `window_ms` ends."
  def left(window_ms), do: window_ms - rem(System.os_time(:millisecond), window_ms)

  @doc """
  Waits until the current window of `window_ms` is past its start, where a reading
  without a `Date` is not applied (its first second, its first tenth when shorter), and
  for the next one when this one ends within a second: a sync and the reading that checks
  it fall in one window, on a slow machine too.
  """
  def clear_of_edges(window_ms) do
    into = rem(System.os_time(:millisecond), window_ms)
    start = min(1_000, div(window_ms, 10)) + 100

    cond do
      window_ms - into < 1_000 -> Process.sleep(window_ms - into + start)
      into < start -> Process.sleep(start - into)
      true -> :ok
    end
  end
end
