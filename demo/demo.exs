# The field report's experiments (docs/CONTRACT.md, Sources), rerun against Bourse.RateLimiter: `make demo`.
#
# An embedded mock exchange on 127.0.0.1 counts like Binance's per-IP weight counter
# (10 weight per fixed 1-second window aligned to the wall clock, 429 with Retry-After
# above that, rejected requests not counted). The clients reach their buckets through
# the public API of Bourse.RateLimiter only. Then the exchange feedback experiments
# (demo/support: scripted replies through the adapter loop, processes sharing a bucket,
# a heartbeat beside 1,000 waiters, the exchange profiles against mocks that count like
# the exchanges, used-weight header sync). Exits 1 if a correctly sized or a shared
# bucket drew a 429.

for file <- ~w(table.ex client.ex os_processes.ex replies.ex concurrency.ex profiles.ex),
    do: Code.require_file(file, Path.join(__DIR__, "support"))

defmodule Demo do
  alias Bourse.RateLimiter
  alias Bourse.RateLimiter.Limits
  alias Bourse.Testing.MockExchange
  alias Demo.{Client, OSProcesses, Table}

  @doc "Runs every experiment, prints the tables and a summary, and halts."
  def main do
    {:ok, _} = RateLimiter.start_link(name: Demo.Limiter)
    {:ok, mock} = MockExchange.start(limit: 10, window_ms: 1000)
    IO.puts("Mock exchange on #{mock.url}: 10 weight per 1-second window per IP.\n")

    results = Map.merge(sizing(mock), workers(mock))
    results = Map.merge(results, heavy_behind_cheap())
    binance_limits()

    feedback =
      for experiment <- [Demo.Replies, Demo.Concurrency, Demo.Profiles],
          do: experiment.run(Demo.Limiter)

    summary(results, feedback)
  end

  ## 1. Sizing

  @sizing [
    {"10, 10/s", %{capacity: 10, refill_per_sec: 10}, "9 from a window boundary", false},
    {"2, 8/s", %{capacity: 2, refill_per_sec: 8}, "0", true},
    {"2, 7/s", %{capacity: 2, refill_per_sec: 7}, "0, in 5.4 s", true}
  ]

  defp sizing(mock) do
    IO.puts("""
    ## 1. 40 requests from one caller, bucket full at start, started on a window boundary
    Each request waits for its bucket (wait_for_capacity), then is sent once.
    """)

    rows =
      for {{label, limit, seed, sized?}, run} <- Enum.with_index(@sizing, 1) do
        bucket = %{limiter: Demo.Limiter, key: {"mock", "sizing-#{run}", "ip"}, limit: limit}
        IO.write("  capacity #{label} ... ")
        MockExchange.reset_stats(mock)
        Client.sleep_until_window_start()
        {rejected, ms} = Client.timed(fn -> Client.send_requests(mock.url, bucket, 40) end)
        ^rejected = MockExchange.stats(mock).rejected
        IO.puts("#{rejected} × 429 in #{Table.seconds(ms)}")
        burst = Table.number(limit.capacity + limit.refill_per_sec)
        {[label, burst, rejected, Table.seconds(ms), seed], {label, sized?, rejected}}
      end

    IO.puts("")

    Table.print(
      ["Capacity, rate", "Capacity + rate × 1 s", "HTTP 429", "Wall time", "Field report"],
      Enum.map(rows, &elem(&1, 0))
    )

    IO.puts("")
    %{sizing: Enum.map(rows, &elem(&1, 1))}
  end

  ## 2. Four workers

  @worker_limit %{capacity: 2, refill_per_sec: 7}

  defp workers(mock) do
    IO.puts("""
    ## 2. Four workers, 10 requests each, buckets of 2 plus 7/s
    A 429 pauses the worker's bucket for Retry-After and the request is retried (up to
    3 times), as `call` does in Fincode's field report; every 429 is counted. First as processes
    of this VM, then as OS processes of their own (elixir worker VMs), each with its own
    NIF table, or all connected to one bourse_daemon.
    """)

    OSProcesses.with_daemon(&workers(mock, &1))
  end

  defp workers(mock, daemon_address) do
    # The worker VMs boot while the runs in this VM go on.
    own_vms = for _ <- 1..4, do: OSProcesses.start_worker(mock.url, 10, ["nif"])

    daemon_vms =
      for _ <- 1..4, do: OSProcesses.start_worker(mock.url, 10, ["daemon", daemon_address])

    own = for i <- 1..4, do: start_limiter(:"Demo.Worker#{i}")
    shared = List.duplicate(start_limiter(Demo.Shared), 4)

    in_vm =
      for {run, label, limiters} <- [
            {:own_vm, "one limiter per worker, one VM", own},
            {:shared_vm, "one shared limiter, one VM", shared}
          ],
          do: run_workers(run, label, fn -> four_workers(mock, limiters, label) end)

    IO.write("  (waiting for the 8 worker VMs to be ready) ... ")
    OSProcesses.await_ready(own_vms ++ daemon_vms)
    IO.puts("ready")

    cross =
      for {run, label, vms} <- [
            {:own_os, "one limiter per worker, 4 OS processes", own_vms},
            {:shared_daemon, "one shared bourse_daemon, 4 OS processes", daemon_vms}
          ],
          do: run_workers(run, label, fn -> OSProcesses.run(vms) end)

    results = in_vm ++ cross
    seed = %{own_vm: "5 to 12", own_os: "5 to 12", shared_vm: "0", shared_daemon: "0"}
    IO.puts("")

    Table.print(
      ["Workers' buckets", "HTTP 429 (of 40 + retries)", "Wall time", "Field report"],
      for(
        {run, label, rejected, ms} <- results,
        do: [label, rejected, Table.seconds(ms), seed[run]]
      )
    )

    IO.puts("")
    %{workers: Map.new(results, fn {run, _, rejected, _} -> {run, rejected} end)}
  end

  defp run_workers(run, label, fun) do
    IO.write("  #{label} ... ")
    Client.sleep_until_window_start()
    {rejected, ms} = Client.timed(fun)
    IO.puts("#{rejected} × 429 in #{Table.seconds(ms)}")
    {run, label, rejected, ms}
  end

  defp start_limiter(name) do
    {:ok, _} = RateLimiter.start_link(name: name)
    name
  end

  defp four_workers(mock, limiters, label) do
    limiters
    |> Enum.map(fn limiter ->
      bucket = %{limiter: limiter, key: {"mock", label, "ip"}, limit: @worker_limit}
      Task.async(fn -> Client.send_requests(mock.url, bucket, 10, retries: 3) end)
    end)
    |> Task.await_many(60_000)
    |> Enum.sum()
  end

  ## 3. A heavy call behind a cheap loop

  @hog_limit %{capacity: 10, refill_per_sec: 10}
  @probe_give_up_ms 3_000

  defp heavy_behind_cheap do
    IO.puts("""
    ## 3. A cost-8 call behind a process taking cost-1 as fast as the bucket allows
    Bucket 10 plus 10/s. The cheap loop probes (check_rate) and sleeps each delay; it
    has run 1.5 s, so the bucket is empty when the heavy call arrives.
    """)

    runs = [
      {"check_rate loop, sleeping each delay (the seed's acquire)", &probe_until_admitted/2},
      {"wait_for_capacity (books its cost)", &wait_for_capacity/2}
    ]

    rows =
      for {{label, heavy}, run} <- Enum.with_index(runs, 1) do
        key = {"mock", "heavy-#{run}", "ip"}
        IO.write("  #{label} ... ")
        hog = spawn_link(fn -> cheap_loop(key, 0) end)
        Process.sleep(1_500)
        send(hog, {:count, self()})
        before = receive(do: ({:count, n} -> n))
        {outcome, ms} = Client.timed(fn -> heavy.(key, 8) end)
        send(hog, {:stop, self()})
        cheap = receive(do: ({:count, n} -> n - before))

        waited =
          if outcome == :ok,
            do: Table.seconds(ms),
            else: "not admitted after #{Table.seconds(ms)}"

        IO.puts(waited)
        [label, waited, cheap]
      end

    IO.puts("")
    Table.print(["Cost-8 call", "Wait", "Cost-1 calls admitted meanwhile"], rows)
    IO.puts("")
    [_, [_, waited, _]] = rows
    %{heavy_wait: waited}
  end

  defp cheap_loop(key, admitted) do
    receive do
      {:count, from} ->
        send(from, {:count, admitted})

      {:stop, from} ->
        send(from, {:count, admitted})
        exit(:normal)
    after
      0 -> :ok
    end

    case RateLimiter.check_rate(key, @hog_limit, 1, Demo.Limiter) do
      :ok ->
        cheap_loop(key, admitted + 1)

      {:delay, ms} ->
        Process.sleep(ms)
        cheap_loop(key, admitted)
    end
  end

  defp wait_for_capacity(key, cost),
    do: RateLimiter.wait_for_capacity(key, @hog_limit, cost, Demo.Limiter)

  defp probe_until_admitted(key, cost),
    do: probe_until_admitted(key, cost, System.monotonic_time(:millisecond) + @probe_give_up_ms)

  defp probe_until_admitted(key, cost, give_up_at) do
    case RateLimiter.check_rate(key, @hog_limit, cost, Demo.Limiter) do
      :ok ->
        :ok

      {:delay, ms} ->
        if System.monotonic_time(:millisecond) + ms > give_up_at do
          Process.sleep(max(give_up_at - System.monotonic_time(:millisecond), 0))
          :starved
        else
          Process.sleep(ms)
          probe_until_admitted(key, cost, give_up_at)
        end
    end
  end

  ## 4. Binance exchangeInfo

  @exchange_info %{
    "rateLimits" => [
      %{
        "rateLimitType" => "REQUEST_WEIGHT",
        "interval" => "MINUTE",
        "intervalNum" => 1,
        "limit" => 6000
      },
      %{"rateLimitType" => "ORDERS", "interval" => "SECOND", "intervalNum" => 10, "limit" => 100},
      %{"rateLimitType" => "ORDERS", "interval" => "DAY", "intervalNum" => 1, "limit" => 200_000},
      %{
        "rateLimitType" => "RAW_REQUESTS",
        "interval" => "MINUTE",
        "intervalNum" => 5,
        "limit" => 300_000
      }
    ]
  }

  @seed_sizes %{
    {"REQUEST_WEIGHT", 1, "MINUTE"} => "480, 72/s",
    {"ORDERS", 10, "SECOND"} => "8, 7.2/s",
    {"ORDERS", 1, "DAY"} => "16000, 1.66667/s",
    {"RAW_REQUESTS", 5, "MINUTE"} => "24000, 720/s"
  }

  defp binance_limits do
    IO.puts("""
    ## 4. Buckets from Binance exchangeInfo rateLimits (share 0.8, burst 0.1)
    Limits.from_binance_exchange_info/2 keys each bucket by type, interval and number.
    """)

    {:ok, buckets} = Limits.from_binance_exchange_info(@exchange_info)

    rows =
      for %{"rateLimitType" => type, "intervalNum" => num, "interval" => interval} <-
            @exchange_info["rateLimits"] do
        key = {type, num, interval}
        %{capacity: capacity, refill_per_sec: refill} = Map.fetch!(buckets, key)
        [inspect(key), Table.number(capacity), "#{Table.number(refill)}/s", @seed_sizes[key]]
      end

    Table.print(["Entry", "Capacity", "Refill", "Field report"], rows)
    by_type = Map.new(@exchange_info["rateLimits"], &{&1["rateLimitType"], &1})

    IO.puts("""

    #{map_size(buckets)} buckets for #{length(@exchange_info["rateLimits"])} entries: both ORDERS \
    entries kept. Keyed by type alone (the seed's mistake), the last ORDERS entry wins: \
    #{by_type["ORDERS"]["limit"]} per #{by_type["ORDERS"]["intervalNum"]} \
    #{by_type["ORDERS"]["interval"]}, and the 10-second limit is lost.
    """)
  end

  ## Summary

  defp summary(results, feedback) do
    [{_, _, oversized}, {_, _, exact}, {_, _, margin}] = results.sizing
    workers = results.workers
    IO.puts("## Summary\n")

    Table.print(
      ["Experiment", "Field report", "Bourse.RateLimiter"],
      [
        ["40 requests, bucket 10 + 10/s, from a boundary", "9 × 429", "#{oversized} × 429"],
        ["40 requests, bucket 2 + 8/s / 2 + 7/s", "0 / 0 × 429", "#{exact} / #{margin} × 429"],
        ["4 workers, own buckets, one VM", "5 to 12 × 429", "#{workers.own_vm} × 429"],
        ["4 workers, one shared limiter, one VM", "0 × 429", "#{workers.shared_vm} × 429"],
        ["4 OS processes, own buckets", "5 to 12 × 429", "#{workers.own_os} × 429"],
        ["4 OS processes, one shared bourse_daemon", "0 × 429", "#{workers.shared_daemon} × 429"],
        ["cost 8 behind a cost-1 loop", "still waiting after 10 s", results.heavy_wait],
        ["Binance ORDERS entries kept", "1 (keyed by type)", "2"]
      ] ++ Enum.flat_map(feedback, & &1.summary)
    )

    sized = for {label, true, rejected} <- results.sizing, do: {"bucket #{label}", rejected}

    shared = [
      {"shared limiter, one VM", workers.shared_vm},
      {"shared bourse_daemon", workers.shared_daemon}
    ]

    own =
      for {label, rejected} <- sized ++ shared, rejected > 0, do: "#{label}: #{rejected} × 429"

    case own ++ Enum.flat_map(feedback, & &1.failures) do
      [] ->
        IO.puts("\nNo 429 from any correctly sized or shared configuration.")

      failures ->
        IO.puts(
          "\nFAILED: sized or shared configurations drew 429s: #{Enum.join(failures, "; ")}"
        )

        System.halt(1)
    end
  end
end

Demo.main()
