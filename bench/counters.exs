# What observability costs a check: ns per `check_rate` from one process.
#
#     mix run bench/counters.exs            # CALLS=1000000 ROUNDS=9 by default
#
# Rows (each the best of ROUNDS rounds, the variants interleaved round by round so that
# load from other programs hits them alike; compare ratios within one run):
#
#   * the NIF called directly (`Bourse.Native.check_rate`): the floor, no routing;
#   * the public API on a limiter without `:on_event` (events off) and with one: the `:ok`
#     path, which never emits;
#   * a refused probe (`{:delay, ms}`) without `:on_event`, with a no-op one and with one
#     that sends a message: the cost of an event.

alias Bourse.Native
alias Bourse.RateLimiter

defmodule Bench.Counters do
  def loop(0, _fun), do: :ok

  def loop(n, fun) do
    fun.()
    loop(n - 1, fun)
  end

  def time_ns(calls, fun) do
    {us, _} = :timer.tc(fn -> loop(calls, fun) end)
    flush()
    us * 1000 / calls
  end

  # Events sent to this process are dropped between rounds, outside the timing.
  defp flush do
    receive do
      _ -> flush()
    after
      0 -> :ok
    end
  end
end

calls = String.to_integer(System.get_env("CALLS", "1000000"))
rounds = String.to_integer(System.get_env("ROUNDS", "9"))
open = %{capacity: 1.0e12, refill_per_sec: 1.0e12}
shut = %{capacity: 1, refill_per_sec: 1.0e-6}
key = {"bench", "SECRET-API-KEY-123", "request"}
shut_key = {"bench", "SECRET-API-KEY-123", "shut"}
me = self()

{:ok, _} = RateLimiter.start_link(name: :bench_quiet)
{:ok, _} = RateLimiter.start_link(name: :bench_observed, on_event: fn _, _, _ -> :ok end)
{:ok, _} = RateLimiter.start_link(name: :bench_reported, on_event: fn e, _, _ -> send(me, e) end)

table = elem(:persistent_term.get({RateLimiter, :bench_quiet}), 1)

for name <- [:bench_quiet, :bench_observed, :bench_reported] do
  :ok = RateLimiter.check_rate(shut_key, shut, 1, name)
end

refused = fn name -> fn -> {:delay, _} = RateLimiter.check_rate(shut_key, shut, 1, name) end end

variants = [
  {"Bourse.Native.check_rate (floor: no routing)", calls,
   fn -> Native.check_rate(table, me, key, open, 1, nil) end},
  {"check_rate :ok, events off", calls,
   fn -> RateLimiter.check_rate(key, open, 1, :bench_quiet) end},
  {"check_rate :ok, on_event set", calls,
   fn -> RateLimiter.check_rate(key, open, 1, :bench_observed) end},
  {"check_rate {:delay, _}, events off", div(calls, 10), refused.(:bench_quiet)},
  {"check_rate {:delay, _}, on_event no-op", div(calls, 10), refused.(:bench_observed)},
  {"check_rate {:delay, _}, on_event sends a message", div(calls, 10), refused.(:bench_reported)}
]

for {_, n, fun} <- variants, do: Bench.Counters.time_ns(div(n, 10), fun)

best =
  Enum.reduce(1..rounds, %{}, fn _, best ->
    Enum.reduce(variants, best, fn {label, n, fun}, best ->
      Map.update(
        best,
        label,
        Bench.Counters.time_ns(n, fun),
        &min(&1, Bench.Counters.time_ns(n, fun))
      )
    end)
  end)

IO.puts("ns per check, one process, best of #{rounds} interleaved rounds")

for {label, _, _} <- variants do
  ns = :erlang.float_to_binary(best[label], decimals: 1)
  IO.puts(String.pad_trailing(label, 50) <> String.pad_leading(ns, 8) <> " ns")
end
