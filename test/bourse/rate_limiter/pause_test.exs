defmodule Bourse.RateLimiter.PauseTest do
  # pause/3 across processes and against bookings made before it; the single-caller
  # rules (targets, probes, invalid input) are in the contract suite.
  use ExUnit.Case, async: true

  import Bourse.ContractCase, only: [booked_waiter: 4, eventually: 1, eventually: 2, now_ms: 0]

  alias Bourse.RateLimiter

  @limit %{capacity: 5, refill_per_sec: 10}

  setup do
    name = :"pause_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name})
    %{name: name}
  end

  # The pause is 5 s: the probes find it although a loaded machine starts them late.
  test "every caller is held at once: probes in other processes answer the remaining pause",
       %{name: name} do
    assert :ok = RateLimiter.pause({"ex", "k"}, 5_000, name)

    answers =
      1..8
      |> Task.async_stream(
        fn i ->
          RateLimiter.check_rate({"ex", "k", "axis#{rem(i, 3)}"}, @limit, 1, name)
        end,
        max_concurrency: 8
      )
      |> Enum.map(fn {:ok, answer} -> answer end)

    for answer <- answers, do: assert({:delay, ms} = answer) && assert(ms in 1..5_000)
    assert RateLimiter.get_cost({"ex", "k", "axis0"}, nil, name) == 0
  end

  # Admissions are timed from before the pause began, not from the waiters' start (a loaded
  # machine may start them late in the pause).
  test "waiters in several processes book behind the pause", %{name: name} do
    paused_at = now_ms()
    assert :ok = RateLimiter.pause("ex", 300, name)

    waits =
      1..3
      |> Task.async_stream(
        fn _ ->
          assert :ok = RateLimiter.wait_for_capacity({"ex", "k"}, @limit, 2, name)
          now_ms() - paused_at
        end,
        max_concurrency: 3
      )
      |> Enum.map(fn {:ok, ms} -> ms end)

    # The bucket holds enough for all three, but none goes before the pause ends.
    assert Enum.all?(waits, &(&1 >= 290)), inspect(waits)
  end

  test "a pause begun after a booking holds the booking too", %{name: name} do
    key = {"ex", "k"}
    # A token in 1 s: the booking is still waiting when the pause begins, on a loaded
    # machine too.
    limit = %{capacity: 5, refill_per_sec: 1}
    assert :ok = RateLimiter.check_rate(key, limit, 5, name)

    task =
      Task.async(fn ->
        answer = RateLimiter.wait_for_capacity(key, limit, 1, name)
        {answer, now_ms()}
      end)

    eventually(fn -> match?(%{bookings: 1}, RateLimiter.inspect_key(key, name)) end)
    paused_at = now_ms()
    assert :ok = RateLimiter.pause(key, 1_500, name)
    # Ready within 1 s of the pause, the booking was moved to its end.
    assert {:ok, admitted_at} = Task.await(task, 10_000)
    assert admitted_at - paused_at >= 1_450
  end

  # Past the 5 s takeover the new limiter has a table of its own: the waiter's claim goes
  # there, where the pause is, not to the table it booked in.
  test "a pause recorded through a limiter restarted while a waiter slept holds the waiter" do
    name = :"pause_restarted_#{System.unique_integer([:positive])}"
    {:ok, first} = RateLimiter.start_link(name: name, booking_slack_ms: 5_000)
    Process.unlink(first)
    # Ready in 8 s.
    limit = %{capacity: 1, refill_per_sec: 0.125}
    assert :ok = RateLimiter.check_rate({"ex", "k"}, limit, 1, name)

    waiter = booked_waiter({"ex", "k"}, limit, name, 12_000)
    GenServer.stop(first)
    eventually(fn -> :persistent_term.get({RateLimiter, name}, nil) == nil end, 7_000)
    {:ok, second} = RateLimiter.start_link(name: name)
    Process.unlink(second)
    on_exit(fn -> if Process.alive?(second), do: GenServer.stop(second) end)
    assert :ok = RateLimiter.pause({"ex", "k"}, 60_000, name)

    assert {:error, %Bourse.Error{type: :rate_limit_exceeded}} = Task.await(waiter, 15_000)
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
