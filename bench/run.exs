# Benchmarks, printed side by side, never asserted: `make bench`.
#
#   1. the core crate (cargo bench -p bourse_core): ns per check in pure Rust;
#   2. from Elixir, one workload through the NIF backend (Bourse.RateLimiter.check_rate/4),
#      a GenServer-serialised token bucket and a pure-Elixir GCRA on :ets.update_counter,
#      at 1, 8 and 64 concurrent callers on 1 key and on 1,000 keys;
#   3. checks/s through the port backend and a shared bourse_daemon over loopback TCP;
#   4. resident memory after 1,000,000 distinct keys, and after the sweep dropped them.
#
# `mix run bench/run.exs core elixir daemon memory` runs only the sections named.
#
# Every check uses capacity 1.0e9 and refill 1.0e9/s, so every check is admitted and all
# implementations do the same work. Figures drift on a shared machine; compare the ratios
# of one run.

for file <- ["table.ex", "os_processes.ex"],
    do: Code.require_file(file, Path.join([__DIR__, "..", "demo", "support"]))

for file <- ["loop.ex", "runner.ex", "public_api.ex", "genserver_bucket.ex", "ets_gcra.ex"],
    do: Code.require_file(file, Path.join(__DIR__, "support"))

defmodule Bench do
  alias Bench.{EtsGcra, GenServerBucket, PublicAPI, Runner}
  alias Demo.{OSProcesses, Table}
  alias Bourse.RateLimiter

  @run_ms 300
  @memory_keys 1_000_000

  @sections %{
    "core" => &__MODULE__.core/0,
    "elixir" => &__MODULE__.elixir/0,
    "daemon" => &__MODULE__.daemon/0,
    "memory" => &__MODULE__.memory/0
  }

  @doc "Runs the benchmarks named in `args` (`core`, `elixir`, `daemon`, `memory`), or all."
  def main(args) do
    machine()
    names = if args == [], do: ["core", "elixir", "daemon", "memory"], else: args
    Enum.each(names, fn name -> Map.fetch!(@sections, name).() end)
  end

  defp machine do
    cpu =
      case File.read("/proc/cpuinfo") do
        {:ok, text} -> with [_, model] <- Regex.run(~r/model name\s*:\s*(.+)/, text), do: model
        _ -> "unknown"
      end

    otp = :erlang.system_info(:otp_release)
    otp_version = Path.join([:code.root_dir(), "releases", otp, "OTP_VERSION"])
    otp = with {:ok, version} <- File.read(otp_version), do: String.trim(version)
    load = "/proc/loadavg" |> File.read!() |> String.split() |> Enum.take(3)

    IO.puts("""
    # Bourse benchmarks
    Machine: #{:erlang.system_info(:logical_processors_available)} CPUs (#{cpu}), \
    #{System.schedulers_online()} schedulers online; OTP #{otp}, Elixir #{System.version()}
    Load average at start: #{Enum.join(load, " ")}
    """)
  end

  ## 1. Core crate

  @doc false
  def core do
    IO.puts(
      "## 1. Core table in Rust (cargo bench -p bourse_core; building it may take a while)\n"
    )

    cargo(["bench", "-q", "-p", "bourse_core", "--bench", "core"])
  end

  # Runs cargo in the repository, echoing its output.
  defp cargo(args) do
    {_, status} = System.cmd("cargo", args, cd: Path.expand("..", __DIR__), into: IO.stream())
    if status != 0, do: IO.puts("cargo #{Enum.join(args, " ")} failed with status #{status}")
    IO.puts("")
  end

  ## 2. Elixir

  @doc false
  def elixir do
    IO.puts("""
    ## 2. From Elixir: median of 5 runs of about #{@run_ms} ms each, after a warm-up
    ns/check is wall time divided by all callers' checks, so it falls below one call's
    latency when callers run in parallel.
    """)

    {:ok, _} = RateLimiter.start_link(name: Bench.Limiter)
    {:ok, server} = GenServerBucket.start_link()
    table = EtsGcra.new()

    implementations = [
      {"NIF (check_rate/4)", PublicAPI, Bench.Limiter},
      {"GenServer", GenServerBucket, server},
      {"ETS GCRA", EtsGcra, table}
    ]

    rows =
      for keys <- [1, 1_000], callers <- [1, 8, 64] do
        workload =
          "#{callers} caller#{if callers > 1, do: "s"}, #{thousands(keys)} key#{if keys > 1, do: "s"}"

        IO.write("  #{workload}:")

        [nif, genserver, ets] =
          for {label, module, handle} <- implementations do
            result = Runner.measure(module, handle, Runner.keys(keys), callers, @run_ms)
            IO.write(" #{label} #{round(result.ns_per_check)} ns")
            result
          end

        IO.puts("")

        [workload] ++
          Enum.map([nif, genserver, ets], &round(&1.ns_per_check)) ++
          Enum.map([nif, genserver, ets], &per_second(&1.checks_per_second)) ++
          [ratio(nif, genserver), ratio(nif, ets)]
      end

    IO.puts("")

    Table.print(
      [
        "Workload",
        "NIF ns/check",
        "GenServer ns/check",
        "ETS GCRA ns/check",
        "NIF checks/s",
        "GenServer checks/s",
        "ETS GCRA checks/s",
        "NIF vs GenServer",
        "NIF vs ETS GCRA"
      ],
      rows
    )

    IO.puts("")
  end

  defp ratio(a, b),
    do: :erlang.float_to_binary(a.checks_per_second / b.checks_per_second, decimals: 1) <> "×"

  defp per_second(x) when x >= 1.0e6, do: :erlang.float_to_binary(x / 1.0e6, decimals: 2) <> " M"
  defp per_second(x), do: :erlang.float_to_binary(x / 1.0e3, decimals: 0) <> " k"

  ## 3. Port and daemon

  @doc false
  def daemon do
    IO.puts("""
    ## 3. Out of the VM: median of 5 runs of about #{@run_ms} ms each, 1,000 keys
    Through Bourse.RateLimiter.check_rate/4: the port backend (bourse_daemon --stdio, one
    per limiter) and a bourse_daemon server on 127.0.0.1 (one TCP connection per limiter,
    its callers' requests pipelined on it; the last row spreads the keys over 8 limiters,
    so 8 connections); the NIF for reference.
    """)

    rows = OSProcesses.with_daemon(&backend_rows/1)
    IO.puts("")

    Table.print(
      ["Backend", "1 caller checks/s", "8 callers checks/s", "64 callers checks/s"],
      rows
    )

    IO.puts("""

    The daemon itself, from Rust clients (cargo run --release -p bourse_daemon --example daemon_bench):
    """)

    cargo(["run", "-q", "--release", "-p", "bourse_daemon", "--example", "daemon_bench"])
  end

  defp backend_rows(daemon_address) do
    {:ok, _} = RateLimiter.start_link(name: Bench.NIF)
    {:ok, _} = RateLimiter.start_link(name: Bench.Port, backend: :port)

    connections =
      for i <- 1..8 do
        name = :"Bench.Daemon#{i}"
        {:ok, _} = RateLimiter.start_link(name: name, backend: {:daemon, daemon_address})
        name
      end

    keys = Runner.keys(1_000)

    rows =
      for {label, limiters} <- [
            {"NIF", Bench.NIF},
            {"port (stdio)", Bench.Port},
            {"daemon (TCP), 1 connection", hd(connections)},
            {"daemon (TCP), 8 connections", List.to_tuple(connections)}
          ] do
        IO.write("  #{label}:")

        per_second =
          for callers <- [1, 8, 64] do
            result = Runner.measure(PublicAPI, limiters, keys, callers, @run_ms)
            IO.write(" #{callers} → #{per_second(result.checks_per_second)}")
            per_second(result.checks_per_second)
          end

        IO.puts("")
        [label | per_second]
      end

    Enum.each(connections, &GenServer.stop/1)
    rows
  end

  ## 4. Memory

  @touch_limit %{capacity: 1, refill_per_sec: 0.1}

  @doc false
  def memory do
    IO.puts("""
    ## 4. Memory: #{thousands(@memory_keys)} distinct keys touched once, then dropped by the sweep
    First the same #{thousands(@memory_keys)} checks with a nil limit (nothing recorded), to
    see what the calls themselves leave in VmRSS; then with capacity 1, refill 0.1/s: each
    bucket is full again, and can be dropped, 10 s after its check; the limiter sweeps every
    100 ms. The table is native memory: VmRSS of this VM counts it, :erlang.memory(:total)
    does not. The allocator may keep memory it freed, so VmRSS can stay up after the sweep;
    the last row shows whether the next 1,000,000 keys reuse it.
    """)

    {:ok, _} = RateLimiter.start_link(name: Bench.Memory, sweep_interval_ms: 100)
    before = memory_row("before")
    touch_keys(nil, "key-")
    unlimited = memory_row("after #{thousands(@memory_keys)} checks with a nil limit")
    touch_keys(@touch_limit, "key-")
    touched = memory_row("after touching #{thousands(@memory_keys)} keys")
    swept = wait_for_sweep(System.monotonic_time(:millisecond) + 30_000)
    touch_keys(@touch_limit, "other-key-")
    again = memory_row("after touching #{thousands(@memory_keys)} other keys")

    rows =
      for [label, rss, total, buckets] <- [before, unlimited, touched, swept, again],
          do: [label, megabytes(rss), megabytes(total), thousands(buckets)]

    Table.print(["When", "VmRSS", ":erlang.memory(:total)", "Buckets"], rows)

    [table_growth, total_growth] =
      for from <- [unlimited, before], do: hd(tl(touched)) - hd(tl(from))

    IO.puts("""

    VmRSS per key touched: #{round(table_growth / @memory_keys)} bytes above the nil-limit \
    checks (#{round(total_growth / @memory_keys)} above the start).
    """)
  end

  # In a process of its own, so that the key binaries' garbage goes with it.
  defp touch_keys(limit, prefix) do
    task = Task.async(fn -> touch_keys(limit, prefix, 0) end)
    Task.await(task, :infinity)
  end

  defp touch_keys(_limit, _prefix, @memory_keys), do: :ok

  defp touch_keys(limit, prefix, i) do
    :ok = RateLimiter.check_rate({"binance", prefix <> "#{i}", "request"}, limit, 1, Bench.Memory)
    touch_keys(limit, prefix, i + 1)
  end

  defp wait_for_sweep(deadline) do
    Process.sleep(200)

    case buckets() do
      0 ->
        memory_row("after the sweep")

      _ ->
        if System.monotonic_time(:millisecond) > deadline,
          do: memory_row("30 s later"),
          else: wait_for_sweep(deadline)
    end
  end

  defp memory_row(label) do
    :erlang.garbage_collect()
    [label, vm_rss_bytes(), :erlang.memory(:total), buckets()]
  end

  defp vm_rss_bytes do
    [_, kb] = Regex.run(~r/VmRSS:\s+(\d+) kB/, File.read!("/proc/self/status"))
    String.to_integer(kb) * 1024
  end

  defp thousands(n) when n < 1000, do: Integer.to_string(n)

  defp thousands(n),
    do: thousands(div(n, 1000)) <> "," <> String.pad_leading("#{rem(n, 1000)}", 3, "0")

  defp megabytes(bytes), do: :erlang.float_to_binary(bytes / 1_048_576, decimals: 1) <> " MB"

  defp buckets, do: RateLimiter.stats(Bench.Memory).buckets
end

Bench.main(System.argv())
