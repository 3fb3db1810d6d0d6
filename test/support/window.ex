defmodule Bourse.Window do
  @moduledoc """
  The exchange windows of header sync in tests: wall-clock multiples of `window_ms`.
  """

  @doc "Milliseconds until the current window of `window_ms` ends."
  def left(window_ms), do: window_ms - rem(System.os_time(:millisecond), window_ms)

  @doc """
  Waits for the next window of `window_ms` when this one ends within a second, so that a
  sync and the reading that checks it fall in one window, on a slow machine too.
  """
  def clear_of_end(window_ms) do
    left = left(window_ms)
    if left < 1_000, do: Process.sleep(left + 10)
    :ok
  end
end
