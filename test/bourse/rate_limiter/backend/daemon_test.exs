defmodule Bourse.RateLimiter.Backend.DaemonTest do
  # What only the daemon backend has: an address, a server that can go away and come back.
  use ExUnit.Case, async: true

  import Bourse.BackendCase

  import Bourse.ContractCase,
    only: [booked_waiter: 4, booked_waiter: 5, eventually: 1, eventually: 2, now_ms: 0]

  import ExUnit.CaptureLog

  alias Bourse.{DaemonServer, FakeDaemon}
  alias Bourse.Error
  alias Bourse.RateLimiter
  alias Bourse.RateLimiter.Backend.Daemon

  @moduletag :capture_log

  @limit %{capacity: 10, refill_per_sec: 1}
  @fast %{capacity: 5, refill_per_sec: 1_000}

  describe "addresses" do
    test "loopback addresses and Unix sockets; others only when allowed" do
      uid = own_uid()

      for {address, parsed} <- [
            {"127.0.0.1:7878", {:tcp, {127, 0, 0, 1}, 7878}},
            {"127.1.2.3:1", {:tcp, {127, 1, 2, 3}, 1}},
            {"[::1]:7878", {:tcp, {0, 0, 0, 0, 0, 0, 0, 1}, 7878}},
            {"localhost:65535", {:tcp, {127, 0, 0, 1}, 65_535}},
            {{{127, 0, 0, 1}, 7878}, {:tcp, {127, 0, 0, 1}, 7878}},
            {{:unix, "/run/bourse.sock"}, {:unix, "/run/bourse.sock", uid}}
          ] do
        assert {:ok, address: ^parsed, timeout: 5_000} = Daemon.options(address, [])
      end

      for address <- ["10.0.0.1:7878", "[::]:7878", "0.0.0.0:7878", "example.com:7878"] do
        assert {:error, message} = Daemon.options(address, [])
        assert message =~ "allow_remote: true"

        assert {:ok, address: {:tcp, _, 7878}, timeout: 100} =
                 Daemon.options(address, allow_remote: true, timeout: 100)
      end

      for address <- [
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            "127.0.0.1:x",
            ":7878",
            "[::1:7878",
            {:unix, ""},
            {:unix, "a\0b"},
            {:unix, "/" <> String.duplicate("a", 107)},
            {:unix, ~c"/tmp/s"},
            {{127, 0, 0}, 1},
            7878,
            nil
          ] do
        assert {:error, _message} = Daemon.options(address, []), inspect(address)
      end

      # A charlist path is named as the path, not as an address of another shape.
      assert {:error, "a Unix socket path must be a non-empty binary, got a list"} =
               Daemon.options({:unix, ~c"/tmp/s"}, [])

      longest = "/" <> String.duplicate("a", 106)

      assert {:ok, address: {:unix, ^longest, ^uid}, timeout: _} =
               Daemon.options({:unix, longest}, [])

      assert {:ok, address: {:unix, "/s", 0}, timeout: _} =
               Daemon.options({:unix, "/s"}, daemon_uid: 0)
    end

    test "start_link refuses a bad daemon backend with :invalid_parameters" do
      for backend <- [
            :daemon,
            {:daemon},
            {:daemon, "10.1.2.3:7878"},
            {:daemon, "127.0.0.1:0"},
            {:daemon, "127.0.0.1:7878", bogus: 1},
            {:daemon, "127.0.0.1:7878", timeout: 0},
            {:daemon, "127.0.0.1:7878", timeout: 86_400_001},
            {:daemon, "127.0.0.1:7878", timeout: 4_294_967_295},
            {:daemon, "127.0.0.1:7878", timeout: 10 ** 20},
            {:daemon, "127.0.0.1:7878", allow_remote: :yes},
            {:daemon, {:unix, "/s"}, daemon_uid: -1},
            {:daemon, {:unix, "/s"}, daemon_uid: 4_294_967_295},
            {:daemon, {:unix, "/s"}, daemon_uid: "0"},
            {:daemon, "127.0.0.1:7878", [:timeout]},
            {:daemon, "127.0.0.1:7878", [], :extra}
          ] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 RateLimiter.start_link(name: :never_started, backend: backend),
               inspect(backend)

        assert is_binary(message)
      end
    end
  end

  test "a Unix socket" do
    path = Bourse.TempPath.new("bourse", ".sock")
    daemon = start_daemon(["--socket", path])
    name = start_limiter({:daemon, {:unix, daemon.unix}})
    # Nothing refills while the test runs, however slow the machine.
    still = %{@limit | refill_per_sec: 0.001}

    for _ <- 1..10, do: assert(:ok = RateLimiter.check_rate({"ex", "k"}, still, 1, name))
    assert {:delay, _} = RateLimiter.check_rate({"ex", "k"}, still, 1, name)
  end

  # Daemons restarted at an address are on Unix sockets: a TCP port given back by a killed
  # daemon may be taken meanwhile as another connection's ephemeral port.
  test "the daemon restarts: :unavailable meanwhile, then the limiter reconnects, and a drained key stays drained" do
    path = Bourse.TempPath.new("bourse", ".sock")
    daemon = start_daemon(["--socket", path])
    name = start_limiter({:daemon, {:unix, path}})
    drained = {"ex", "drained"}
    for _ <- 1..10, do: assert(:ok = RateLimiter.check_rate(drained, @limit, 1, name))

    DaemonServer.kill(daemon)
    killed_at = now_ms()
    assert unavailable?(RateLimiter.check_rate(drained, @limit, 1, name))
    assert unavailable?(RateLimiter.wait_for_capacity(drained, @limit, 1, name))

    start_daemon(["--socket", path, "--assume-busy-at-start"])

    eventually(fn -> RateLimiter.check_rate({"ex", "fresh"}, @fast, 1, name) == :ok end)

    admitted =
      Enum.count(1..10, fn _ -> RateLimiter.check_rate(drained, @limit, 1, name) == :ok end)

    elapsed_s = (now_ms() - killed_at) / 1000

    assert admitted <= 1 + @limit.refill_per_sec * elapsed_s,
           "#{admitted} admitted after a restart"
  end

  test "a reconnect to a daemon without --assume-busy-at-start logs a warning" do
    path = Bourse.TempPath.new("bourse", ".sock")
    daemon = start_daemon(["--socket", path])
    name = start_limiter({:daemon, {:unix, path}})
    assert :ok = RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)
    DaemonServer.kill(daemon)

    log =
      capture_log(fn ->
        start_daemon(["--socket", path])
        eventually(fn -> RateLimiter.check_rate({"ex", "k"}, @limit, 1, name) == :ok end)
      end)

    assert log =~ "a daemon that restarted without --assume-busy-at-start"
  end

  test "the pauses a limiter asked of a daemon that restarted are asked again of the new one" do
    path = Bourse.TempPath.new("bourse", ".sock")
    daemon = start_daemon(["--socket", path, "--assume-busy-at-start"])
    name = start_limiter({:daemon, {:unix, path}})
    assert :ok = RateLimiter.pause("ex", 30_000, name)
    DaemonServer.kill(daemon)
    start_daemon(["--socket", path, "--assume-busy-at-start"])

    fast = %{capacity: 1, refill_per_sec: 1.0e6}

    assert {:delay, ms} =
             eventually(fn -> paused(RateLimiter.check_rate({"ex", "k"}, fast, 1, name)) end)

    assert ms > 25_000
  end

  defp paused({:delay, _ms} = delay), do: delay
  defp paused(_answer), do: nil

  test "a limiter's booking_slack_ms holds for its waiters on a daemon with another slack" do
    daemon = start_daemon(["--listen", "127.0.0.1:0", "--booking-slack-ms", "0"])
    patient = start_limiter({:daemon, daemon.tcp}, "patient", booking_slack_ms: 5_000)
    hasty = start_limiter({:daemon, daemon.tcp}, "hasty")
    # The hasty waiter's claim finds the next token 1 s after its lapsed booking: a claim
    # up to 700 ms late still sees the lapse.
    still = %{capacity: 1, refill_per_sec: 1}

    for {name, key} <- [{patient, {"ex", "patient"}}, {hasty, {"ex", "hasty"}}] do
      assert :ok = RateLimiter.check_rate(key, still, 1, name)
      assert {:delay, ms} = RateLimiter.check_rates([{key, still, 1}], name, max_wait_ms: 5_000)
      # Woken well past the daemon's slack of 0 (and the default of 250).
      Process.sleep(ms + 300)
      send(self(), {name, key, RateLimiter.check_rates([{key, still, 1}], name)})
    end

    # The patient waiter claims its booking; the other's lapsed by the default 250 ms.
    assert_received {^patient, _key, :ok}
    assert_received {^hasty, _key, {:delay, _}}
  end

  test "a limiter restarted within 5 s with other options takes over the connection with them" do
    daemon = start_daemon(["--listen", "127.0.0.1:0", "--booking-slack-ms", "0"])
    name = :"restarted_#{System.unique_integer([:positive])}"
    opts = [name: name, backend: {:daemon, daemon.tcp, timeout: 300}, booking_slack_ms: 0]
    {:ok, _} = RateLimiter.start_link(opts)
    connection = handle(name).pid
    GenServer.stop(name)

    opts = [name: name, backend: {:daemon, daemon.tcp, timeout: 3_000}, booking_slack_ms: 5_000]
    {:ok, _} = RateLimiter.start_link(opts)
    on_exit(fn -> catch_exit(GenServer.stop(name)) end)
    assert handle(name).pid == connection
    assert :sys.get_state(connection).timeout == 3_000

    # Woken 300 ms late: within the new slack, past the old one.
    still = %{capacity: 1, refill_per_sec: 1}
    assert :ok = RateLimiter.check_rate({"ex", "k"}, still, 1, name)

    assert {:delay, ms} =
             RateLimiter.check_rates([{{"ex", "k"}, still, 1}], name, max_wait_ms: 5_000)

    Process.sleep(ms + 300)
    assert :ok = RateLimiter.check_rates([{{"ex", "k"}, still, 1}], name)
  end

  test "a limiter restarted within 5 s with another secret or address is started anew with them" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    other = start_daemon(["--listen", "127.0.0.1:0"])
    right = Bourse.TempPath.new("bourse-secret", "")
    wrong = Bourse.TempPath.new("bourse-secret", "")
    on_exit(fn -> Enum.each([right, wrong], &File.rm/1) end)
    File.write!(right, DaemonServer.secret() <> "\n")
    File.write!(wrong, "not-the-daemons-secret\n")
    name = :"new_secret_#{System.unique_integer([:positive])}"
    on_exit(fn -> catch_exit(GenServer.stop(name)) end)

    # Same address, a wrong secret; another address, a wrong secret: each is a new
    # configuration, refused at its start, not run on the connection left by the last.
    for address <- [daemon.tcp, other.tcp] do
      {:ok, _} =
        RateLimiter.start_link(name: name, backend: {:daemon, daemon.tcp, secret_file: right})

      assert :ok = RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)
      GenServer.stop(name)

      assert {:error, %Error{type: :invalid_parameters, message: message}} =
               RateLimiter.start_link(name: name, backend: {:daemon, address, secret_file: wrong})

      assert message =~ "the daemon refused the proof of the shared secret"
    end

    # The same secret from another file is the same configuration: adopted.
    {:ok, _} =
      RateLimiter.start_link(name: name, backend: {:daemon, daemon.tcp, secret_file: right})

    connection = handle(name).pid
    GenServer.stop(name)
    copy = Bourse.TempPath.new("bourse-secret", "")
    on_exit(fn -> File.rm(copy) end)
    File.cp!(right, copy)

    {:ok, _} =
      RateLimiter.start_link(name: name, backend: {:daemon, daemon.tcp, secret_file: copy})

    assert handle(name).pid == connection
  end

  test "a limiter started again with assume_busy_at_start does not adopt a connection without it" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    name = :"busy_again_#{System.unique_integer([:positive])}"
    on_exit(fn -> catch_exit(GenServer.stop(name)) end)
    slow = %{capacity: 10, refill_per_sec: 0.1}

    # Starts the limiter (stopping the one running): its connection.
    start = fn opts ->
      if Process.whereis(name), do: GenServer.stop(name)
      {:ok, _} = RateLimiter.start_link([name: name, backend: {:daemon, daemon.tcp}] ++ opts)
      handle(name).pid
    end

    plain = start.([])
    busy = start.(assume_busy_at_start: true)
    assert busy != plain
    assert {:delay, ms} = RateLimiter.check_rate({"ex", "new"}, slow, 1, name)
    assert ms in 9_000..10_000

    # Started again as it was, it adopts the connection, and its start with it.
    assert start.(assume_busy_at_start: true) == busy
  end

  test "a waiter whose claim is answered :unavailable only after its booking slack is refused" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])

    name = start_limiter({:daemon, daemon.tcp, timeout: 300}, "late", booking_slack_ms: 50)

    # Ready in 4 s: the daemon is stopped before the waiter claims, on a loaded machine too.
    limit = %{capacity: 1, refill_per_sec: 0.25}
    assert :ok = RateLimiter.check_rate({"ex", "late"}, limit, 1, name)

    waiter = booked_waiter({"ex", "late"}, limit, name, 8_000)
    DaemonServer.signal(daemon, "STOP")

    # Its claim times out 300 ms after it woke: the booking lapsed meanwhile.
    assert unavailable?(Task.await(waiter, 10_000))
    DaemonServer.signal(daemon, "CONT")
  end

  test "a waiter admitted while its daemon is stopped forfeits the booking it was admitted on" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    name = start_limiter({:daemon, daemon.tcp, timeout: 300}, "forfeit", booking_slack_ms: 5_000)
    limit = %{capacity: 1, refill_per_sec: 1}
    assert :ok = RateLimiter.check_rate({"ex", "forfeit"}, limit, 1, name)
    test = self()

    waiter =
      Task.async(fn ->
        waited =
          RateLimiter.wait_for_capacity({"ex", "forfeit"}, limit, 1, name, max_wait_ms: 5_000)

        send(test, {:waited, waited})
        receive do: (:again -> RateLimiter.check_rate({"ex", "forfeit"}, limit, 1, name))
      end)

    eventually(fn -> RateLimiter.inspect_key({"ex", "forfeit"}, name).bookings == 1 end)
    DaemonServer.signal(daemon, "STOP")

    # Its claim, read only once its deadline passed, is never run: the booking stays in the
    # daemon, and the waiter, told :unavailable within its slack, is admitted against it.
    assert_receive {:waited, :ok}, 5_000
    DaemonServer.signal(daemon, "CONT")
    assert RateLimiter.inspect_key({"ex", "forfeit"}, name).bookings == 1

    # Its next check does not claim that booking again: it pays, and waits for the refill.
    send(waiter.pid, :again)
    assert {:delay, _} = Task.await(waiter)
  end

  # The restarted daemon never held the booking, and counts the refill it paid for from its
  # own start: admitted against it, the waiter would spend that refill beside others (P1).
  test "a waiter the daemon cannot answer is not admitted once the daemon restarted since it booked" do
    path = Bourse.TempPath.new("bourse", ".sock")
    first = start_daemon(["--socket", path])

    name =
      start_limiter({:daemon, {:unix, path}, timeout: 300}, "restarted", booking_slack_ms: 5_000)

    # Ready in 5 s: the restart and the stop come before, on a loaded machine too.
    limit = %{capacity: 1, refill_per_sec: 0.2}
    assert :ok = RateLimiter.check_rate({"ex", "restarted"}, limit, 1, name)
    waiter = booked_waiter({"ex", "restarted"}, limit, name, 8_000)

    DaemonServer.kill(first)
    second = start_daemon(["--socket", path, "--assume-busy-at-start"])
    on_exit(fn -> DaemonServer.signal(second, "CONT") end)

    eventually(fn -> not unavailable?(RateLimiter.check_rate({"ex", "other"}, limit, 1, name)) end)

    DaemonServer.signal(second, "STOP")

    assert unavailable?(Task.await(waiter, 10_000))
  end

  # A 429 observed after the waiter booked holds its booking to the pause's end; only the
  # daemon knows where that booking now stands, and it may have recorded the pause without
  # answering.
  test "a waiter the daemon cannot answer is not admitted while a 429 observed since may hold its booking" do
    for stop_first <- [false, true] do
      daemon = start_daemon(["--listen", "127.0.0.1:0"])
      name = start_limiter({:daemon, daemon.tcp, timeout: 300}, "held", booking_slack_ms: 5_000)
      # Ready in 5 s: the 429 and the stop come before, on a loaded machine too.
      limit = %{capacity: 1, refill_per_sec: 0.2}
      assert :ok = RateLimiter.check_rate({"ex", "held"}, limit, 1, name)

      waiter = booked_waiter({"ex", "held"}, limit, name, 8_000)
      on_exit(fn -> DaemonServer.signal(daemon, "CONT") end)
      if stop_first, do: DaemonServer.signal(daemon, "STOP")
      observed = RateLimiter.observe_response("ex", "held", 429, [{"retry-after", "10"}], name)
      assert {:error, %Error{retry_after: 10_000}} = observed
      unless stop_first, do: DaemonServer.signal(daemon, "STOP")

      assert unavailable?(Task.await(waiter, 10_000)), "stopped first: #{stop_first}"
    end
  end

  # The pause ends before the second waiter's ready time, but moves its booking behind the
  # first's, which moved to the pause's end: admitted at its old ready time, it would be
  # the second admission within 3 s of a bucket refilling 1 per 4 s (P1).
  test "a waiter whose booking a pause pushed back is not admitted at its old ready time when the daemon cannot answer" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    name = start_limiter({:daemon, daemon.tcp, timeout: 300}, "pushed", booking_slack_ms: 5_000)
    limit = %{capacity: 1, refill_per_sec: 0.25}
    assert :ok = RateLimiter.check_rate({"ex", "pushed"}, limit, 1, name)

    # Ready in 4 s, then in 8 s.
    [first, second] = for n <- [1, 2], do: booked_waiter({"ex", "pushed"}, limit, name, 14_000, n)

    # Ends at 5 s: the first goes out then, the second 4 s later. The stop must come before
    # the second's claim at its new ready time (past it, the running daemon admits it
    # there, rightly): 4 s after the first is admitted, on a loaded machine too.
    assert {:error, %Error{retry_after: 5_000}} =
             RateLimiter.observe_response("ex", "pushed", 429, [{"retry-after", "5"}], name)

    assert :ok = Task.await(first, 8_000)
    on_exit(fn -> DaemonServer.signal(daemon, "CONT") end)
    DaemonServer.signal(daemon, "STOP")
    assert unavailable?(Task.await(second, 10_000))
  end

  test "a 429 observed while the daemon is stopped is not recorded, and its error still says the wait asked" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    name = start_limiter({:daemon, daemon.tcp, timeout: 200}, "unrecorded")
    assert :ok = RateLimiter.check_rate({"ex", "unrecorded"}, @limit, 1, name)
    on_exit(fn -> DaemonServer.signal(daemon, "CONT") end)
    DaemonServer.signal(daemon, "STOP")

    for {headers, retry_after, stop} <- [
          {[{"retry-after", "5"}], 5_000, false},
          # Its used weight cannot be synced either: the 429 is still read.
          {[{"retry-after", "5"}, {"x-mbx-used-weight-1m", "100"}], 5_000, false},
          {[{"retry-after", "600"}], 600_000, true},
          {[], nil, false}
        ] do
      assert {:error, %Error{type: :unavailable} = error} =
               RateLimiter.observe_response("ex", "unrecorded", 429, headers, name)

      assert {error.retry_after, error.http_status, error.stop} == {retry_after, 429, stop}
      assert error.message =~ "the HTTP 429 reply was not (wholly) recorded"
    end
  end

  test "a limiter's assume_busy_at_start holds on a daemon without the flag, and only for it" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    # Fill time 100 s: a bucket new to the daemon right after the limiter started is empty.
    slow = %{capacity: 10, refill_per_sec: 0.1}

    log =
      capture_log(fn ->
        busy = start_limiter({:daemon, daemon.tcp}, "busy", assume_busy_at_start: true)
        assert {:delay, ms} = RateLimiter.check_rate({"ex", "new"}, slow, 1, busy)
        assert ms in 9_000..10_000

        plain = start_limiter({:daemon, daemon.tcp})
        assert :ok = RateLimiter.check_rate({"ex", "other"}, slow, 10, plain)
        # A bucket the daemon held before is left as it was, for the busy limiter too.
        assert :ok = RateLimiter.check_rate({"ex", "held"}, slow, 1, plain)
        assert :ok = RateLimiter.check_rate({"ex", "held"}, slow, 9, busy)
      end)

    refute log =~ "assume"

    # Nor a limiter that did not ask, restarted with a connection of its own.
    name = :"busy_restarted_#{System.unique_integer([:positive])}"
    backend = {:daemon, daemon.tcp}
    {:ok, first} = RateLimiter.start_link(name: name, backend: backend)
    Process.unlink(first)
    ref = Process.monitor(first)
    Process.exit(handle(name).pid, :kill)
    Process.exit(first, :kill)
    assert_receive {:DOWN, ^ref, :process, _, _}

    log =
      capture_log(fn ->
        {:ok, second} = RateLimiter.start_link(name: name, backend: backend)
        Process.unlink(second)
        eventually(fn -> RateLimiter.check_rate({"ex", "k"}, @limit, 1, name) == :ok end)
        GenServer.stop(second)
      end)

    refute log =~ "assume-busy-at-start"
  end

  test "started before its daemon: :unavailable until the daemon is up, then it connects" do
    # A free port: where a daemon listened a moment ago.
    path = Bourse.TempPath.new("bourse", ".sock")
    name = start_limiter({:daemon, {:unix, path}})

    assert {:error, %Error{type: :unavailable, message: message}} =
             RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

    assert message =~ "bourse_daemon at unix:#{path} is unavailable"

    start_daemon(["--socket", path])
    eventually(fn -> RateLimiter.check_rate({"ex", "k"}, @limit, 1, name) == :ok end, 10_000)
  end

  test "a socket path that is not UTF-8 is named in messages as Elixir writes it" do
    path = Bourse.TempPath.new(<<"bourse-", 0xFF>>, ".sock")
    name = start_limiter({:daemon, {:unix, path}})

    assert {:error, %Error{type: :unavailable, message: message}} =
             RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

    assert String.valid?(message)
    assert message =~ "bourse_daemon at unix:#{inspect(path)} is unavailable"
  end

  test "a daemon that refuses the hello (an older one) fails the start, naming why" do
    path = Bourse.TempPath.new("bourse", ".sock")
    {:ok, listener} = :gen_tcp.listen(0, [:binary, ifaddr: {:local, path}, active: false])
    on_exit(fn -> File.rm(path) end)

    refusal =
      ~s({"error":{"message":"unknown field \\"busy_since_us_ago\\" in a hello request ) <>
        ~s[(known fields: codec, deadline_us, timeout_ms)","type":"invalid_parameters"},] <>
        ~s("ok":false,"id":0}\n)

    server =
      spawn_link(fn ->
        for _ <- 1..10 do
          {:ok, socket} = :gen_tcp.accept(listener)
          {:ok, _hello} = :gen_tcp.recv(socket, 0)
          :gen_tcp.send(socket, refusal)
        end
      end)

    assert {:error, %Error{type: :invalid_parameters, message: message}} =
             RateLimiter.start_link(
               name: :"refused_hello_#{System.unique_integer([:positive])}",
               backend: {:daemon, {:unix, path}},
               assume_busy_at_start: true
             )

    assert message =~ "busy_since_us_ago"
    assert message =~ "older than this library"
    unlink_and_kill(server)
    :gen_tcp.close(listener)
  end

  test "another server at the address (Redis, HTTP): the error says it is not a bourse_daemon" do
    for greeting <- ["-ERR unknown command\r\n", "HTTP/1.1 400 Bad Request\r\n\r\n"] do
      {:ok, listener} = :gen_tcp.listen(0, [:binary, ip: {127, 0, 0, 1}, active: false])
      {:ok, port} = :inet.port(listener)

      server =
        spawn_link(fn ->
          for _ <- 1..100 do
            {:ok, socket} = :gen_tcp.accept(listener)
            :gen_tcp.send(socket, greeting)
          end
        end)

      name = start_limiter({:daemon, "127.0.0.1:#{port}"})

      assert {:error, %Error{type: :unavailable, message: message}} =
               RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

      assert message =~ "bourse_daemon at 127.0.0.1:#{port} is unavailable"
      assert message =~ "the peer's answer began with #{inspect(binary_part(greeting, 0, 4))}"
      assert message =~ "is a bourse_daemon listening there?"
      unlink_and_kill(server)
      :gen_tcp.close(listener)
    end
  end

  # A local user that binds the daemon's TCP port (while it restarts, say) and answers as
  # one, without the secret: were it believed, every check would be "admitted".
  test "an impostor without the secret on the TCP port is found out, never believed" do
    impostors = [
      {"did not ask for the shared secret", fn _socket -> :ok end, nil},
      {"without proving it in turn", &accept_any_proof/1,
       %{"scheme" => "hmac-sha256", "nonce" => String.duplicate("ab", 32)}},
      # Not a daemon's refusal: no start failure for a wrong secret, a retried :unavailable.
      {"is not a bourse_daemon's", &answer_oddly/1,
       %{"scheme" => "hmac-sha256", "nonce" => String.duplicate("ab", 32)}}
    ]

    for {says, after_hello, auth} <- impostors do
      {:ok, listener} = :gen_tcp.listen(0, [:binary, ip: {127, 0, 0, 1}, active: false])
      {:ok, port} = :inet.port(listener)
      server = spawn_link(fn -> impersonate(listener, auth, after_hello) end)
      name = start_limiter({:daemon, "127.0.0.1:#{port}"})

      assert {:error, %Error{type: :unavailable, message: message}} =
               RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

      assert message =~ says
      assert message =~ "another program may be listening there"
      unlink_and_kill(server)
      :gen_tcp.close(listener)
    end
  end

  # A misconfiguration fails the start, rather than every call later.
  test "a daemon that refuses the limiter's secret fails its start, showing no secret" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    wrong = Bourse.TempPath.new("bourse-secret", "")
    on_exit(fn -> File.rm(wrong) end)

    # A Unix socket's daemon asks for no secret: a short one given is not refused.
    unix = start_daemon(["--socket", Bourse.TempPath.new("bourse", ".sock")])
    File.write!(wrong, "short\n")
    name = start_limiter({:daemon, {:unix, unix.unix}, secret_file: wrong})
    assert :ok = RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

    # One shorter than any TCP daemon's is refused before it is offered.
    for {secret, says} <- [
          {"not-the-daemons-secret",
           "the daemon refused the proof of the shared secret (is it the same secret?)"},
          {"short", ": the secret has 5 bytes, and a daemon's is at least 16"}
        ] do
      File.write!(wrong, secret <> "\n")

      assert {:error, %Error{type: :invalid_parameters, message: message}} =
               RateLimiter.start_link(
                 name: :daemon_wrong_secret,
                 backend: {:daemon, daemon.tcp, secret_file: wrong}
               )

      assert message =~ says

      refute message =~ secret
      refute message =~ DaemonServer.secret()
    end
  end

  # Without the secret, a peer hands client B, as its nonce, what the daemon would prove to
  # client A: were B to prove it, A would take B's proof for the daemon's and send its
  # requests, credentials and all, to the peer.
  test "a peer reflecting one client's challenge to another as its nonce is found out" do
    {:ok, listener} = :gen_tcp.listen(0, [:binary, ip: {127, 0, 0, 1}, active: false])
    {:ok, port} = :inet.port(listener)
    server = spawn_link(fn -> reflect(listener) end)
    address = "127.0.0.1:#{port}"
    first = :"reflected_#{System.unique_integer([:positive])}"

    starting =
      Task.async(fn ->
        # Its handshake waits for a proof that never comes: 2 s at most.
        {:ok, pid} =
          RateLimiter.start_link(name: first, backend: {:daemon, address, timeout: 2_000})

        Process.unlink(pid)
        pid
      end)

    log =
      capture_log(fn ->
        Process.sleep(300)
        second = start_limiter({:daemon, address, timeout: 2_000})
        on_exit_stop(Task.await(starting, 30_000))

        assert {:error, %Error{type: :unavailable}} =
                 RateLimiter.check_rate({"ex", "secret-api-key"}, @limit, 1, first)

        assert {:error, %Error{type: :unavailable}} =
                 RateLimiter.check_rate({"ex", "k"}, @limit, 1, second)
      end)

    assert log =~ "the peer's nonce is not 64 hex digits"
    unlink_and_kill(server)
    :gen_tcp.close(listener)
  end

  defp on_exit_stop(pid), do: on_exit(fn -> if Process.alive?(pid), do: GenServer.stop(pid) end)

  defp reflect(listener) do
    {:ok, a} = :gen_tcp.accept(listener)
    {:ok, _hello_line} = :gen_tcp.recv(a, 0)
    nonce = :crypto.strong_rand_bytes(32) |> Base.encode16(case: :lower)
    :ok = :gen_tcp.send(a, FakeDaemon.hello(%{"scheme" => "hmac-sha256", "nonce" => nonce}))
    %{challenge: challenge} = FakeDaemon.request(a)
    {:ok, b} = :gen_tcp.accept(listener)
    {:ok, _hello_line} = :gen_tcp.recv(b, 0)
    reflected = "daemon #{challenge} #{nonce}"
    :ok = :gen_tcp.send(b, FakeDaemon.hello(%{"scheme" => "hmac-sha256", "nonce" => reflected}))

    with %{proof: forged} <- FakeDaemon.request(b) do
      send_term(a, %{"id" => 0, "ok" => true, "proof" => forged})
      # Every check the first client sends is "admitted".
      answer_admitted(a)
    end

    Process.sleep(:infinity)
  end

  defp answer_admitted(socket) do
    with %{id: id} <- FakeDaemon.request(socket) do
      send_term(socket, %{"id" => id, "ok" => true, "result" => "admitted"})
      answer_admitted(socket)
    end
  end

  defp send_term(socket, term) do
    frame = :erlang.term_to_binary(term)
    :gen_tcp.send(socket, [<<byte_size(frame)::32>>, frame])
  end

  # Answers every connection's hello as a daemon does (with `auth`), then `after_hello`.
  defp impersonate(listener, auth, after_hello) do
    {:ok, socket} = :gen_tcp.accept(listener)
    {:ok, _hello_line} = :gen_tcp.recv(socket, 0)
    :ok = :gen_tcp.send(socket, FakeDaemon.hello(auth))
    after_hello.(socket)
    impersonate(listener, auth, after_hello)
  end

  defp accept_any_proof(socket) do
    with %{} <- FakeDaemon.request(socket) do
      ok = :erlang.term_to_binary(%{"id" => 0, "ok" => true})
      :gen_tcp.send(socket, [<<byte_size(ok)::32>>, ok])
    end
  end

  defp answer_oddly(socket) do
    with %{} <- FakeDaemon.request(socket) do
      odd = :erlang.term_to_binary(%{"id" => 0, "ok" => false})
      :gen_tcp.send(socket, [<<byte_size(odd)::32>>, odd])
    end
  end

  test "a daemon that accepts and never answers holds the limiter's start at most its timeout" do
    # A stopped daemon: the kernel accepts its connections, nothing reads them.
    path = Bourse.TempPath.new("bourse-silent", ".sock")

    {:ok, listener} = :gen_tcp.listen(0, [:binary, ifaddr: {:local, path}, active: false])
    on_exit(fn -> File.rm(path) end)

    started = now_ms()
    name = start_limiter({:daemon, {:unix, path}, timeout: 300})
    # At most 1 s for a connection (5 s before, whatever the timeout); the bound leaves a
    # loaded machine room (3.3 s seen) and still tells the two apart.
    assert now_ms() - started < 4_500, "started after #{now_ms() - started} ms"

    assert {:error, %Error{type: :unavailable}} =
             RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

    :gen_tcp.close(listener)
  end

  test "a daemon that stops answering: calls end as :unavailable after the timeout, never hang" do
    {daemon, name} = start_connected_daemon(timeout: 300)

    DaemonServer.signal(daemon, "STOP")

    callers =
      for _ <- 1..4,
          do: Task.async(fn -> RateLimiter.check_rate({"ex", "k"}, @limit, 1, name) end)

    for answer <- Task.await_many(callers, 10_000) do
      assert {:error, %Error{type: :unavailable, message: message}} = answer
      assert message =~ "did not answer within 300 ms"
    end

    DaemonServer.signal(daemon, "CONT")
    eventually(fn -> RateLimiter.check_rate({"ex", "k"}, @limit, 1, name) == :ok end)
  end

  test "a stopped daemon reached by a :global name or a pid: every caller answered within its timeout" do
    {daemon, name} = start_connected_daemon(timeout: 300)
    pid = Process.whereis(name)
    global = {:bourse_global, System.unique_integer([:positive])}
    :yes = :global.register_name(global, pid)
    on_exit(fn -> :global.unregister_name(global) end)

    DaemonServer.signal(daemon, "STOP")
    on_exit(fn -> DaemonServer.signal(daemon, "CONT") end)
    key = {"ex", "a-caller's-api-key"}

    # Through the limiter's mailbox, 24 calls of 300 ms each would take 7.2 s in a row:
    # the last ones would exit at GenServer.call's 5 s, their key in the exit reason.
    callers =
      for name <- [{:global, global}, pid, name], _ <- 1..8 do
        Task.async(fn ->
          started = System.monotonic_time(:millisecond)

          answer =
            try do
              RateLimiter.check_rate(key, @limit, 1, name)
            catch
              :exit, reason -> {:exit, reason}
            end

          {answer, System.monotonic_time(:millisecond) - started}
        end)
      end

    for {answer, ms} <- Task.await_many(callers, 20_000) do
      assert {:error, %Error{type: :unavailable}} = answer
      assert ms < 2_500, "answered after #{ms} ms"
    end
  end

  @tag timeout: 60_000
  test "a daemon that stops reading megabytes: writers find the socket busy and give up at their timeout" do
    path = Bourse.TempPath.new("bourse", ".sock")
    daemon = start_daemon(["--socket", path, "--max-frame-bytes", "67108864"])
    name = start_limiter({:daemon, {:unix, daemon.unix}, timeout: 500})
    assert :ok = RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)
    DaemonServer.signal(daemon, "STOP")

    # Each flood is 3 MB the daemon does not read: more than the socket's buffers take, so
    # the socket is closed when the first of them has waited for the callers' timeout.
    callers =
      for(_ <- 1..4, do: flood(name, @limit)) ++
        for i <- 1..8 do
          Task.async(fn -> RateLimiter.check_rate({"ex", "k#{i}"}, @limit, 1, name) end)
        end

    for answer <- Task.await_many(callers, 10_000), do: assert(unavailable?(answer))

    # The connection noticed and connects again.
    DaemonServer.signal(daemon, "CONT")
    eventually(fn -> RateLimiter.check_rate({"ex", "after"}, @limit, 1, name) == :ok end, 10_000)
  end

  test "a daemon past its --max-connections: callers get its refusal, over TCP and a Unix socket" do
    path = Bourse.TempPath.new("bourse", ".sock")
    daemon = start_daemon(["--listen", "127.0.0.1:0", "--socket", path, "--max-connections", "1"])
    # The one connection the daemon serves.
    served = start_limiter({:daemon, daemon.tcp})
    assert :ok = RateLimiter.check_rate({"ex", "k"}, @limit, 1, served)

    for address <- [daemon.tcp, {:unix, daemon.unix}] do
      name = start_limiter({:daemon, address})

      assert {:error, %Error{type: :unavailable, message: message}} =
               RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

      assert message =~ "the daemon serves at most 1 connections (--max-connections)",
             "#{inspect(address)}: #{message}"
    end
  end

  describe "the user serving a Unix socket" do
    test "is the daemon's: a socket served by another user is refused and sent nothing" do
      path = Bourse.TempPath.new("bourse", ".sock")
      {:ok, listener} = :gen_tcp.listen(0, [:binary, ifaddr: {:local, path}, active: false])
      on_exit(fn -> File.rm(path) end)
      test = self()

      spawn_link(fn ->
        for _ <- 1..2 do
          {:ok, socket} = :gen_tcp.accept(listener)
          send(test, {:received, :gen_tcp.recv(socket, 0, 1_000)})
        end
      end)

      # This test's VM listens: a limiter told the daemon runs as another user refuses it.
      other = own_uid() + 1
      name = start_limiter({:daemon, {:unix, path}, daemon_uid: other, timeout: 300})

      assert {:error, %Error{type: :unavailable, message: message}} =
               RateLimiter.check_rate({"ex", "secret-api-key"}, @limit, 1, name)

      assert message =~
               "#{path} is served by user #{own_uid()}, not the daemon's user #{other}: " <>
                 "another user may be listening there"

      assert_receive {:received, {:error, :closed}}, 2_000
      refute message =~ "secret-api-key"
    end

    test "by default, this program's user: its own daemon is served" do
      path = Bourse.TempPath.new("bourse", ".sock")
      daemon = start_daemon(["--socket", path])
      name = start_limiter({:daemon, {:unix, daemon.unix}})
      assert :ok = RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)
      named = start_limiter({:daemon, {:unix, daemon.unix}, daemon_uid: own_uid()})
      assert :ok = RateLimiter.check_rate({"ex", "k"}, @limit, 1, named)
    end
  end

  test "without /proc/self/status, no daemon at a Unix socket is believed unless daemon_uid: is given" do
    assert {:ok, 1001} =
             Daemon.uid_in_status({:ok, "Name:\tbeam\nUid:\t1000\t1001\t1001\t1001\n"})

    for unreadable <- [{:error, :enoent}, {:ok, ""}, {:ok, "Uid:\tx\n"}] do
      assert {:error, message} = Daemon.uid_in_status(unreadable)
      assert message =~ "give daemon_uid:"
    end
  end

  defp own_uid do
    {uid, 0} = System.cmd("id", ["-u"])
    uid |> String.trim() |> String.to_integer()
  end

  test "a connection that goes silent (a proxy that lost the flow) is made again" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    [_, daemon_port] = String.split(daemon.tcp, ":")
    {proxy_port, swallow} = swallowing_proxy(String.to_integer(daemon_port))
    name = start_limiter({:daemon, "127.0.0.1:#{proxy_port}", timeout: 300})
    # Through the proxy, a loaded machine may take longer than the timeout at first.
    eventually(fn -> RateLimiter.check_rate({"ex", "silent"}, @fast, 1, name) == :ok end)

    swallow.()

    assert {:error, %Error{type: :unavailable, message: message}} =
             RateLimiter.check_rate({"ex", "silent"}, @fast, 1, name)

    assert message == "bourse_daemon at 127.0.0.1:#{proxy_port} did not answer within 300 ms"

    # No answer to a hello either, for a second: the connection is made again, to the same
    # daemon, which did not restart.
    log =
      capture_log(fn ->
        eventually(
          fn -> RateLimiter.check_rate({"ex", "silent"}, @fast, 1, name) == :ok end,
          10_000
        )
      end)

    assert log =~ "connected again"
    refute log =~ "assume"
  end

  # A TCP proxy to `port`: `{its port, swallow}`; after `swallow.()`, the connections open
  # then swallow everything both ways and are never closed, and new ones are relayed.
  defp swallowing_proxy(port) do
    {:ok, listener} = :gen_tcp.listen(0, [:binary, ip: {127, 0, 0, 1}, active: false])
    {:ok, proxy_port} = :inet.port(listener)
    era = :atomics.new(1, [])
    spawn_link(fn -> relay_each(listener, port, era) end)
    {proxy_port, fn -> :atomics.add(era, 1, 1) end}
  end

  defp relay_each(listener, port, era) do
    {:ok, client} = :gen_tcp.accept(listener)
    {:ok, server} = :gen_tcp.connect({127, 0, 0, 1}, port, [:binary, active: false])
    born = :atomics.get(era, 1)

    for {from, to} <- [{client, server}, {server, client}] do
      relay = spawn_link(fn -> relay(from, to, era, born) end)
      :ok = :gen_tcp.controlling_process(from, relay)
    end

    relay_each(listener, port, era)
  end

  defp relay(from, to, era, born) do
    with {:ok, data} <- :gen_tcp.recv(from, 0) do
      if :atomics.get(era, 1) == born, do: :gen_tcp.send(to, data)
      relay(from, to, era, born)
    end
  end

  # With a timeout of 1 s: a first call unanswered at 1 s makes the connection send a hello;
  # unanswered in turn, at 2 s the connection is found silent. Calls written at 1.5 s may
  # still run until their last moment to run, 2.25 s: they are answered at their deadline,
  # 2.5 s, not when the silence is found (they were, and a daemon resumed at once then ran
  # them: the 429 was recorded and the check paid, both answered `:unavailable`).
  test "calls written on a connection found silent wait for their deadline: a resumed daemon runs none of them" do
    {daemon, name} = start_connected_daemon(timeout: 1_000)
    limit = %{capacity: 10, refill_per_sec: 0.001}
    key = {"ex", "silent-caller"}

    DaemonServer.signal(daemon, "STOP")
    on_exit(fn -> DaemonServer.signal(daemon, "CONT") end)
    assert unavailable?(RateLimiter.check_rate({"ex", "first"}, limit, 1, name))
    Process.sleep(500)
    started = System.monotonic_time(:millisecond)

    callers = [
      Task.async(fn -> RateLimiter.check_rate(key, limit, 1, name) end),
      Task.async(fn -> RateLimiter.observe_response("ex", "silent-caller", 429, [], name) end)
    ]

    for answer <- Task.await_many(callers, 10_000), do: assert(unavailable?(answer))
    waited = System.monotonic_time(:millisecond) - started
    DaemonServer.signal(daemon, "CONT")

    assert waited >= 900, "answered after #{waited} ms, before the deadline"

    wide = %{capacity: 1.0e9, refill_per_sec: 1.0e9}
    eventually(fn -> RateLimiter.check_rate({"ex", "warm"}, wide, 1, name) == :ok end, 10_000)

    case RateLimiter.inspect_key(key, name) do
      nil -> :ok
      info -> assert {info.tokens, info.pause_ms} == {10.0, nil}
    end
  end

  test "an answer that comes after its caller gave up is dropped, never left in the caller's mailbox" do
    {daemon, name} = start_connected_daemon(timeout: 200)

    DaemonServer.signal(daemon, "STOP")
    assert unavailable?(RateLimiter.check_rate({"ex", "late"}, @limit, 1, name))
    DaemonServer.signal(daemon, "CONT")

    # The daemon answers the late request first (answers come in order), then this one.
    eventually(fn -> RateLimiter.check_rate({"ex", "k"}, @limit, 1, name) == :ok end)
    assert {:messages, []} = Process.info(self(), :messages)
  end

  test "a request over the daemon's frame limit is refused before it is sent; the connection goes on" do
    daemon = start_daemon(["--listen", "127.0.0.1:0", "--max-frame-bytes", "1024"])
    name = start_limiter({:daemon, daemon.tcp})
    checks = for i <- 1..50, do: {{"ex", "k#{i}"}, @limit, 1}

    assert {:error, %Error{type: :invalid_parameters, message: message}} =
             RateLimiter.check_rates(checks, name)

    assert message =~ "--max-frame-bytes"
    assert :ok = RateLimiter.check_rates(Enum.take(checks, 3), name)
  end

  # A token a second and a booking claimable for 5 s: each step has a second or more to
  # come before the state it expects has passed, on a loaded machine too. The slack is the
  # limiters' (their waiting checks name it; the daemon's is for clients that name none).
  test "bookings belong to the process on its connection: another client's same pid claims nothing" do
    daemon = start_daemon(["--listen", "127.0.0.1:0", "--booking-slack-ms", "5000"])
    slack = [booking_slack_ms: 5_000]

    {a, b} =
      {start_limiter({:daemon, daemon.tcp}, "limiter", slack),
       start_limiter({:daemon, daemon.tcp}, "limiter", slack)}

    limit = %{capacity: 1, refill_per_sec: 1}
    checks = [{{"ex", "k"}, limit, 1}]

    assert :ok = RateLimiter.check_rates(checks, a)
    assert {:delay, ms} = RateLimiter.check_rates(checks, a, max_wait_ms: 1_000)
    Process.sleep(ms)

    # Through b this process is another client (as a process of another VM would be).
    assert {:delay, _} = RateLimiter.check_rates(checks, b)
    assert :ok = RateLimiter.check_rates(checks, a)
  end

  defp unlink_and_kill(pid) do
    Process.unlink(pid)
    Process.exit(pid, :kill)
  end
end
