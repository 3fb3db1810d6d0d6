defmodule Bourse.RateLimiter.Backend.CodecTest do
  # The backends out of the VM speak the external term format with nothing but OTP: no JSON
  # library on the code path, and start-up failures that name their real cause.
  use ExUnit.Case, async: false

  import Bourse.BackendCase, only: [start_daemon_and_redis: 1]
  import Bourse.ContractCase, only: [eventually: 1]

  alias Bourse.{DaemonServer, Error, RateLimiter}
  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.{PortStream, SocketStream}

  @moduletag :capture_log

  @limit %{capacity: 2, refill_per_sec: 0.001}

  setup_all do
    start_daemon_and_redis("bourse-codec")
  end

  test "the port, daemon and Redis backends work with no JSON library on the code path", ctx do
    # As in a release or on an Erlang without Debian's erlang-jiffy.
    for dir <- :code.get_path(),
        String.contains?(List.to_string(dir), "jiffy"),
        do: :code.del_path(dir)

    :code.purge(:jiffy)
    :code.delete(:jiffy)
    assert :code.which(:jiffy) == :non_existing

    for backend <- [
          :port,
          {:daemon, {:unix, ctx.daemon.unix}},
          {:daemon, ctx.daemon.tcp},
          {:redis, ctx.redis.url}
        ] do
      name = :"codec_#{System.unique_integer([:positive])}"
      start_supervised!({RateLimiter, name: name, backend: backend}, id: name)
      key = {"binance", "codec-#{name}", "request"}
      answers = for _ <- 1..3, do: RateLimiter.check_rate(key, @limit, 1, name)
      assert [:ok, :ok, {:delay, _}] = answers, inspect(backend)

      assert {:error, %Error{type: :invalid_parameters, message: message}} =
               RateLimiter.check_rate(key, @limit, {:tuple, "API-KEY"}, name)

      assert message =~ "got a tuple of 2 elements"
    end
  end

  test "a port that cannot run or is no bourse_daemon: the error names why" do
    settings = %{assume_busy: false, busy_start: nil, env: [], secret: nil, timeout: 1_000}
    missing = Path.join(System.tmp_dir!(), "no-such-bourse_daemon")

    assert PortStream.open({:port, missing, []}, settings) ==
             {:error, "cannot run #{missing}: no such file or directory"}

    # Trying again and again (a port restarted while its binary is gone) leaks no file.
    fds = fn -> length(File.ls!("/proc/self/fd")) end
    before = fds.()
    for _ <- 1..20, do: {:error, _} = PortStream.open({:port, missing, []}, settings)
    assert fds.() - before < 5

    # Executable, but no program: the kernel refuses to run it.
    garbage = Bourse.TempPath.new("bourse-garbage")
    on_exit(fn -> File.rm(garbage) end)
    File.write!(garbage, "garbage\n")
    File.chmod!(garbage, 0o700)

    assert PortStream.open({:port, garbage, []}, settings) ==
             {:error,
              "cannot run #{garbage}: it is not an executable this system can run " <>
                "(exec format error)"}

    # `cat` knows no --stdio-socket.
    cat = System.find_executable("cat")

    assert PortStream.open({:port, cat, []}, settings) ==
             {:error, "#{cat} exited with status 1 before it connected"}

    # A program that connects and sends the JSON hello back: not a term.
    echo = Bourse.TempPath.new("bourse-echo")
    on_exit(fn -> File.rm(echo) end)

    File.write!(echo, """
    #!/usr/bin/env python3
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[sys.argv.index("--stdio-socket") + 1])
    while data := s.recv(4096):
        s.sendall(data)
    """)

    File.chmod!(echo, 0o700)
    assert {:error, message} = PortStream.open({:port, echo, []}, settings)
    assert message =~ "not a bourse_daemon speaking protocol 1 in the external term format"
  end

  # A daemon blocked before it reads (opening a file, say) does not notice its socket or
  # its stdin closing: it is killed, or it would outlive the VM.
  test "a port that connects and never answers its hello, or never connects, is killed" do
    settings = %{assume_busy: false, busy_start: nil, env: [], secret: nil, timeout: 1_000}
    pid_file = Bourse.TempPath.new("bourse-silent-pid")
    silent = Bourse.TempPath.new("bourse-silent")
    on_exit(fn -> Enum.each([silent, pid_file], &File.rm/1) end)

    File.write!(silent, """
    #!/usr/bin/env python3
    import os, signal, socket, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(sys.argv[1], "w").write(str(os.getpid()))
    if "--connect" in sys.argv:
        s = socket.socket(socket.AF_UNIX)
        s.connect(sys.argv[sys.argv.index("--stdio-socket") + 1])
    time.sleep(60)
    """)

    File.chmod!(silent, 0o700)

    for {args, why} <- [
          {[pid_file, "--connect"], "no hello within"},
          {[pid_file], "it did not connect within"}
        ] do
      File.rm(pid_file)
      assert {:error, message} = PortStream.open({:port, silent, args}, settings)
      assert message =~ why
      os_pid = File.read!(pid_file)
      eventually(fn -> not File.exists?("/proc/#{os_pid}") end)
    end
  end

  test "a daemon past its --max-connections: the refusal reaches the client, in its codec" do
    socket = Bourse.TempPath.new("bourse-codec")
    args = ["--socket", socket, "--listen", "127.0.0.1:0", "--max-connections", "1"]
    daemon = DaemonServer.start(args)
    on_exit(fn -> DaemonServer.stop(daemon) end)

    settings = %{
      assume_busy: false,
      busy_start: nil,
      env: [],
      secret: DaemonServer.secret(),
      timeout: 1_000
    }

    unix = {:socket, {:unix, daemon.unix, nil}}
    assert {:ok, first, _hello} = SocketStream.open(unix, settings)

    # A Unix socket is refused before it says anything: a JSON line.
    assert {:error, message} = SocketStream.open(unix, settings)
    assert message =~ "the daemon answered in JSON: "
    assert message =~ "the daemon serves at most 1 connections (--max-connections)"

    # A TCP client is refused once it proved the secret: a term, as it asked.
    [host, port] = String.split(daemon.tcp, ":")
    tcp = {:socket, {:tcp, String.to_charlist(host), String.to_integer(port)}}

    assert {:ok, {socket, _counters, _select, nil} = second, _hello} =
             SocketStream.open(tcp, settings)

    assert {:ok, data} = :socket.recv(socket, 0, [], 5_000)
    assert {[refusal], _} = SocketStream.answers(SocketStream.no_partial(), data)

    assert {:ok, %{"ok" => false, "error" => %{"type" => "unavailable", "message" => message}}} =
             Connection.decode(refusal)

    assert message == "the daemon serves at most 1 connections (--max-connections)"
    SocketStream.close(first)
    SocketStream.close(second)
  end
end
