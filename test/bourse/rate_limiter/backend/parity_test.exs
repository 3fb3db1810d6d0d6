defmodule Bourse.RateLimiter.Backend.ParityTest do
  # Every callback of Bourse.RateLimiter.Backend answers the same on the three backends:
  # the same shapes, the same outcomes, `{:error, message}` for the same malformed input.
  use ExUnit.Case, async: true

  alias Bourse.DaemonServer
  alias Bourse.RateLimiter.Backend

  @still %{capacity: 2, refill_per_sec: 0.001}
  @table_opts [assume_busy_at_start: false, booking_slack_ms: 250, sweep_interval_ms: 1_000]
  # How far apart two backends' answers may be, their runs of the script being up to 30 s
  # apart on a loaded machine: waits in ms, and tokens (refilled 0.001 a second).
  @wait_slack_ms 30_000
  @number_slack 0.03

  setup_all do
    daemon = DaemonServer.start(["--listen", "127.0.0.1:0"])
    on_exit(fn -> DaemonServer.stop(daemon) end)
    {:ok, daemon_opts} = Backend.Daemon.options(daemon.tcp, [])
    %{daemon_opts: daemon_opts}
  end

  setup %{daemon_opts: daemon_opts} do
    backends =
      for {backend, opts} <- [
            {Backend.NIF, @table_opts},
            {Backend.Port, @table_opts},
            {Backend.Daemon, [backend_opts: daemon_opts]}
          ] do
        {:ok, handle} = backend.attach(nil, opts)
        {backend, handle}
      end

    %{backends: backends}
  end

  test "the same calls get the same answers", %{backends: backends} do
    answers =
      for {backend, handle} <- backends do
        # The daemon is one table for the whole module: start from nothing.
        :ok = backend.reset_all(handle)

        {backend,
         for {label, callback, args} <- script() do
           {label, callback |> answer(backend, handle, args) |> normalise()}
         end}
      end

    [{_nif, expected} | others] = answers
    assert length(others) == 2 and length(expected) > 70

    for {backend, got} <- others, {{label, want}, {label, answer}} <- Enum.zip(expected, got) do
      assert same?(answer, want),
             "#{inspect(backend)}, #{label}: #{inspect(answer)}, NIF: #{inspect(want)}"
    end
  end

  # `{label, callback, args}`, run in order on one table (`handle` comes first).
  defp script do
    me = self()
    k = {"ex", "k"}
    other = %{capacity: 3, refill_per_sec: 0.001}

    [
      {"probe 1", :check_rate, [me, k, @still, 1, nil]},
      {"probe 2", :check_rate,
       [me, {"ex", "k", "request"}, %{requests: 2, period: 2.0e6}, 1, nil]},
      {"probe refused", :check_rate, [me, k, @still, 1, nil]},
      {"over budget", :check_rate, [me, k, @still, 1, 10]},
      {"booked", :check_rate, [me, k, @still, 1, 10_000_000]},
      {"claim early", :check_rate, [me, k, @still, 1, nil]},
      {"no limit", :check_rate, [me, k, nil, 5, nil]},
      {"public pool", :check_rate, [me, {"ex", :public, "ip"}, @still, 2, nil]},
      {"over capacity", :check_rate, [me, {"ex", "big"}, @still, 5, nil]},
      {"many: empty", :check_rates, [me, [], nil]},
      {"many: coalesced", :check_rates,
       [me, [{{"m", "a"}, @still, 1}, {{"m", "a"}, @still, 1}], nil]},
      {"many: all or none", :check_rates,
       [me, [{{"m", "b"}, @still, 1}, {{"m", "a"}, @still, 1}], nil]},
      {"many: nil dropped", :check_rates, [me, [{{"m", "c"}, nil, 1}], 5]},
      {"many: conflict", :check_rates,
       [me, [{{"m", "d"}, @still, 1}, {{"m", "d"}, other, 1}], nil]},
      {"record_request", :record_request, [{"ex", "debt"}, 3]},
      {"get_cost: debt only", :get_cost, [{"ex", "debt"}]},
      {"get_cost", :get_cost, [{"m", "a"}]},
      {"get_cost: unknown", :get_cost, [{"ex", "unknown"}]},
      {"sync", :sync, [{"ex", "big"}, 0.5, 0]},
      {"sync: unknown", :sync, [{"ex", "unknown"}, 0.5, 1_000]},
      {"inspect", :inspect, [k]},
      {"inspect: debt only", :inspect, [{"ex", "debt"}]},
      {"inspect: unknown", :inspect, [{"ex", "unknown"}]},
      {"pause exchange", :pause, ["paused", 1_000_000]},
      {"pause credential", :pause, [{"held", :public}, 1_000_000]},
      {"pause key", :pause, [{"held", "k", "ip"}, 1_000_000]},
      {"paused", :check_rate, [me, {"paused", "k"}, @still, 1, nil]},
      {"paused: public pool", :check_rate, [me, {"held", :public, "x"}, @still, 1, nil]},
      {"paused: key", :check_rate, [me, {"held", "k", "ip"}, @still, 1, nil]},
      {"not paused", :check_rate, [me, {"held", "k", "uid"}, @still, 1, nil]},
      {"busiest", :busiest, [2]},
      {"stats", :stats, []},
      {"sweep", :sweep, []},
      {"reset", :reset, [k]},
      {"reset: unknown", :reset, [{"ex", "unknown"}]},
      {"after reset", :get_cost, [k]},
      {"reset_exchange", :reset_exchange, ["m"]},
      {"after reset_exchange", :get_cost, [{"m", "b"}]},
      {"reset_all", :reset_all, []},
      {"after reset_all", :get_cost, [{"ex", "debt"}]}
    ] ++ malformed(me)
  end

  defp malformed(me) do
    good = {{"ex", "k"}, @still, 1}

    for {callback, args} <- [
          check_rate: [me, "binance", @still, 1, nil],
          check_rate: [me, {:binance, "k"}, @still, 1, nil],
          check_rate: [me, {"ex", :private}, @still, 1, nil],
          check_rate: [me, {"ex", "k", :ip}, @still, 1, nil],
          check_rate: [me, {"ex", String.duplicate("x", 1025)}, @still, 1, nil],
          check_rate: [me, {"ex", "k"}, %{capacity: -1, refill_per_sec: 1}, 1, nil],
          check_rate: [me, {"ex", "k"}, %{capacity: 1, refill_per_sec: 0}, 1, nil],
          check_rate: [me, {"ex", "k"}, %{capacity: 1.0e308, refill_per_sec: 1}, 1, nil],
          check_rate: [me, {"ex", "k"}, %{requests: 10, period: 0}, 1, nil],
          check_rate: [me, {"ex", "k"}, %{capacity: 1}, 1, nil],
          check_rate: [me, {"ex", "k"}, %{capacity: 1, requests: 1}, 1, nil],
          check_rate: [me, {"ex", "k"}, %{"capacity" => 1, "refill_per_sec" => 1}, 1, nil],
          check_rate: [me, {"ex", "k"}, %URI{}, 1, nil],
          check_rate: [me, {"ex", "k"}, @still, -1, nil],
          check_rate: [me, {"ex", "k"}, @still, "1", nil],
          check_rate: [me, {"ex", "k"}, @still, 10 ** 30, nil],
          check_rate: [me, {"ex", "k"}, nil, -1, nil],
          check_rates: [me, [good, {{"ex", "k"}, @still}], nil],
          check_rates: [me, [good, {{"ex", "k"}, nil, -1}], nil],
          check_rates: [me, List.duplicate(good, 1025), nil],
          check_rates: [me, %{}, nil],
          record_request: [{"ex", "k"}, -0.5],
          record_request: [{"ex", 1}, 1],
          get_cost: [{"ex"}],
          sync: [{"ex", "k"}, :x, 0],
          sync: [{"ex", "k"}, 1.0e13, 0],
          sync: [{"ex", "k"}, 1, -1],
          sync: [{"ex", "k"}, 1, 1.5],
          reset: [{1, 2}],
          reset_exchange: [:ex],
          pause: [:ex, 10],
          pause: [{"ex", "k", "ip", "x"}, 10],
          pause: ["ex", -1],
          pause: ["ex", 1.5],
          inspect: [{"ex", "k", nil}]
        ] do
      {"malformed #{callback} #{inspect(args, limit: 3, printable_limit: 20)}", callback, args}
    end
  end

  # Counters differ (only the daemon counts what it refuses itself): compare their names.
  defp answer(:stats, backend, handle, []), do: backend.stats(handle) |> Map.keys() |> Enum.sort()
  defp answer(:sweep, backend, handle, []), do: is_integer(backend.sweep(handle))
  defp answer(callback, backend, handle, args), do: apply(backend, callback, [handle | args])

  # Messages differ by backend. What moves with time between the NIF's run of the script and
  # another backend's is compared within a slack, never rounded (rounding put 996.4 s and
  # 996.6 s, or 0.0049 and 0.0051 tokens, on two sides of a step): numbers within
  # @number_slack (the buckets refill 0.001 a second), waits, tagged `{:ms, ms}`, within
  # @wait_slack_ms.
  defp normalise({:error, message}) when is_binary(message), do: {:error, :message}
  defp normalise({:error, %Bourse.Error{type: :invalid_parameters}}), do: {:error, :message}
  defp normalise({wait, ms}) when wait in [:delay, :booked, :over_budget], do: {wait, {:ms, ms}}
  defp normalise(number) when is_number(number), do: number / 1
  defp normalise(list) when is_list(list), do: Enum.map(list, &normalise/1)
  # Credentials of `busiest` rows as the public API shows them: daemons answer only their
  # fingerprints.
  defp normalise({{exchange, credential, axis}, %{} = info}),
    do: {{exchange, Bourse.Fingerprint.of(credential), axis}, normalise(info)}

  defp normalise({key, %{} = info}), do: {key, normalise(info)}
  defp normalise(%{} = map), do: Map.new(map, fn {key, value} -> {key, field(key, value)} end)
  defp normalise(other), do: other

  defp field(key, ms) when key in [:next_ready_ms, :pause_ms] and is_integer(ms), do: {:ms, ms}
  defp field(_key, value), do: normalise(value)

  defp same?({:ms, a}, {:ms, b}), do: abs(a - b) <= @wait_slack_ms
  defp same?(a, b) when is_float(a) and is_float(b), do: abs(a - b) <= @number_slack
  defp same?(a, b) when is_tuple(a) and is_tuple(b), do: same?(Tuple.to_list(a), Tuple.to_list(b))

  defp same?(a, b) when is_list(a) and is_list(b),
    do: length(a) == length(b) and Enum.all?(Enum.zip(a, b), fn {x, y} -> same?(x, y) end)

  defp same?(%{} = a, %{} = b),
    do: Map.keys(a) == Map.keys(b) and Enum.all?(a, fn {key, x} -> same?(x, b[key]) end)

  defp same?(a, b), do: a == b
end
