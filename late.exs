dpid = File.read!("/tmp/h6w/ex.pid") |> String.trim()
{:ok, _} = Bourse.RateLimiter.start_link(name: L, backend: {:daemon, {:unix, "/tmp/h6w/ex.sock"}}, booking_slack_ms: 250)
Process.sleep(300)
key = %{exchange: "binance", credential: nil}
limit = %{requests: 1, period: 1000}
IO.inspect(Bourse.RateLimiter.check_rate(key, limit, 1, L), label: "drain")
me = System.pid()
# while the waiter sleeps (ready in ~1000 ms): at 500 ms stop this VM for 2 s, and kill the daemon meanwhile
System.cmd("sh", ["-c", "(sleep 0.5; kill -STOP #{me}; sleep 1; kill -KILL #{dpid}; sleep 1; kill -CONT #{me}) >/dev/null 2>&1 &"])
t0 = System.monotonic_time(:millisecond)
r = Bourse.RateLimiter.wait_for_capacity(key, limit, 1, L, max_wait_ms: 5000)
IO.inspect({r, System.monotonic_time(:millisecond) - t0}, label: "wait_for_capacity (booking ready at ~1000 ms, slack 250)")
