defmodule Bourse.Window do
  @moduledoc """
  The exchange windows of header sync in tests: wall-clock multiples of `window_ms`.
  """

  @doc "Milliseconds until the current window of `window_ms` ends."
  def left(window_ms), do: window_ms - rem(System.os_time(:millisecond), window_ms)

  @doc """
  Waits until the current window of `window_ms` (or of each of a list of windows) is past
  its start, where a reading without a `Date` is not applied (its first second, its first
  tenth when shorter), and, when it ends within a second (its last half when shorter),
  for the next one: a sync and the reading that checks it fall in one window, on a slow
  machine too.
  """
  def clear_of_edges(windows) when is_list(windows) do
    case windows |> Enum.map(&wait_ms/1) |> Enum.max() do
      0 ->
        :ok

      ms ->
        Process.sleep(ms)
        clear_of_edges(windows)
    end
  end

  def clear_of_edges(window_ms), do: clear_of_edges([window_ms])

  defp wait_ms(window_ms) do
    into = rem(System.os_time(:millisecond), window_ms)
    start = min(1_000, div(window_ms, 10)) + 100
    stop = window_ms - min(1_000, div(window_ms, 2))

    cond do
      into >= stop -> window_ms - into + start
      into < start -> start - into
      true -> 0
    end
  end
end
