defmodule Bourse.BackendCase do
  @moduledoc """
  What the tests of the port and daemon backends share: a daemon stopped when the test
  ends, a supervised limiter under a fresh name, a look into its connection (its handle,
  the routes in its table, the port's OS process), a port stopped and flooded, and a
  daemon and a Redis for the tests of every backend.

      import Bourse.BackendCase

      daemon = start_daemon(["--listen", "127.0.0.1:0"])
      name = start_limiter({:daemon, daemon.tcp})
  """

  import ExUnit.Assertions, only: [assert: 1]

  @doc """
  Asserts that callers of one bucket of 3 each (`{their first three answers, the later
  ones}`) got their own answers: the first three admitted, then at least one more, each a
  delay. An answer routed to another caller shows.
  """
  @spec assert_own_answers([{list(), list()}]) :: :ok
  def assert_own_answers(answers) do
    for {first, later} <- answers do
      assert first == [:ok, :ok, :ok]
      assert later != []
      for answer <- later, do: assert(match?({:delay, _}, answer))
    end

    :ok
  end

  import ExUnit.Callbacks, only: [on_exit: 1, start_supervised!: 2]

  alias Bourse.{DaemonServer, Error, OsSignal, RateLimiter, RedisServer}

  @doc "Starts a `bourse_daemon` server with `args`, stopped when the test ends."
  @spec start_daemon([String.t()]) :: DaemonServer.t()
  def start_daemon(args) do
    daemon = DaemonServer.start(args)
    on_exit(fn -> DaemonServer.stop(daemon) end)
    daemon
  end

  @doc """
  Starts a `bourse_daemon` server on a TCP port (stopped when the test ends) and a limiter
  on it with the daemon backend's options `opts` (`timeout: ms`), connected by one check
  admitted (of `{"ex", "warm"}`, a bucket that never runs short; tried again while a
  loaded machine makes a short timeout pass first). Returns `{daemon, name}`.
  """
  @spec start_connected_daemon(keyword()) :: {DaemonServer.t(), atom()}
  def start_connected_daemon(opts) do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    name = start_limiter({:daemon, daemon.tcp, opts})
    wide = %{capacity: 1.0e9, refill_per_sec: 1.0e9}

    Bourse.ContractCase.eventually(fn ->
      RateLimiter.check_rate({"ex", "warm"}, wide, 1, name) == :ok
    end)

    {daemon, name}
  end

  @doc """
  Starts a limiter on `backend`, with the limiter options `opts`, under the test's
  supervisor; returns its name.
  """
  @spec start_limiter(term(), String.t(), keyword()) :: atom()
  def start_limiter(backend, prefix \\ "limiter", opts \\ []) do
    name = :"#{prefix}_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, [name: name, backend: backend] ++ opts}, id: name)
    name
  end

  @doc "The connection handle of the limiter `name`."
  def handle(name), do: elem(:persistent_term.get({RateLimiter, name}), 1)

  @doc "How many callers' routes the connection's table holds."
  def routes(handle),
    do: :ets.select_count(handle.table, [{{:"$1", :_}, [{:is_integer, :"$1"}], [true]}])

  @doc "The OS pid of the port a connection runs."
  def port_os_pid(handle) do
    {:os_pid, os_pid} = Port.info(elem(:sys.get_state(handle.pid).stream, 3), :os_pid)
    os_pid
  end

  @doc """
  Stops the OS process of the port a connection runs, resumed when the test ends; returns
  its OS pid.
  """
  def stop_port(handle) do
    os_pid = port_os_pid(handle)
    OsSignal.send(os_pid, "STOP")
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{os_pid}"], stderr_to_stdout: true) end)
    os_pid
  end

  @doc """
  A task calling `check_rates/2` on the limiter `name` with 1024 checks of `limit` on
  1000-byte keys: megabytes that a stopped daemon does not read, so that its port or
  socket stays busy and later writers wait for it.
  """
  def flood(name, limit) do
    big = String.duplicate("k", 1000)
    checks = for i <- 1..1024, do: {{"ex", big, "#{i}"}, limit, 1}
    Task.async(fn -> RateLimiter.check_rates(checks, name) end)
  end

  @doc """
  Starts a `bourse_daemon` server on a Unix socket (under the system's temporary
  directory, its name starting with `prefix`) and on a TCP port, and a `redis-server`;
  both are stopped when the test ends (or the module's tests, from `setup_all`). Returns
  `%{daemon: daemon, redis: redis}`.
  """
  @spec start_daemon_and_redis(String.t()) :: %{daemon: DaemonServer.t(), redis: term()}
  def start_daemon_and_redis(prefix) do
    socket = Bourse.TempPath.new("#{prefix}", ".sock")

    daemon = start_daemon(["--socket", socket, "--listen", "127.0.0.1:0"])
    redis = RedisServer.start()
    on_exit(fn -> RedisServer.stop(redis) end)
    %{daemon: daemon, redis: redis}
  end

  @doc "The command lines of the `bourse_daemon` processes this user may read that name `needle`."
  @spec daemon_command_lines(String.t()) :: [binary()]
  def daemon_command_lines(needle) do
    for dir <- Path.wildcard("/proc/[0-9]*"),
        {:ok, line} <- [File.read(Path.join(dir, "cmdline"))],
        line =~ "bourse_daemon" and line =~ needle,
        do: line
  end

  @doc "Whether `answer` is `{:error, %Bourse.Error{type: :unavailable}}`."
  def unavailable?(answer), do: match?({:error, %Error{type: :unavailable}}, answer)
end
