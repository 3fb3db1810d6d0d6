# One OS process of test/cross_process/shared_bucket_test.exs, in a VM of its own:
#
#     elixir -pa _build/test/lib/bourse/ebin test/cross_process/worker.exs BACKEND DURATION_MS
#
# BACKEND is "nif" (a limiter of its own), a daemon address ("127.0.0.1:PORT", shared) or
# "cluster:" and the comma-separated seeds of a Redis Cluster (shared).
# Once its limiter is up it prints "ready" and waits for a line on stdin; then it checks
# one bucket (capacity 5, 20/s) for DURATION_MS, sleeping the delays it is told, and prints
# "admitted=N start_us=S end_us=E" with the wall-clock times of its first and last check.

defmodule Worker do
  @key {"binance", "shared-key", "request"}
  @limit %{capacity: 5, refill_per_sec: 20}

  def hammer(deadline, admitted) do
    left = deadline - System.monotonic_time(:millisecond)

    if left <= 0 do
      admitted
    else
      case Bourse.RateLimiter.check_rate(@key, @limit, 1, :worker) do
        :ok ->
          hammer(deadline, admitted + 1)

        {:delay, ms} ->
          Process.sleep(min(ms, left))
          hammer(deadline, admitted)
      end
    end
  end
end

[backend, duration_ms] = System.argv()

backend =
  case backend do
    "nif" -> :nif
    "cluster:" <> seeds -> {:redis, String.split(seeds, ",")}
    address -> {:daemon, address}
  end

{:ok, _} = Bourse.RateLimiter.start_link(name: :worker, backend: backend)

IO.puts("ready")
IO.read(:stdio, :line)
start_us = System.os_time(:microsecond)
admitted = Worker.hammer(System.monotonic_time(:millisecond) + String.to_integer(duration_ms), 0)
end_us = System.os_time(:microsecond)
IO.puts("admitted=#{admitted} start_us=#{start_us} end_us=#{end_us}")
