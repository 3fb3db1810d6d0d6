defmodule Demo.OSProcesses do
  @moduledoc """
  The demo's other OS processes: a `bourse_daemon` server, and worker VMs running
  `demo/support/worker.exs`, each talking to this VM over a port.
  """

  @typedoc "A running OS process: the port to it and its OS pid."
  @type os_process :: %{port: port(), os_pid: pos_integer()}

  @doc """
  Starts `bourse_daemon --listen 127.0.0.1:0`, calls `fun` with the address it bound, and
  stops the daemon with SIGTERM (a server does not exit when its stdin closes), also when
  `fun` raises. Returns what `fun` returns.
  """
  @spec with_daemon((String.t() -> result)) :: result when result: term()
  def with_daemon(fun),
    do:
      with_started(["--listen", "127.0.0.1:0"], fn listeners, _os_pid -> fun.(listeners.tcp) end)

  @doc """
  Like `with_daemon/1`, with the daemon also on a Unix socket in a new temporary
  directory: `fun` gets `%{tcp: address, unix: path, os_pid: os_pid}`.
  """
  @spec with_socket_daemon((%{tcp: String.t(), unix: Path.t(), os_pid: pos_integer()} -> result)) ::
          result
        when result: term()
  def with_socket_daemon(fun) do
    dir = Path.join(System.tmp_dir!(), "bourse-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    args = ["--listen", "127.0.0.1:0", "--socket", Path.join(dir, "daemon.sock")]

    try do
      with_started(args, fn listeners, os_pid -> fun.(Map.put(listeners, :os_pid, os_pid)) end)
    after
      File.rm_rf!(dir)
    end
  end

  @doc """
  Starts `redis-server` (no persistence) on a free loopback port, calls `fun` with its URL,
  and stops the server, also when `fun` raises; `nil` without calling `fun` when no
  `redis-server` is installed. Returns what `fun` returns.
  """
  @spec with_redis((String.t() -> result)) :: result | nil when result: term()
  def with_redis(fun) do
    with executable when is_binary(executable) <- System.find_executable("redis-server") do
      {:ok, listener} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
      {:ok, port} = :inet.port(listener)
      :gen_tcp.close(listener)
      args = ["--port", "#{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
      server = open(executable, args ++ ["--loglevel", "warning"])
      wait_for_port(port, 100)

      try do
        fun.("redis://127.0.0.1:#{port}")
      after
        stop_daemon(server)
      end
    end
  end

  defp wait_for_port(port, tries) do
    case :gen_tcp.connect(~c"127.0.0.1", port, []) do
      {:ok, socket} ->
        :gen_tcp.close(socket)

      {:error, _} when tries > 0 ->
        Process.sleep(50)
        wait_for_port(port, tries - 1)
    end
  end

  defp with_started(args, fun) do
    {daemon, listeners} = start_daemon(args)

    try do
      fun.(listeners, daemon.os_pid)
    after
      stop_daemon(daemon)
    end
  end

  # The shared secret TCP clients prove goes in this VM's environment: the daemon, the
  # daemon backend and the worker VMs read it there. One line per listener says where.
  defp start_daemon(args) do
    System.put_env("BOURSE_DAEMON_SECRET", Base.encode64(:crypto.strong_rand_bytes(24)))
    daemon = open(Application.app_dir(:bourse, "priv/native/bourse_daemon"), args)

    listeners =
      for _ <- Enum.filter(args, &(&1 in ["--listen", "--socket"])), into: %{} do
        case String.split(receive_line(daemon, "listening "), " ", parts: 2) do
          ["tcp", address] -> {:tcp, address}
          ["unix", path] -> {:unix, path}
        end
      end

    {daemon, listeners}
  end

  defp stop_daemon(%{os_pid: os_pid}) do
    {_, 0} = System.cmd("kill", ["-TERM", Integer.to_string(os_pid)])
    :ok
  end

  @doc "Starts one worker VM with the arguments of `worker.exs` (after URL and COUNT)."
  @spec start_worker(String.t(), pos_integer(), [String.t()]) :: os_process()
  def start_worker(url, count, args) do
    script = Path.join(__DIR__, "worker.exs")
    ebin = Application.app_dir(:bourse, "ebin")
    open(System.find_executable("elixir"), ["-pa", ebin, script, url, "#{count}" | args])
  end

  @doc "Waits until every worker said it is ready."
  @spec await_ready([os_process()]) :: :ok
  def await_ready(workers), do: Enum.each(workers, &receive_line(&1, "ready"))

  @doc "Lets the workers go together; returns the total of the 429s they report."
  @spec run([os_process()]) :: non_neg_integer()
  def run(workers) do
    Enum.each(workers, &Port.command(&1.port, "go\n"))

    workers
    |> Enum.map(&receive_line(&1, "rejected "))
    |> Enum.map(&String.to_integer/1)
    |> Enum.sum()
  end

  defp open(executable, args) do
    port =
      Port.open({:spawn_executable, executable}, [
        :binary,
        :exit_status,
        {:line, 4096},
        args: args
      ])

    {:os_pid, os_pid} = Port.info(port, :os_pid)
    %{port: port, os_pid: os_pid}
  end

  # The rest of the next line that starts with `prefix`; other lines are skipped.
  defp receive_line(%{port: port} = os_process, prefix) do
    receive do
      {^port, {:data, {:eol, line}}} ->
        case String.split_at(line, String.length(prefix)) do
          {^prefix, rest} -> rest
          _ -> receive_line(os_process, prefix)
        end

      {^port, {:exit_status, status}} ->
        raise "#{inspect(port)} exited with status #{status}"
    after
      60_000 -> raise "no #{inspect(prefix)} line from #{inspect(port)} within 60 s"
    end
  end
end
