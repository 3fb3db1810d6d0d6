defmodule Bourse.RateLimiter.Backend.StoppedDaemonTest do
  # An in-memory daemon stopped again and again while callers with a short timeout check
  # and retry at once on the same key: a caller told `:unavailable` never pays, also when
  # the daemon was stopped between running its check and sending the answer (the answer
  # is then settled as too late), and also when the resumed daemon ran the caller's retry,
  # or another connection's check, on that bucket before the late answer went out.
  # Before answers were settled, 12 to 14 of the 640 callers told :unavailable had paid;
  # before a late answer was given back past later payments, up to 15 (a key per caller)
  # and 8 (one key over two connections); before a bucket with nothing left to give back
  # (refilled past its capacity) let the others be given back, up to 21; before debits
  # were given back, up to 18; before answers settled in time and sent late (a stop between
  # settling and writing) were asked back by the connection, 16 in 2 of 4 loaded runs.
  use ExUnit.Case, async: false

  import Bourse.BackendCase, only: [start_daemon: 1, start_limiter: 1]
  import Bourse.ContractCase, only: [eventually: 1]

  alias Bourse.{Error, OsSignal}
  alias Bourse.RateLimiter

  @moduletag :capture_log
  @moduletag timeout: 120_000

  @callers 16
  # The counts above were measured with 40 stops per test.
  @stops 24
  # Nothing refills within the test's tolerance: what a bucket lent is what it paid.
  @limit %{capacity: 1.0e6, refill_per_sec: 1.0e-6}

  test "callers retrying on their own key never paid for what was told :unavailable" do
    {daemon, socket} = stopped_daemon()
    name = limiter(socket)
    keys = for i <- 1..@callers, do: {"stopped", "k#{i}"}
    counts = check_through_stops(daemon, Enum.map(keys, &{&1, name}))
    paid = keys |> Enum.map(&RateLimiter.get_cost(&1, nil, name)) |> Enum.sum()
    assert_nothing_paid_for_unavailable(counts, paid, "own key, one connection")
  end

  test "callers of one key over two connections never paid for what was told :unavailable" do
    {daemon, socket} = stopped_daemon()
    names = [limiter(socket), limiter(socket)]
    key = {"stopped", "shared"}
    callers = for i <- 1..@callers, do: {key, Enum.at(names, rem(i, 2))}
    counts = check_through_stops(daemon, callers)
    paid = RateLimiter.get_cost(key, nil, hd(names))
    assert_nothing_paid_for_unavailable(counts, paid, "one key, two connections")
  end

  test "checks of a fast bucket beside a slow one never paid the slow one for :unavailable" do
    {daemon, socket} = stopped_daemon()
    names = [limiter(socket), limiter(socket)]
    # Refilled past its capacity within any stop: nothing of it is left to give back.
    fast = %{capacity: 1000, refill_per_sec: 1.0e6}

    callers =
      for i <- 1..@callers do
        checks = [{{"stopped", "fast"}, fast, 1}, {{"stopped", "k#{i}"}, @limit, 1}]
        {checks, Enum.at(names, rem(i, 2))}
      end

    for i <- 1..@callers,
        do: :ok = RateLimiter.check_rate({"stopped", "k#{i}"}, @limit, 0, hd(names))

    counts = check_through_stops(daemon, callers)

    paid =
      Enum.sum(
        for i <- 1..@callers, do: RateLimiter.get_cost({"stopped", "k#{i}"}, nil, hd(names))
      )

    assert_nothing_paid_for_unavailable(counts, paid, "fast and slow bucket, two connections")
  end

  test "debits told :unavailable were not debited" do
    {daemon, socket} = stopped_daemon()
    names = [limiter(socket), limiter(socket)]
    keys = for i <- 1..@callers, do: {"stopped", "k#{i}"}
    for key <- keys, do: :ok = RateLimiter.check_rate(key, @limit, 0, hd(names))

    callers =
      for {key, i} <- Enum.with_index(keys), do: {{:debit, key}, Enum.at(names, rem(i, 2))}

    counts = check_through_stops(daemon, callers)
    paid = keys |> Enum.map(&RateLimiter.get_cost(&1, nil, hd(names))) |> Enum.sum()
    assert_nothing_paid_for_unavailable(counts, paid, "debits, two connections")
  end

  defp stopped_daemon do
    socket =
      Path.join(System.tmp_dir!(), "bourse_stopped_#{System.unique_integer([:positive])}.sock")

    daemon = start_daemon(["--socket", socket])
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{daemon.os_pid}"], stderr_to_stdout: true) end)
    {daemon, socket}
  end

  defp limiter(socket) do
    name = start_limiter({:daemon, {:unix, socket}, timeout: 200})
    eventually(fn -> RateLimiter.check_rate({"warm", "up"}, @limit, 1, name) == :ok end)
    RateLimiter.reset({"warm", "up"}, name)
    name
  end

  # Runs a caller per `{what, limiter}` (a key to check, `{:debit, key}` or a list of
  # checks for `check_rates/2`) until the daemon was stopped and resumed @stops times;
  # returns each caller's admitted and :unavailable counts.
  defp check_through_stops(daemon, callers) do
    running = :atomics.new(1, [])
    :atomics.put(running, 1, 1)

    tasks =
      for {key, name} <- callers do
        Task.async(fn -> check_until_stopped(key, name, running, {0, 0}) end)
      end

    for _ <- 1..@stops do
      Process.sleep(60)
      OsSignal.send(daemon.os_pid, "STOP")
      Process.sleep(260)
      OsSignal.send(daemon.os_pid, "CONT")
    end

    :atomics.put(running, 1, 0)
    Task.await_many(tasks, 30_000)
  end

  defp assert_nothing_paid_for_unavailable(counts, paid, case_name) do
    {admitted, unavailable} =
      Enum.reduce(counts, {0, 0}, fn {ok, unavailable}, {a, u} -> {a + ok, u + unavailable} end)

    IO.puts(
      "\nin-memory daemon stopped #{@stops} times for 260 ms, #{@callers} callers waiting " <>
        "200 ms (#{case_name}): #{admitted} admitted, #{unavailable} told :unavailable, " <>
        "#{Float.round(paid - admitted, 2)} tokens paid beyond the admitted"
    )

    # Each stop holds one check of every caller past its timeout. Any further :unavailable
    # is a caller the machine's load kept from reading an answer sent in time, which no
    # daemon can know of: only those may have paid.
    missed_by_load = unavailable - @callers * @stops
    assert missed_by_load >= 0
    assert paid - admitted <= missed_by_load + 0.01
  end

  defp check_until_stopped(what, name, running, {admitted, unavailable} = counts) do
    if :atomics.get(running, 1) == 0 do
      counts
    else
      case call(what, name) do
        :ok ->
          check_until_stopped(what, name, running, {admitted + 1, unavailable})

        {:error, %Error{type: :unavailable}} ->
          check_until_stopped(what, name, running, {admitted, unavailable + 1})
      end
    end
  end

  defp call({:debit, key}, name), do: RateLimiter.record_request(key, 1, name)
  defp call(checks, name) when is_list(checks), do: RateLimiter.check_rates(checks, name)
  defp call(key, name), do: RateLimiter.check_rate(key, @limit, 1, name)
end
