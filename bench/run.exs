# Benchmarks, printed side by side, never asserted: `make bench`.
#
#   1. the core crate (cargo run --release -p bourse_core --example checks): ns per check in
#      pure Rust, and instructions per check counted by valgrind's callgrind;
#   2. from Elixir, interleaved in one run: Bourse.RateLimiter.check_rate/4 (the NIF
#      backend), check_rate/2 of buckets prepared with bucket/3, and four peers written in
#      bench/support/ (a GenServer-serialised bucket, a GCRA on :ets.update_counter, a
#      token bucket on :atomics compare-exchange, a token bucket on :ets.lookup/:ets.insert)
#      at 1, 8 and 64 callers on 1, 8 and 1,000 keys, with the ratios to the fastest peer;
#      then check_rates/2 over 3 buckets against one, by key and limit and prepared;
#   3. checks/s, p50, p99 and CPU time per check (VM and daemon) through the port backend
#      and a shared bourse_daemon on a Unix socket and on loopback TCP, at 1 and 64 callers,
#      in this VM and again in one started with +IOs false,
#      beside one caller's floor in this VM (a port to a peer that does no work, answering
#      at once or a few µs later) and the daemon's own ceiling with Rust clients (pipelined,
#      and one request in flight), and the Redis script's own cost per check with and
#      without its path for the common check;
#   4. resident memory after 1,000,000 distinct keys, and after the sweep dropped them.
#
# `mix run bench/run.exs core elixir daemon memory` runs only the sections named.
#
# Every check uses capacity 1.0e12 and refill 1.0e9/s, so every check is admitted and all
# implementations do the same work. Figures drift on a shared machine; compare the ratios
# of one run.

for file <- ["table.ex", "os_processes.ex"],
    do: Code.require_file(file, Path.join([__DIR__, "..", "demo", "support"]))

for file <-
      ~w(loop.ex runner.ex latency.ex port_floor.ex public_api.ex prepared_bucket.ex check_rates.ex genserver_bucket.ex
         ets_gcra.ex atomics_token_bucket.ex ets_token_bucket.ex),
    do: Code.require_file(file, Path.join(__DIR__, "support"))

defmodule Bench do
  alias Bench.{
    AtomicsTokenBucket,
    CheckRates,
    EtsGcra,
    EtsTokenBucket,
    GenServerBucket,
    Latency,
    PortFloor,
    PreparedBucket,
    PublicAPI,
    Runner
  }

  alias Demo.{OSProcesses, Table}
  alias Bourse.RateLimiter

  @run_ms 300
  @memory_keys 1_000_000

  @sections %{
    "core" => &__MODULE__.core/0,
    "elixir" => &__MODULE__.elixir/0,
    "daemon" => &__MODULE__.daemon/0,
    "daemon_table" => &__MODULE__.daemon_table/0,
    "memory" => &__MODULE__.memory/0
  }

  @doc "Runs the benchmarks named in `args` (`core`, `elixir`, `daemon`, `memory`), or all."
  def main(args) do
    # `daemon_table` alone is the table of section 3 in a VM started with other flags.
    if args != ["daemon_table"], do: machine()
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

  @example "checks"
  @instruction_counts [100_000, 200_000]

  @doc false
  def core do
    IO.puts("""
    ## 1. Core table in Rust (cargo run --release -p bourse_core --example #{@example})
    Median of 5 rounds of 1,000,000 checks per thread, the workloads interleaved round by
    round; every check admitted. Two threads: wall time per check of both together.
    """)

    cargo(["build", "-q", "--release", "-p", "bourse_core", "--example", @example])
    example = Path.expand("../target/release/examples/#{@example}", __DIR__)
    {_, 0} = System.cmd(example, [], into: IO.stream())
    IO.puts("")
    instructions(example)
  end

  # Instructions per check from callgrind: the difference between two runs of different
  # counts, so that start-up and the table's creation cancel out.
  defp instructions(example) do
    if System.find_executable("valgrind") do
      IO.puts("""
      Instructions per check (valgrind --tool=callgrind, #{Enum.join(@instruction_counts, " and ")} \
      checks, the difference divided by the difference of the counts; independent of the load):
      """)

      rows =
        for {label, workload} <- [
              {"1 key (hot)", "hot"},
              {"10,000 keys", "10k"},
              {"3-bucket check, 1 credential", "3-bucket"},
              {"prepared: 1 key (hot)", "hot-prepared"},
              {"prepared: 10,000 keys", "10k-prepared"},
              {"prepared: 3-bucket check, 1 credential", "3-bucket-prepared"}
            ] do
          [low, high] = Enum.map(@instruction_counts, &collected(example, workload, &1))
          [count_low, count_high] = @instruction_counts
          [label, round((high - low) / (count_high - count_low))]
        end

      Table.print(["Core check, 1 thread", "Instructions per check"], rows)
      IO.puts("")
    else
      IO.puts("valgrind not found: no instruction counts\n")
    end
  end

  defp collected(example, workload, count) do
    {output, 0} =
      System.cmd(
        "valgrind",
        ["--tool=callgrind", "--callgrind-out-file=/dev/null", example] ++
          ["--count", "#{count}", workload],
        stderr_to_stdout: true
      )

    [_, instructions] = Regex.run(~r/Collected : (\d+)/, output)
    String.to_integer(instructions)
  end

  # Runs cargo in the repository, echoing its output.
  defp cargo(args) do
    {_, status} = System.cmd("cargo", args, cd: Path.expand("..", __DIR__), into: IO.stream())
    if status != 0, do: IO.puts("cargo #{Enum.join(args, " ")} failed with status #{status}")
  end

  ## 2. Elixir

  @workloads [{1, 1}, {1, 1_000}, {8, 1}, {8, 8}, {8, 1_000}, {64, 1}, {64, 1_000}]
  @three_axes ["request", "ip", "order"]

  @doc false
  def elixir do
    IO.puts("""
    ## 2. From Elixir: ns per check, median of 5 runs of about #{@run_ms} ms each
    Every implementation is warmed up, then the 5 rounds run each of them once, in turn.
    ns/check is wall time divided by all callers' checks, so it falls below one call's
    latency when callers run in parallel. Every check is admitted. The peers are written
    in bench/support/, each after the design it is named for.
    """)

    {:ok, _} = RateLimiter.start_link(name: Bench.Limiter)

    implementations = [
      {"check_rate/4", PublicAPI, fn -> Bench.Limiter end},
      {"check_rate/2, prepared bucket", PreparedBucket, fn -> Bench.Limiter end},
      {"GenServer bucket", GenServerBucket, fn -> elem(GenServerBucket.start_link(), 1) end},
      {"ETS update_counter GCRA", EtsGcra, &EtsGcra.new/0},
      {":atomics CAS token bucket", AtomicsTokenBucket, &AtomicsTokenBucket.new/0},
      {"ETS lookup/insert token bucket", EtsTokenBucket, &EtsTokenBucket.new/0}
    ]

    rows =
      for {callers, key_count} <- @workloads do
        keys = Runner.keys(key_count)

        workload =
          "#{callers} · #{thousands(key_count)}#{if key_count == 1 and callers > 1, do: " (hot key)"}"

        IO.write("  #{workload}:")

        # A fresh handle per workload: every peer starts from an empty table, as the NIF
        # limiter's keys of other workloads do not slow its own.
        timed =
          for {_label, module, new} <- implementations,
              do: {module, new.(), if(module == PreparedBucket, do: buckets(keys), else: keys)}

        [own, prepared | peers] = Runner.compare(timed, callers, @run_ms)
        ns = Enum.map([own, prepared | peers], &round(&1.ns_per_check))
        IO.puts(" " <> Enum.join(ns, " / ") <> " ns")
        fastest = Enum.min_by(peers, & &1.ns_per_check)

        [workload | ns] ++
          [
            ratio(fastest.ns_per_check, own.ns_per_check),
            ratio(fastest.ns_per_check, prepared.ns_per_check)
          ]
      end

    IO.puts("")

    Table.print(
      ["callers · keys"] ++
        Enum.map(implementations, &elem(&1, 0)) ++
        ["check_rate/4 vs fastest peer", "prepared vs fastest peer"],
      rows
    )

    IO.puts("")
    three_buckets()
  end

  defp buckets(keys), do: PreparedBucket.buckets(Bench.Limiter, keys)

  # check_rates/2 over three buckets of one credential against check_rate on one, from
  # one process, interleaved: by key and limit, and prepared.
  defp three_buckets do
    rows =
      for key_count <- [1, 1_000] do
        single = Runner.keys(key_count, "single")
        three = CheckRates.checks(key_count, @three_axes)

        [single, three, prepared_single, prepared_three] =
          Runner.compare(
            [
              {PublicAPI, Bench.Limiter, single},
              {CheckRates, Bench.Limiter, three},
              {PreparedBucket, Bench.Limiter, buckets(single)},
              {CheckRates, Bench.Limiter, PreparedBucket.check_lists(Bench.Limiter, three)}
            ],
            1,
            @run_ms
          )

        [
          "1 · #{thousands(key_count)}",
          round(single.ns_per_check),
          round(three.ns_per_check),
          ratio(three.ns_per_check, single.ns_per_check),
          round(prepared_single.ns_per_check),
          round(prepared_three.ns_per_check),
          ratio(prepared_three.ns_per_check, prepared_single.ns_per_check)
        ]
      end

    Table.print(
      [
        "callers · credentials",
        "check_rate/4, 1 bucket",
        "check_rates/2, 3 buckets",
        "3 buckets vs 1",
        "check_rate/2, 1 prepared bucket",
        "check_rates/2, 3 prepared buckets",
        "3 prepared vs 1"
      ],
      rows
    )

    IO.puts("")
  end

  defp ratio(a, b), do: :erlang.float_to_binary(a / b, decimals: 2) <> "×"

  defp per_second(x) when x >= 1.0e6, do: :erlang.float_to_binary(x / 1.0e6, decimals: 2) <> " M"
  defp per_second(x) when x >= 1.0e5, do: :erlang.float_to_binary(x / 1.0e3, decimals: 0) <> " k"
  defp per_second(x), do: :erlang.float_to_binary(x / 1.0e3, decimals: 1) <> " k"

  ## 3. Port and daemon

  @daemon_run_ms 500
  @daemon_callers [1, 64]

  @doc false
  def daemon do
    IO.puts("""
    ## 3. Out of the VM: median of 3 runs of #{@daemon_run_ms} ms each, 1,000 keys
    Through Bourse.RateLimiter.check_rate/4: the port backend (bourse_daemon --stdio, one
    per limiter) and a bourse_daemon server on a Unix socket and on 127.0.0.1 (one
    connection per limiter, its callers' requests pipelined on it); the Redis backend (a
    redis-server on 127.0.0.1 through the limiter's bourse_daemon --stdio, its checks
    waiting at once sharing one script call); the NIF for reference.
    Latency of one check in µs, sampled on one check in 8 of every caller. CPU: user and
    system time per check of this VM and of the daemon (a port's or the server), in µs;
    less dependent on the machine's other load than checks/s, and N CPUs can serve no more
    than N s / (VM + daemon) checks per second.
    Load average now: #{load_average()}
    """)

    daemon_table()

    IO.puts("""

    The same in a VM started with +IOs false (the VM's own poll thread watches every port
    and socket; by default a scheduler polls those read often itself):
    """)

    mix_run(["bench/run.exs", "daemon_table"], [{"ELIXIR_ERL_OPTIONS", "+IOs false"}])
    port_floor()

    IO.puts("""

    The daemon itself, from Rust clients in the same run (cargo run --release -p bourse_daemon --example daemon_bench):
    """)

    cargo(["run", "-q", "--release", "-p", "bourse_daemon", "--example", "daemon_bench"])

    IO.puts(
      "\nThrough Redis, from Rust clients (one check in flight each; --example redis_bench):\n"
    )

    cargo(
      ~w(run -q --release -p bourse_daemon --example redis_bench --) ++
        ~w(--store memory --store redis --clients 1 --clients 64 --seconds 1)
    )

    IO.puts(
      "\nThe Redis script alone, with and without its path for the common check (--example script_bench):\n"
    )

    cargo(~w(run -q --release -p bourse_daemon --example script_bench))

    IO.puts("")
  end

  @doc false
  def daemon_table do
    rows =
      OSProcesses.with_socket_daemon(fn daemon ->
        OSProcesses.with_redis(&backend_rows(daemon, &1)) || backend_rows(daemon, nil)
      end)

    IO.puts("")

    Table.print(
      ["Backend"] ++
        Enum.flat_map(
          @daemon_callers,
          &["#{&1} caller(s) checks/s", "p50 µs", "p99 µs", "CPU µs: VM + daemon"]
        ),
      rows
    )
  end

  # Runs `mix run ARGS` in a new VM with `env` added, echoing its output.
  defp mix_run(args, env) do
    {_, status} =
      System.cmd("mix", ["run" | args],
        cd: Path.expand("..", __DIR__),
        env: env,
        into: IO.stream(),
        stderr_to_stdout: true
      )

    if status != 0, do: IO.puts("mix run #{Enum.join(args, " ")} failed with status #{status}")
  end

  @floor_delays_us [0, 1, 3, 6]
  @floor_round_trips 20_000

  # One caller's floor: a port to a peer that does no work (--example port_echo).
  defp port_floor do
    IO.puts("""

    One caller's floor in this VM, in the same run: #{@floor_round_trips} round trips of a \
    200-byte frame through a {packet, 4} port to a peer that polls its input and echoes it \
    (cargo run --release -p bourse_daemon --example port_echo), answering at once or some \
    µs after reading (the daemon needs a few µs to decode, run and encode a check):
    """)

    cargo(~w(build -q --release -p bourse_daemon --example port_echo))
    echo = Path.expand("../target/release/examples/port_echo", __DIR__)

    rows =
      for delay <- @floor_delays_us do
        floor = PortFloor.measure(echo, delay, @floor_round_trips)

        [
          "#{delay} µs",
          per_second(floor.round_trips_per_second),
          micros(floor.p50_us),
          micros(floor.p99_us)
        ]
      end

    Table.print(["Peer answers after", "round trips/s", "p50 µs", "p99 µs"], rows)
  end

  defp load_average,
    do: "/proc/loadavg" |> File.read!() |> String.split() |> Enum.take(3) |> Enum.join(" ")

  defp backend_rows(%{tcp: tcp, unix: unix, os_pid: server}, redis) do
    limiters = [
      {"NIF", Bench.NIF, [], nil},
      {"port (stdio)", Bench.Port, [backend: :port], :port},
      {"daemon (Unix socket)", Bench.Unix, [backend: {:daemon, {:unix, unix}}], server},
      {"daemon (TCP)", Bench.TCP, [backend: {:daemon, tcp}], server}
    ]

    # Without redis-server installed, the Redis row is left out.
    redis =
      if redis,
        do: [
          {"Redis (bourse_daemon --stdio --redis)", Bench.Redis, [backend: {:redis, redis}],
           :port}
        ],
        else: []

    limiters = limiters ++ redis

    keys = Runner.keys(1_000)

    for {label, name, opts, daemon} <- limiters do
      {:ok, pid} = RateLimiter.start_link([name: name] ++ opts)
      IO.write("  #{label}:")
      os_pid = if daemon == :port, do: port_os_pid(name), else: daemon

      cells =
        Enum.flat_map(@daemon_callers, fn callers ->
          result = Latency.measure(name, keys, callers, @daemon_run_ms, os_pid)
          IO.write(" #{callers} → #{per_second(result.checks_per_second)}")

          [
            per_second(result.checks_per_second),
            micros(result.p50_us),
            micros(result.p99_us),
            cpu(result.vm_cpu_us) <> " + " <> cpu(result.os_process_cpu_us)
          ]
        end)

      IO.puts("")
      GenServer.stop(pid)
      [label | cells]
    end
  end

  # The OS process of the limiter's port: the last element of its connection's stream.
  defp port_os_pid(name) do
    {_backend, handle, _events, _pid} = :persistent_term.get({RateLimiter, name})
    {:os_pid, os_pid} = Port.info(elem(:sys.get_state(handle.pid).stream, 3), :os_pid)
    os_pid
  end

  defp cpu(nil), do: "–"
  defp cpu(us), do: :erlang.float_to_binary(us, decimals: 1)

  defp micros(us) when us >= 100, do: Integer.to_string(round(us))
  defp micros(us), do: :erlang.float_to_binary(us, decimals: 1)

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
