defmodule Bench.PortFloor do
  @moduledoc """
  The floor under one caller's round trip through a port: this VM writing a frame of a
  check's size to `port_echo` (a peer that polls its input and does no work) and receiving
  it back, with the peer answering at once or some microseconds after it read. How long
  the peer takes decides whether this VM's threads are still awake when the answer comes.
  """

  @frame_bytes 200
  @warm_up 2_000

  @doc "Round trips per second and their p50 and p99 in µs, over `count` round trips."
  @spec measure(Path.t(), non_neg_integer(), pos_integer()) :: %{
          round_trips_per_second: float(),
          p50_us: float(),
          p99_us: float()
        }
  def measure(echo, answer_after_us, count) do
    port =
      Port.open({:spawn_executable, echo}, [
        :binary,
        packet: 4,
        args: ["--answer-after-us", Integer.to_string(answer_after_us)]
      ])

    frame = :binary.copy(<<0>>, @frame_bytes)
    for _ <- 1..@warm_up, do: round_trip(port, frame)
    times = for _ <- 1..count, do: timed(port, frame)
    Port.close(port)
    sorted = times |> Enum.sort() |> List.to_tuple()

    %{
      round_trips_per_second: count * 1.0e9 / Enum.sum(times),
      p50_us: elem(sorted, div(count, 2)) / 1000,
      p99_us: elem(sorted, div(count * 99, 100)) / 1000
    }
  end

  defp timed(port, frame) do
    before = System.monotonic_time(:nanosecond)
    round_trip(port, frame)
    System.monotonic_time(:nanosecond) - before
  end

  defp round_trip(port, frame) do
    true = Port.command(port, frame)
    receive do: ({^port, {:data, _echo}} -> :ok)
  end
end
