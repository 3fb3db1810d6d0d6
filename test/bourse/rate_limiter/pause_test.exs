defmodule Bourse.RateLimiter.PauseTest do
  # pause/3 across processes and against bookings made before it; the single-caller
  # rules (targets, probes, invalid input) are in the contract suite.
  use ExUnit.Case, async: true

  alias Bourse.RateLimiter

  @limit %{capacity: 5, refill_per_sec: 10}

  setup do
    name = :"pause_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name})
    %{name: name}
  end

  defp timed(fun) do
    started = System.monotonic_time(:millisecond)
    answer = fun.()
    {System.monotonic_time(:millisecond) - started, answer}
  end

  test "every caller is held at once: probes in other processes answer the remaining pause",
       %{name: name} do
    assert :ok = RateLimiter.pause({"ex", "k"}, 1_000, name)

    answers =
      1..8
      |> Task.async_stream(
        fn i ->
          RateLimiter.check_rate({"ex", "k", "axis#{rem(i, 3)}"}, @limit, 1, name)
        end,
        max_concurrency: 8
      )
      |> Enum.map(fn {:ok, answer} -> answer end)

    for answer <- answers, do: assert({:delay, ms} = answer) && assert(ms in 1..1_000)
    assert RateLimiter.get_cost({"ex", "k", "axis0"}, nil, name) == 0
  end

  test "waiters in several processes book behind the pause", %{name: name} do
    assert :ok = RateLimiter.pause("ex", 300, name)

    waits =
      1..3
      |> Task.async_stream(
        fn _ ->
          timed(fn -> RateLimiter.wait_for_capacity({"ex", "k"}, @limit, 2, name) end)
        end,
        max_concurrency: 3
      )
      |> Enum.map(fn {:ok, {ms, :ok}} -> ms end)

    # The bucket holds enough for all three, but none goes before the pause ends.
    assert Enum.all?(waits, &(&1 >= 250)), inspect(waits)
  end

  test "a pause begun after a booking holds the booking too", %{name: name} do
    key = {"ex", "k"}
    assert :ok = RateLimiter.check_rate(key, @limit, 5, name)

    task =
      Task.async(fn -> timed(fn -> RateLimiter.wait_for_capacity(key, @limit, 1, name) end) end)

    # The booking is ready in 100 ms; the pause moves it to 400 ms.
    Process.sleep(20)
    assert :ok = RateLimiter.pause(key, 400, name)
    assert {ms, :ok} = Task.await(task)
    assert ms >= 350
  end

  test "a longer pause extends a shorter one; a shorter one never shortens", %{name: name} do
    key = {"ex", "k", "ip"}
    assert :ok = RateLimiter.pause(key, 200, name)
    assert :ok = RateLimiter.pause({"ex", "k"}, 2_000, name)
    assert :ok = RateLimiter.pause(key, 10, name)
    assert {:delay, ms} = RateLimiter.check_rate(key, @limit, 1, name)
    # Longer than the 200 ms pause left, even on a loaded machine.
    assert ms in 500..2_000
  end
end
