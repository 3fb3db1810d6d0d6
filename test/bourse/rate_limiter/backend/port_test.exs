defmodule Bourse.RateLimiter.Backend.PortTest do
  # What only the port backend has: a daemon OS process that can die under the limiter.
  use ExUnit.Case, async: true

  import Bourse.BackendCase, only: [flood: 2, handle: 1, port_os_pid: 1, routes: 1, stop_port: 1]
  import Bourse.ContractCase, only: [eventually: 1, eventually: 2, now_ms: 0]

  alias Bourse.{Error, OsSignal}
  alias Bourse.RateLimiter

  @moduletag :capture_log

  setup do
    name = :"port_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name, backend: :port})
    # The handle the limiter keeps for its callers: the port's connection, whose table
    # holds the route (id and reply alias) of each request in flight.
    %{name: name, handle: handle(name)}
  end

  # A stopped limiter's daemon waits 5 s for a limiter started under its name, then ends:
  # a limiter stopped for good leaves no OS process behind.
  test "a stopped limiter's daemon ends 5 s after the stop when no limiter takes it over",
       %{name: name, handle: handle} do
    os_pid = port_os_pid(handle)
    connection = Process.monitor(handle.pid)
    stopped_at = now_ms()
    :ok = stop_supervised(name)
    assert File.exists?("/proc/#{os_pid}")
    assert_receive {:DOWN, ^connection, :process, _, :normal}, 10_000
    assert now_ms() - stopped_at >= 5_000
    eventually(fn -> not File.exists?("/proc/#{os_pid}") end, 5_000)
    assert {:noproc, _} = catch_exit(RateLimiter.inspect_key({"ex", "k"}, name))
  end

  # Other options make another daemon command line: the new limiter's daemon is a new one,
  # which assumes every bucket busy and is asked for the pauses the previous one held.
  test "restarted within 5 s with other options: pauses and bans stay, spent tokens stay spent",
       %{name: name} do
    limit = %{capacity: 5, refill_per_sec: 0.001}
    for _ <- 1..5, do: assert(:ok = RateLimiter.check_rate({"ex", "k"}, limit, 1, name))
    assert :ok = RateLimiter.pause({"ex", "paused"}, 60_000, name)

    assert {:error, %Error{stop: true}} =
             RateLimiter.observe_response("banned", "k", 418, [{"retry-after", "600"}], name)

    :ok = stop_supervised(name)
    start_supervised!({RateLimiter, name: name, backend: :port, booking_slack_ms: 300})

    assert {:delay, _} = RateLimiter.check_rate({"ex", "k"}, limit, 1, name)
    # Buckets that refill at once: only a pause holds them.
    fast = %{capacity: 5, refill_per_sec: 1_000}
    assert {:delay, ms} = RateLimiter.check_rate({"ex", "paused"}, fast, 1, name)
    assert ms in 50_000..60_000
    assert {:delay, ms} = RateLimiter.check_rate({"banned", "k"}, fast, 1, name)
    assert ms in 590_000..600_000
  end

  test "a limiter of another backend started within 5 s assumes every bucket busy",
       %{name: name} do
    limit = %{capacity: 5, refill_per_sec: 0.001}
    for _ <- 1..5, do: assert(:ok = RateLimiter.check_rate({"ex", "k"}, limit, 1, name))
    :ok = stop_supervised(name)
    start_supervised!({RateLimiter, name: name, backend: :nif})
    assert {:delay, _} = RateLimiter.check_rate({"ex", "k"}, limit, 1, name)
    assert {:delay, _} = RateLimiter.check_rate({"ex", "other"}, limit, 1, name)
  end

  test "an unknown cast or call to the connection process is ignored, the limiter goes on",
       %{name: name, handle: handle} do
    connection = handle.pid
    GenServer.cast(connection, {:not_a_request, "x"})
    assert {:error, %Error{type: :invalid_parameters}} = GenServer.call(connection, :nonsense)
    assert Process.alive?(connection)

    assert :ok =
             RateLimiter.check_rate({"ex", "after"}, %{capacity: 1, refill_per_sec: 1}, 1, name)
  end

  test "kill -9 of the daemon: callers in flight get :unavailable, then a replacement that assumes every bucket busy",
       %{name: name, handle: handle} do
    limit = %{capacity: 10, refill_per_sec: 1}
    drained = {"ex", "drained"}
    for _ <- 1..10, do: assert(:ok = RateLimiter.check_rate(drained, limit, 1, name))
    old = port_os_pid(handle)

    # Callers hammering all along, and callers certainly in flight: the daemon is stopped
    # while they call, then killed.
    deadline = now_ms() + 1_500

    hammers =
      for i <- 1..8, do: Task.async(fn -> hammer({"ex", "h#{i}"}, limit, name, deadline, []) end)

    OsSignal.send(old, "STOP")

    stuck =
      for i <- 1..16 do
        Task.async(fn -> RateLimiter.check_rate({"ex", "k#{i}"}, limit, 1, name) end)
      end

    # Every stuck caller has its route in the table: beside them, each hammer still running
    # has one call in flight (16 routes alone may be 8 hammers' and 8 stuck callers'). And
    # every one of them has its frame written to the stopped daemon's stdin: a frame handed
    # to the connection may still be in its mailbox, and written after the kill, it closes
    # the port with :epipe before the VM has read the daemon's exit status.
    eventually(fn ->
      callers = Enum.filter(stuck ++ hammers, &Process.alive?(&1.pid))

      routes(handle) >= 16 + Enum.count(hammers, &Process.alive?(&1.pid)) and
        Enum.all?(callers, &awaiting_answer?(&1.pid)) and
        :sys.get_state(handle.pid).pending == []
    end)

    killed_at = now_ms()
    OsSignal.send(old, "KILL")

    for answer <- Task.await_many(stuck, 10_000) do
      assert {:error, %Error{type: :unavailable, message: message}} = answer
      assert message =~ "exited with status 137"
    end

    for answers <- Task.await_many(hammers, 30_000), answer <- answers do
      assert match?(:ok, answer) or match?({:delay, _}, answer) or
               match?({:error, %Error{type: :unavailable}}, answer),
             "unexpected answer #{inspect(answer)}"
    end

    # A new daemon serves, and the limiter process never noticed.
    assert port_os_pid(handle) != old
    assert :ok = RateLimiter.check_rate({"ex", "new"}, %{requests: 1_000, period: 1}, 1, name)

    # The drained key is not handed a fresh full bucket: the new table assumed it busy.
    admitted =
      Enum.count(1..10, fn _ -> RateLimiter.check_rate(drained, limit, 1, name) == :ok end)

    elapsed_s = (now_ms() - killed_at) / 1000
    assert admitted <= 1 + limit.refill_per_sec * elapsed_s, "#{admitted} admitted after a crash"
  end

  @tag timeout: 60_000
  test "a daemon that stops reading: callers give up after the timeout, none hangs",
       %{name: name, handle: handle} do
    os_pid = stop_port(handle)

    # Megabytes the daemon does not read: the port is busy, later writers wait, not block.
    callers =
      [flood(name, %{capacity: 10, refill_per_sec: 1})] ++
        for i <- 1..8 do
          Task.async(fn -> RateLimiter.check_rate({"ex", "k#{i}"}, %{requests: 10}, 1, name) end)
        end

    for answer <- Task.await_many(callers, 30_000) do
      assert {:error, %Error{type: :unavailable}} = answer
    end

    OsSignal.send(os_pid, "CONT")

    eventually(fn ->
      RateLimiter.check_rate({"ex", "after"}, %{requests: 10}, 1, name) == :ok
    end)
  end

  # Pauses live in the daemon's table, which --assume-busy-at-start does not rebuild.
  test "kill -9 of the daemon: the pauses in force hold in its replacement, until they end",
       %{name: name, handle: handle} do
    limit = %{capacity: 10, refill_per_sec: 10}
    assert :ok = RateLimiter.check_rate({"ex", "k", "ip"}, limit, 1, name)

    assert {:error, %Error{retry_after: 30_000}} =
             RateLimiter.observe_response("ex", "k", 429, [{"retry-after", "30"}], name)

    assert :ok = RateLimiter.pause("other", 1, name)
    os_pid = port_os_pid(handle)
    OsSignal.send(os_pid, "KILL")

    eventually(fn -> port_os_pid(handle(name)) != os_pid end)
    assert {:delay, ms} = RateLimiter.check_rate({"ex", "k", "ip"}, limit, 1, name)
    assert ms > 25_000
    assert RateLimiter.inspect_key({"ex", "k", "ip"}, name).pause_ms > 25_000
    # Ended pauses are not asked again (a refill this fast fills the bucket of a daemon
    # that assumes every bucket busy at once).
    assert :ok = RateLimiter.check_rate({"other", "k"}, %{limit | refill_per_sec: 1.0e6}, 1, name)
  end

  test "the connection process killed: the pauses in force hold in the restarted limiter's daemon",
       %{name: name, handle: handle} do
    fast = %{capacity: 5, refill_per_sec: 1_000}
    assert :ok = RateLimiter.pause({"ex", "paused"}, 60_000, name)

    assert {:error, %Error{retry_after: 30_000}} =
             RateLimiter.observe_response("ex", "k", 429, [{"retry-after", "30"}], name)

    Process.exit(handle.pid, :kill)

    eventually(fn ->
      match?(%{pid: pid} when pid != handle.pid, handle(name)) and
        RateLimiter.check_rate({"other", "k"}, %{fast | refill_per_sec: 1.0e6}, 1, name) == :ok
    end)

    assert {:delay, ms} = RateLimiter.check_rate({"ex", "paused"}, fast, 1, name)
    assert ms in 50_000..60_000
    assert {:delay, ms} = RateLimiter.check_rate({"ex", "k", "ip"}, fast, 1, name)
    assert ms in 25_000..30_000
  end

  # A caller alone in flight reads its own answer only while the table of requests holds
  # nothing but the stream and its own route.
  test "a remembered pause leaves the table of requests as it was", %{name: name} do
    table = handle(name).table
    before = :ets.info(table, :size)
    assert :ok = RateLimiter.pause("unrelated", 60_000, name)
    assert :ets.info(table, :size) == before
  end

  test "kill -9 of the daemon: pauses a reset ended are not asked again of its replacement",
       %{name: name} do
    fast = %{capacity: 1, refill_per_sec: 1.0e6}

    pause = fn target -> &RateLimiter.pause(target, 30_000, &1) end
    limited = &RateLimiter.observe_response("ex", "k", 429, [{"retry-after", "30"}], &1)
    reset_exchange = &RateLimiter.reset_exchange("ex", &1)

    for {paused, reset} <- [
          {pause.("ex"), reset_exchange},
          {pause.({"ex", "k"}), reset_exchange},
          {pause.({"ex", "k", "ip"}), reset_exchange},
          {limited, reset_exchange},
          {pause.({"ex", "k", "ip"}), &RateLimiter.reset({"ex", "k", "ip"}, &1)},
          {pause.({"ex", "k"}), &RateLimiter.reset_all/1}
        ] do
      paused.(name)
      assert {:delay, _} = RateLimiter.check_rate({"ex", "k", "ip"}, fast, 1, name)
      assert :ok = reset.(name)
      os_pid = port_os_pid(handle(name))
      OsSignal.send(os_pid, "KILL")
      eventually(fn -> port_os_pid(handle(name)) != os_pid end)

      assert :ok =
               eventually(fn ->
                 RateLimiter.check_rate({"ex", "k", "ip"}, fast, 1, name) == :ok and :ok
               end)
    end
  end

  test "callers killed while their requests are in flight: the answers go nowhere, the port serves on",
       %{name: name, handle: handle} do
    os_pid = stop_port(handle)

    callers =
      for i <- 1..8,
          do: spawn(fn -> RateLimiter.check_rate({"ex", "k#{i}"}, %{requests: 10}, 1, name) end)

    eventually(fn -> routes(handle) == 8 end)
    Enum.each(callers, &Process.exit(&1, :kill))
    OsSignal.send(os_pid, "CONT")

    # Their answers came and were dropped with their routes.
    eventually(fn -> routes(handle) == 0 end)
    assert Process.alive?(handle.pid)
    assert :ok = RateLimiter.check_rate({"ex", "after"}, %{requests: 10}, 1, name)
    assert {:messages, []} = Process.info(self(), :messages)
  end

  @tag timeout: 60_000
  test "callers killed while they wait for a busy port to take their requests leave nothing behind",
       %{name: name, handle: handle} do
    os_pid = stop_port(handle)

    # Megabytes the daemon does not read: the port is busy, later writers wait for it.
    flooder = flood(name, %{capacity: 10, refill_per_sec: 1})
    eventually(fn -> routes(handle) == 1 end)
    Process.sleep(100)

    waiting =
      for i <- 1..8,
          do: spawn(fn -> RateLimiter.check_rate({"ex", "k#{i}"}, %{requests: 10}, 1, name) end)

    Process.sleep(200)
    Enum.each(waiting, &Process.exit(&1, :kill))
    OsSignal.send(os_pid, "CONT")
    # Answered, or given up if the daemon took longer than the timeout to read it all.
    flooded = Task.await(flooder, 30_000)
    assert flooded == :ok or match?({:error, %Error{type: :unavailable}}, flooded)

    # The flood's answer came. A killed caller whose request was never written leaves its
    # route until the connection drops it past its deadline: it looks once per timeout
    # (5 s), so at most two timeouts after the caller started.
    eventually(fn -> routes(handle) == 0 end, 12_000)
    assert :ok = RateLimiter.check_rate({"ex", "after"}, %{requests: 10}, 1, name)
  end

  test "the largest request the limiter accepts fits in one frame", %{name: name} do
    # 1024 checks of three 1024-byte key parts that JSON must escape (\u0001: six bytes each).
    part = String.duplicate("\u0001", 1024)
    limit = %{capacity: 1.0e6, refill_per_sec: 1}
    checks = for i <- 1..1024, do: {{part, part, "#{i}" <> String.slice(part, 0, 1000)}, limit, 1}

    assert :ok = RateLimiter.check_rates(checks, name)

    assert {:error, %Error{type: :invalid_parameters}} =
             RateLimiter.check_rates([hd(checks) | checks], name)
  end

  # Whether `pid`, a caller with its route in the table, wrote (or handed over) its request:
  # it then waits in `receive` for the answer.
  defp awaiting_answer?(pid), do: Process.info(pid, :status) == {:status, :waiting}

  defp hammer(key, limit, name, deadline, answers) do
    if now_ms() >= deadline,
      do: answers,
      else:
        hammer(key, limit, name, deadline, [RateLimiter.check_rate(key, limit, 1, name) | answers])
  end
end
