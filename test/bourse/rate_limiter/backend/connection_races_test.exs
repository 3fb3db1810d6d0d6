defmodule Bourse.RateLimiter.Backend.ConnectionRacesTest do
  # Callers of the port and daemon backends write to the stream themselves: what happens to
  # them, to their routes in the connection's table and to their mailboxes when they die,
  # time out, or the daemon stops, dies or its connection process is killed.
  use ExUnit.Case, async: true

  import Bourse.BackendCase
  import Bourse.ContractCase, only: [eventually: 1, now_ms: 0]

  alias Bourse.DaemonServer
  alias Bourse.Error
  alias Bourse.RateLimiter

  @moduletag :capture_log

  @wide %{capacity: 1.0e9, refill_per_sec: 1.0e9}

  describe "many callers and a daemon that stops or dies" do
    @tag timeout: 60_000
    test "64 callers, the daemon stopped: each is answered :unavailable, within its timeout" do
      timeout = 400
      {daemon, name} = start_connected_daemon(timeout: timeout)
      DaemonServer.signal(daemon, "STOP")

      callers =
        for i <- 1..64 do
          Task.async(fn ->
            started = now_ms()
            answer = RateLimiter.check_rate({"ex", "k#{i}"}, @wide, 1, name)
            {answer, now_ms() - started}
          end)
        end

      for {answer, elapsed} <- Task.await_many(callers, 30_000) do
        assert {:error, %Error{type: :unavailable}} = answer
        # Generous: 2 cores shared by many builds.
        assert elapsed < timeout + 5_000, "answered after #{elapsed} ms"
      end

      assert routes(handle(name)) == 0
      DaemonServer.signal(daemon, "CONT")
      eventually(fn -> RateLimiter.check_rate({"ex", "after"}, @wide, 1, name) == :ok end)
      assert {:messages, []} = Process.info(self(), :messages)
    end

    @tag timeout: 60_000
    test "64 callers hammering, the daemon killed: every answer is an answer or :unavailable, no route is left" do
      {daemon, name} = start_connected_daemon(timeout: 1_000)
      stop_at = now_ms() + 1_500

      callers =
        for i <- 1..64 do
          Task.async(fn -> hammer({"ex", "h#{i}"}, name, stop_at, []) end)
        end

      Process.sleep(300)
      DaemonServer.kill(daemon)

      answers = callers |> Task.await_many(30_000) |> List.flatten()
      assert Enum.any?(answers, fn {answer, _elapsed} -> unavailable?(answer) end)

      # Hundreds of thousands once the daemon is gone (each fails at once): the message of
      # an assertion per answer, built whether it fails or not, took most of a minute.
      assert Enum.reject(answers, fn {answer, _elapsed} -> answered?(answer) end) == []
      assert Enum.max_by(answers, &elem(&1, 1)) |> elem(1) < 1_000 + 5_000
      assert routes(handle(name)) == 0
    end
  end

  describe "callers that give up or die" do
    @tag timeout: 120_000
    test "callers whose timeout fires while their answers are on the way: no late message, no route left" do
      daemon = start_daemon(["--listen", "127.0.0.1:0"])
      # A timeout of 1 ms: most answers arrive about when their caller gives up (and the
      # daemon refuses many requests as read too late to be answered in time).
      name = start_limiter({:daemon, daemon.tcp, timeout: 1})

      eventually(fn ->
        match?(
          [{:stream, stream, _, _, _, _}] when stream != nil,
          :ets.lookup(handle(name).table, :stream)
        )
      end)

      callers =
        for i <- 1..8 do
          Task.async(fn ->
            answers =
              for j <- 1..300 do
                answer = RateLimiter.check_rate({"ex", "k#{i}-#{rem(j, 7)}"}, @wide, 1, name)
                {:messages, mailbox} = Process.info(self(), :messages)
                {answer, mailbox}
              end

            # Late answers would land after the last call too.
            Process.sleep(200)
            {:messages, mailbox} = Process.info(self(), :messages)
            {answers, mailbox}
          end)
        end

      for {answers, mailbox} <- Task.await_many(callers, 100_000) do
        assert mailbox == []

        for {answer, mailbox} <- answers do
          assert answer == :ok or unavailable?(answer), inspect(answer)
          assert mailbox == []
        end
      end

      eventually(fn -> routes(handle(name)) == 0 end)
    end

    test "the connection process killed while its callers wait: they are answered :unavailable at once, not at their timeout" do
      timeout = 20_000
      {daemon, name} = start_connected_daemon(timeout: timeout)
      handle = handle(name)
      DaemonServer.signal(daemon, "STOP")

      callers =
        for i <- 1..16 do
          Task.async(fn ->
            answer = RateLimiter.check_rate({"ex", "k#{i}"}, @wide, 1, name)
            {answer, now_ms()}
          end)
        end

      eventually(fn -> routes(handle) == 16 end)
      killed_at = now_ms()
      Process.exit(handle.pid, :kill)

      for {answer, answered_at} <- Task.await_many(callers, 2 * timeout) do
        assert {:error, %Error{type: :unavailable}} = answer
        # Generous: 2 cores shared by many builds; their timeout is 20 s.
        assert answered_at - killed_at < 5_000, "answered #{answered_at - killed_at} ms after"
      end

      DaemonServer.signal(daemon, "CONT")
      assert {:messages, []} = Process.info(self(), :messages)
    end

    test "the connection process killed: callers get :unavailable, the limiter comes back with a port that assumes every bucket busy" do
      name = start_limiter(:port)
      handle = handle(name)
      drained = {"ex", "drained"}
      limit = %{capacity: 10, refill_per_sec: 1}
      for _ <- 1..10, do: assert(:ok = RateLimiter.check_rate(drained, limit, 1, name))
      old_os_pid = port_os_pid(handle)

      callers =
        for i <- 1..16 do
          Task.async(fn -> hammer({"ex", "c#{i}"}, name, now_ms() + 500, []) end)
        end

      Process.sleep(100)
      killed_at = now_ms()
      Process.exit(handle.pid, :kill)

      # The limiter goes down with its connection and is restarted: a call in between
      # exits as for a limiter not running (docs/CONTRACT.md, "The limiter process").
      for {answer, _elapsed} <- callers |> Task.await_many(30_000) |> List.flatten() do
        assert answer == :ok or match?({:delay, _}, answer) or unavailable?(answer) or
                 answer == {:exit, :noproc},
               inspect(answer)
      end

      eventually(fn -> RateLimiter.check_rate({"ex", "after"}, @wide, 1, name) == :ok end)
      assert port_os_pid(handle(name)) != old_os_pid

      admitted =
        Enum.count(1..10, fn _ -> RateLimiter.check_rate(drained, limit, 1, name) == :ok end)

      elapsed_s = (now_ms() - killed_at) / 1000
      assert admitted <= 1 + limit.refill_per_sec * elapsed_s, "#{admitted} admitted"
      assert {:messages, []} = Process.info(self(), :messages)
    end
  end

  describe "frames handed to the connection" do
    test "a frame handed over for a stream that broke since: its caller is answered :unavailable at once" do
      name = start_limiter(:port)
      handle = handle(name)
      reply_to = :erlang.alias([:reply])
      id = System.unique_integer([:positive])
      :ets.insert(handle.table, {id, {reply_to, now_ms() + 60_000}})
      send(handle.pid, {:write, make_ref(), id, "a frame"})

      assert_receive {^reply_to, {:error, %Error{type: :unavailable}}}, 5_000
      assert routes(handle) == 0
      assert :ok = RateLimiter.check_rate({"ex", "after"}, @wide, 1, name)
    end

    @tag timeout: 60_000
    test "64 callers on a port: every answer is its own, whether written by its caller or with others" do
      name = start_limiter(:port)
      stop_at = now_ms() + 1_000
      # A bucket per caller that admits 3 checks and then says how long to wait: an answer
      # routed to the wrong caller shows.
      limit = %{capacity: 3, refill_per_sec: 0.001}

      callers =
        for i <- 1..64 do
          Task.async(fn ->
            key = {"ex", "own-#{i}"}
            first = for _ <- 1..3, do: RateLimiter.check_rate(key, limit, 1, name)

            {first,
             Enum.take_while(Stream.repeatedly(fn -> check(key, limit, name, stop_at) end), & &1)}
          end)
        end

      callers |> Task.await_many(30_000) |> assert_own_answers()

      # The limiter's own periodic sweep may be in flight.
      eventually(fn -> routes(handle(name)) == 0 end)
    end
  end

  describe "frames handed to the connection behind a full socket" do
    @tag timeout: 120_000
    test "a stopped daemon, megabytes queued and callers handing frames over: after it resumes every answer is its caller's" do
      socket = Bourse.TempPath.new("races", ".sock")
      daemon = start_daemon(["--socket", socket, "--max-frame-bytes", "4194304"])
      name = start_limiter({:daemon, {:unix, daemon.unix}, timeout: 10_000})
      eventually(fn -> RateLimiter.check_rate({"ex", "warm"}, @wide, 1, name) == :ok end)
      DaemonServer.signal(daemon, "STOP")
      limit = %{capacity: 3, refill_per_sec: 0.001}

      # Two floods fill the socket's queue; the callers behind them hand their frames to the
      # connection, which finds the socket busy and tries again until it takes them.
      flooders = for _ <- 1..2, do: flood(name, %{capacity: 10, refill_per_sec: 1})
      eventually(fn -> routes(handle(name)) == 2 end)

      callers =
        for i <- 1..16 do
          Task.async(fn -> RateLimiter.check_rate({"ex", "behind-#{i}"}, limit, 1, name) end)
        end

      Process.sleep(500)
      DaemonServer.signal(daemon, "CONT")

      for flooded <- Task.await_many(flooders, 30_000),
          do: assert(flooded == :ok or unavailable?(flooded), inspect(flooded))

      # Written once the daemon read the flood, well within their timeout.
      assert Task.await_many(callers, 30_000) == List.duplicate(:ok, 16)

      # Nothing of a frame was lost or interleaved: each caller's bucket counts its own
      # checks (a reconnection, had the socket closed, starts none afresh).
      eventually(fn -> RateLimiter.check_rate({"ex", "after"}, @wide, 1, name) == :ok end)

      checks =
        for i <- 1..16 do
          Task.async(fn ->
            key = {"ex", "own-#{i}"}
            for _ <- 1..4, do: RateLimiter.check_rate(key, limit, 1, name)
          end)
        end

      for answers <- Task.await_many(checks, 30_000) do
        assert [:ok, :ok, :ok, {:delay, _}] = answers
      end

      eventually(fn -> routes(handle(name)) == 0 end)
    end
  end

  defp check(key, limit, name, stop_at),
    do: now_ms() < stop_at && RateLimiter.check_rate(key, limit, 1, name)

  defp hammer(key, name, stop_at, answers) do
    if now_ms() >= stop_at do
      answers
    else
      started = now_ms()
      answer = check_or_exit(key, name)
      hammer(key, name, stop_at, [{answer, now_ms() - started} | answers])
    end
  end

  defp answered?(answer), do: answer == :ok or match?({:delay, _}, answer) or unavailable?(answer)

  # A call to a limiter that is not running exits with :noproc: here that is an answer too.
  defp check_or_exit(key, name) do
    RateLimiter.check_rate(key, @wide, 1, name)
  catch
    :exit, {:noproc, _} -> {:exit, :noproc}
  end
end
