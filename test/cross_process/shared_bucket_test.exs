defmodule Bourse.CrossProcess.SharedBucketTest do
  # Separate OS processes – two Elixir VMs and a Python program – hammer one bucket at
  # once. Through one bourse_daemon they stay within it together; each with a limiter of
  # its own (the field report's four workers, docs/CONTRACT.md) they exceed it. Not async: it runs VMs.
  use ExUnit.Case, async: false

  alias Bourse.DaemonServer

  @moduletag :cross_process
  @moduletag timeout: 300_000

  # The bucket of test/cross_process/worker.{exs,py}.
  @capacity 5
  @refill_per_sec 20
  @duration_ms 2_000

  setup do
    daemons =
      for _ <- 1..2 do
        daemon = DaemonServer.start(["--listen", "127.0.0.1:0"])
        on_exit(fn -> DaemonServer.stop(daemon) end)
        daemon
      end

    %{daemons: daemons}
  end

  test "one daemon keeps three OS processes within one bucket; limiters of their own exceed it",
       %{daemons: [shared, python_own]} do
    shared_run =
      run("shared daemon", [
        elixir_worker(shared.tcp),
        elixir_worker(shared.tcp),
        python_worker(shared.tcp)
      ])

    own_run =
      run("one limiter each", [
        elixir_worker("nif"),
        elixir_worker("nif"),
        python_worker(python_own.tcp)
      ])

    assert shared_run.admitted <= shared_run.bound,
           "#{shared_run.admitted} admitted through one daemon, more than #{shared_run.bound}"

    assert own_run.admitted > own_run.bound,
           "limiters of their own admitted only #{own_run.admitted} (bound #{own_run.bound})"
  end

  @tag skip: Bourse.RedisCluster.unavailable()
  test "a Redis Cluster keeps two VMs and a program on a daemon within one bucket" do
    cluster = Bourse.RedisCluster.start()
    on_exit(fn -> Bourse.RedisCluster.stop(cluster) end)
    seeds = Enum.take(cluster.urls, 2)

    daemon =
      DaemonServer.start(
        ["--listen", "127.0.0.1:0"] ++ Enum.flat_map(seeds, &["--redis-cluster", &1])
      )

    on_exit(fn -> DaemonServer.stop(daemon) end)
    backend = "cluster:" <> Enum.join(seeds, ",")

    cluster_run =
      run("Redis Cluster", [
        elixir_worker(backend),
        elixir_worker(backend),
        python_worker(daemon.tcp)
      ])

    assert cluster_run.admitted <= cluster_run.bound,
           "#{cluster_run.admitted} admitted through the cluster, more than #{cluster_run.bound}"

    assert cluster_run.admitted >= 0.5 * cluster_run.bound,
           "only #{cluster_run.admitted} admitted (bound #{cluster_run.bound})"
  end

  # Runs the workers at once: each says "ready" once its limiter is up, and all are told
  # "go" together (however long their VMs took to boot on a loaded machine). Prints what
  # each admitted, the total and the bound C + r * T, T from the earliest start to the
  # latest finish.
  defp run(label, workers) do
    ports = Enum.map(workers, fn {kind, command, args} -> {kind, spawn_worker(command, args)} end)
    Enum.each(ports, fn {kind, port} -> await_ready(kind, port, []) end)
    Enum.each(ports, fn {_kind, port} -> Port.command(port, "go\n") end)
    results = Enum.map(ports, fn {kind, port} -> {kind, parse(await_exit(kind, port, []))} end)

    admitted = results |> Enum.map(fn {_, result} -> result.admitted end) |> Enum.sum()
    started = results |> Enum.map(fn {_, result} -> result.start_us end) |> Enum.min()
    finished = results |> Enum.map(fn {_, result} -> result.end_us end) |> Enum.max()
    seconds = (finished - started) / 1.0e6
    bound = @capacity + @refill_per_sec * seconds

    per_process = Enum.map_join(results, ", ", fn {kind, r} -> "#{kind} #{r.admitted}" end)

    IO.puts(
      "\n#{label}: #{admitted} admitted (#{per_process}) in #{Float.round(seconds, 3)} s; " <>
        "bound C + r*T = #{@capacity} + #{@refill_per_sec} * #{Float.round(seconds, 3)} = " <>
        "#{Float.round(bound, 1)}"
    )

    %{admitted: admitted, bound: bound}
  end

  defp spawn_worker(command, args) do
    Port.open({:spawn_executable, command}, [
      :binary,
      :exit_status,
      :stderr_to_stdout,
      line: 4096,
      args: args ++ ["#{@duration_ms}"],
      env: [{~c"LANG", ~c"C.UTF-8"}, {~c"LC_ALL", ~c"C.UTF-8"}]
    ])
  end

  defp await_ready(kind, port, output) do
    receive do
      {^port, {:data, {:eol, "ready"}}} ->
        :ok

      {^port, {:data, {_, line}}} ->
        await_ready(kind, port, [line | output])

      {^port, {:exit_status, status}} ->
        flunk("#{kind} worker exited #{status}: #{lines(output)}")
    after
      120_000 -> flunk("#{kind} worker never got ready: #{lines(output)}")
    end
  end

  defp await_exit(kind, port, output) do
    receive do
      {^port, {:data, {_, line}}} ->
        await_exit(kind, port, [line | output])

      {^port, {:exit_status, 0}} ->
        lines(output)

      {^port, {:exit_status, status}} ->
        flunk("#{kind} worker exited #{status}: #{lines(output)}")
    after
      240_000 -> flunk("#{kind} worker never finished: #{lines(output)}")
    end
  end

  defp lines(output), do: output |> Enum.reverse() |> Enum.join("\n")

  defp parse(output) do
    [_, admitted, start_us, end_us] =
      Regex.run(~r/admitted=(\d+) start_us=(\d+) end_us=(\d+)/, output) ||
        flunk("no result in worker output:\n#{output}")

    %{
      admitted: String.to_integer(admitted),
      start_us: String.to_integer(start_us),
      end_us: String.to_integer(end_us)
    }
  end

  defp elixir_worker(backend) do
    elixir = System.find_executable("elixir") || flunk("no elixir in PATH")
    script = Path.expand("worker.exs", __DIR__)
    {"elixir", elixir, ["-pa", Mix.Project.compile_path(), script, backend]}
  end

  defp python_worker(address) do
    python = System.find_executable("python3") || flunk("no python3 in PATH")
    {"python", python, [Path.expand("worker.py", __DIR__), address]}
  end
end
