# Checks per second through Bourse.RateLimiter.check_rate/4 with the buckets out of the VM:
# `backend: :port` (bourse_daemon --stdio as an Erlang port) and `backend: {:daemon, addr}`
# (a bourse_daemon server on loopback TCP), with the in-VM NIF for reference, at 1, 8 and 64
# concurrent callers. Printed, never asserted:
#
#     mix run bench/daemon.exs [SECONDS_PER_ROW]
#
# Every check is admitted (capacity and refill 1.0e9) on keys of the caller's own, so the
# figures measure the path to the table, not refusals. The daemon's raw protocol capacity
# (no BEAM in between) is measured by native/bourse_daemon/examples/daemon_bench.rs.

defmodule DaemonBench do
  alias Bourse.RateLimiter

  @limit %{capacity: 1.0e9, refill_per_sec: 1.0e9}
  @keys_per_caller 1_000

  def main(args) do
    seconds = with [text] <- args, {n, ""} <- Float.parse(text), do: n, else: (_ -> 2.0)
    {server, address} = start_server()

    IO.puts("""
    # bourse_daemon from Elixir: check_rate/4 throughput
    #{System.schedulers_online()} schedulers online; OTP #{:erlang.system_info(:otp_release)}, \
    Elixir #{System.version()}; #{seconds} s per row; daemon server at #{address}
    """)

    IO.puts(row(["backend", "callers", "checks", "checks/s", "µs per check per caller"]))
    IO.puts(row(["---", "---:", "---:", "---:", "---:"]))

    for {label, backend} <- [
          {"nif (reference)", :nif},
          {"port", :port},
          {"daemon (tcp)", {:daemon, address}}
        ],
        callers <- [1, 8, 64] do
      name = :"bench_#{System.unique_integer([:positive])}"
      {:ok, pid} = RateLimiter.start_link(name: name, backend: backend)
      checks = measure(name, callers, seconds)
      GenServer.stop(pid)

      IO.puts(
        row([
          label,
          callers,
          checks,
          round(checks / seconds),
          Float.round(seconds * 1.0e6 * callers / max(checks, 1), 2)
        ])
      )
    end

    stop_server(server)
  end

  defp measure(name, callers, seconds) do
    key_sets =
      for caller <- 1..callers do
        keys = for n <- 1..@keys_per_caller, do: {"bench", "caller-#{caller}", "k#{n}"}
        # First sight of a key allocates its bucket: not part of the measure.
        Enum.each(keys, &(:ok = RateLimiter.check_rate(&1, @limit, 1, name)))
        keys
      end

    deadline = System.monotonic_time(:millisecond) + round(seconds * 1000)

    key_sets
    |> Enum.map(fn keys -> Task.async(fn -> loop(name, keys, keys, deadline, 0) end) end)
    |> Task.await_many(:infinity)
    |> Enum.sum()
  end

  defp loop(name, [], keys, deadline, count), do: loop(name, keys, keys, deadline, count)

  defp loop(name, [key | rest], keys, deadline, count) do
    # The clock is read once per 64 checks.
    if rem(count, 64) == 0 and System.monotonic_time(:millisecond) >= deadline do
      count
    else
      :ok = RateLimiter.check_rate(key, @limit, 1, name)
      loop(name, rest, keys, deadline, count + 1)
    end
  end

  defp start_server do
    executable = RateLimiter.Backend.Port.executable()
    # The shared secret TCP clients prove; the daemon backend reads it from this VM's env.
    secret = Base.encode64(:crypto.strong_rand_bytes(24))
    System.put_env("BOURSE_DAEMON_SECRET", secret)

    port =
      Port.open({:spawn_executable, executable}, [
        :binary,
        {:line, 256},
        args: ["--listen", "127.0.0.1:0"],
        env: [{~c"BOURSE_DAEMON_SECRET", String.to_charlist(secret)}]
      ])

    receive do
      {^port, {:data, {:eol, "listening tcp " <> address}}} -> {port, address}
    after
      10_000 -> raise "bourse_daemon did not start"
    end
  end

  defp stop_server(port) do
    {:os_pid, os_pid} = Port.info(port, :os_pid)
    System.cmd("kill", ["-TERM", Integer.to_string(os_pid)])
  end

  defp row(cells), do: "| " <> Enum.map_join(cells, " | ", &to_string/1) <> " |"
end

DaemonBench.main(System.argv())
