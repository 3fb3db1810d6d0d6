# One worker of the demo's cross-process runs, in an OS process of its own:
#
#   elixir -pa BOURSE_EBIN demo/support/worker.exs URL COUNT nif
#   elixir -pa BOURSE_EBIN demo/support/worker.exs URL COUNT daemon IP:PORT
#
# Starts its limiter (a NIF table of its own, or a connection to the shared
# bourse_daemon), prints "ready", waits for a line on stdin, then sends COUNT requests to
# URL through a bucket of 2 plus 7/s (retrying after a 429 as Demo.Client does) and
# prints "rejected N".

Code.require_file("client.ex", __DIR__)

alias Bourse.RateLimiter

[url, count, backend | address] = System.argv()

backend =
  case {backend, address} do
    {"nif", []} -> :nif
    {"daemon", [address]} -> {:daemon, address}
  end

{:ok, _} = RateLimiter.start_link(name: Demo.Worker, backend: backend)

bucket = %{
  limiter: Demo.Worker,
  key: {"mock", "cross-process", "ip"},
  limit: %{capacity: 2, refill_per_sec: 7}
}

# The limiter answers (for a daemon: the connection is up) before the worker says ready.
case RateLimiter.get_cost(bucket.key, nil, bucket.limiter) do
  borrowed when is_number(borrowed) -> IO.puts("ready")
  error -> raise "the limiter does not answer: #{inspect(error)}"
end

IO.gets("")
rejected = Demo.Client.send_requests(url, bucket, String.to_integer(count), retries: 3)
IO.puts("rejected #{rejected}")
