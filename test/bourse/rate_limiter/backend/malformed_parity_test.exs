defmodule Bourse.RateLimiter.Backend.MalformedParityTest do
  # One table of malformed inputs through the four backends: the same %Bourse.Error{}
  # (type, message, exchange) from each, since every one asks bourse_core's rules.
  use ExUnit.Case, async: false

  import Bourse.BackendCase, only: [start_daemon_and_redis: 1]

  alias Bourse.RateLimiter.Backend.{Daemon, NIF, Port, Redis}

  @moduletag :capture_log

  @limit %{capacity: 10, refill_per_sec: 10}
  @key {"binance", "api-key", "request"}
  @secret "SECRET-" <> String.duplicate("k", 40)

  setup_all do
    %{daemon: daemon, redis: redis} = start_daemon_and_redis("bourse-parity")
    opts = [assume_busy_at_start: false, booking_slack_ms: 250, sweep_interval_ms: 1000]
    {:ok, nif} = NIF.attach(nil, opts)
    {:ok, port} = Port.attach(nil, opts)
    {:ok, daemon_opts} = Daemon.options({:unix, daemon.unix}, [])
    {:ok, unix} = Daemon.attach(nil, Keyword.put(opts, :backend_opts, daemon_opts))
    {:ok, tcp_opts} = Daemon.options(daemon.tcp, [])
    {:ok, tcp} = Daemon.attach(nil, Keyword.put(opts, :backend_opts, tcp_opts))
    {:ok, redis_opts} = Redis.options(redis.url, [])
    {:ok, via_redis} = Redis.attach(nil, Keyword.put(opts, :backend_opts, redis_opts))
    %{backends: [{NIF, nif}, {Port, port}, {Daemon, unix}, {Daemon, tcp}, {Redis, via_redis}]}
  end

  defp calls do
    me = self()

    [
      {:check_rate, [me, @key, @limit, @secret, nil]},
      {:check_rate, [me, @key, @limit, -1, nil]},
      {:check_rate, [me, @key, @limit, -0.5, nil]},
      {:check_rate, [me, @key, @limit, 10 ** 400, nil]},
      {:check_rate, [me, @key, @limit, 1.0e13, nil]},
      {:check_rate, [me, @key, @limit, nil, nil]},
      {:check_rate, [me, @key, @limit, [1, 2], nil]},
      {:check_rate, [me, @key, @limit, {1}, nil]},
      {:check_rate, [me, @key, @limit, %{a: 1}, nil]},
      {:check_rate, [me, @key, @limit, :one, nil]},
      {:check_rate, [me, @key, @limit, me, nil]},
      {:check_rate, [me, @key, @limit, 1, 0]},
      {:check_rate, [me, @key, @limit, 1, 4_294_967_296]},
      {:check_rate, [me, @key, %{capacity: 10 ** 400, refill_per_sec: 1}, 1, nil]},
      {:check_rate, [me, @key, %{capacity: 0, refill_per_sec: 1}, 1, nil]},
      {:check_rate, [me, @key, %{capacity: 1, refill_per_sec: @secret}, 1, nil]},
      {:check_rate, [me, @key, %{requests: 10, period: 0}, 1, nil]},
      {:check_rate, [me, @key, %{requests: -1}, 1, nil]},
      {:check_rate, [me, @key, %{foo: 1}, 1, nil]},
      {:check_rate, [me, @key, %{"capacity" => 1, "refill_per_sec" => 1}, 1, nil]},
      {:check_rate, [me, @key, [capacity: 1], 1, nil]},
      {:check_rate, [me, @key, @secret, 1, nil]},
      {:check_rate, [me, {:binance, "k"}, @limit, 1, nil]},
      {:check_rate, [me, {{"binance", @secret}, "ip"}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", [@secret]}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", nil}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k", :ip}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k", "request", 4}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", String.duplicate("k", 1025)}, @limit, 1, nil]},
      {:check_rate, [me, @secret, @limit, 1, nil]},
      {:check_rate, [me, {<<0xFF, 0xFE>>, "k"}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", @secret <> <<0xFF>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k", <<"ip", 0xC3>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", :binary.copy(<<0xFF>>, 1025)}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", <<0xC0, 0x80>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k", <<0xED, 0xA0, 0x80>>}, @limit, 1, nil]},
      {:check_rate, [me, {<<0xF4, 0x90, 0x80, 0x80>>, "k"}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", String.duplicate("k", 1023) <> <<0xC3>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", String.duplicate("é", 513)}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", String.duplicate("k", 200_000)}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", :binary.copy(<<0xFF>>, 200_000)}, @limit, 1, nil]},
      {:check_rate, [me, {String.duplicate("e", 200_000), @secret}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k", String.duplicate("€", 342)}, @limit, 1, nil]},
      {:check_rate, [me, @key, @limit, <<0xFF, 0xFE>>, nil]},
      {:check_rate, [me, {"binance", <<0xED, 0xBF, 0xBF>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", <<0xE0, 0x80, 0xAF>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", <<0xF0, 0x80, 0x80, 0xAF>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", <<0xF8, 0x88, 0x80, 0x80, 0x80>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", <<0xF7, 0xBF, 0xBF, 0xBF>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k" <> <<0xF0, 0x9F, 0x98>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k" <> <<0x80>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", String.duplicate("k", 1021) <> "😀"}, @limit, 1, nil]},
      {:check_rate,
       [me, {"binance", String.duplicate("k", 1020) <> <<0xF0, 0x9F, 0x98>>}, @limit, 1, nil]},
      {:check_rate,
       [me, {"binance", String.duplicate("k", 1022) <> <<0xF0, 0x9F>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", String.duplicate("k", 1025) <> <<0xFF>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", <<1::3>>}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", <<"k", 1::1>>}, @limit, 1, nil]},
      {:check_rate, [me, {<<0::7>>, "k"}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", ~c"k"}, @limit, 1, nil]},
      {:check_rate, [me, {~c"binance", "k"}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", ["k", "1"]}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", "k", [?i, ?p]}, @limit, 1, nil]},
      {:check_rate, [me, {"binance", []}, @limit, 1, nil]},
      {:check_rate, [me, @key, @limit, 1.0e12 + 1, nil]},
      {:check_rate, [me, @key, @limit, 1_000_000_000_001, nil]},
      {:check_rate, [me, @key, @limit, 2 ** 64, nil]},
      {:check_rate, [me, @key, @limit, -(2 ** 64), nil]},
      {:check_rate, [me, @key, @limit, 1, -1]},
      {:check_rate, [me, @key, @limit, 1, 1.5]},
      {:check_rate, [me, @key, @limit, 1, :infinity]},
      {:check_rate, [me, @key, @limit, 1, 2 ** 64]},
      {:check_rate, [me, @key, @limit, 1, "1"]},
      {:check_rate, [me, @key, %{capacity: 1, refill_per_sec: 1, extra: 2}, 1, nil]},
      {:check_rate, [me, @key, %{1 => 2}, 1, nil]},
      {:check_rate, [me, @key, %{@secret => 2}, 1, nil]},
      {:check_rate, [me, @key, %{capacity: 1, refill_per_sec: 1, requests: 1}, 1, nil]},
      {:check_rate, [me, @key, %{requests: 10 ** 400}, 1, nil]},
      {:check_rate, [me, @key, %{capacity: 1, refill_per_sec: -0.0}, 1, nil]},
      {:check_rate, [me, @key, %{capacity: -0.0, refill_per_sec: 1}, 1, nil]},
      {:check_rate, [me, @key, %{capacity: 1, refill_per_sec: 1.0e12 + 1}, 1, nil]},
      {:check_rate, [me, @key, %{}, 1, nil]},
      {:check_rate, [me, @key, %{capacity: <<0x80>>, refill_per_sec: 1}, 1, nil]},
      {:check_rates, [me, [{@key, @limit}], nil]},
      {:check_rates, [me, [@secret], nil]},
      {:check_rates, [me, [{@key, @limit, 1} | :tail], nil]},
      {:check_rates, [me, List.duplicate({@key, @limit, 1}, 1025), nil]},
      {:check_rates, [me, %{}, nil]},
      {:check_rates, [me, [{@key, @limit, 1}, {{"binance", <<0xFF>>}, @limit, 1}], nil]},
      {:check_rates,
       [me, [{@key, @limit, 1}, {@key, %{capacity: 5, refill_per_sec: 1}, 1}], nil]},
      {:record_request, [@key, @secret]},
      {:record_request, [@key, -3]},
      {:sync, [@key, @secret, 0]},
      {:sync, [@key, 1, -1]},
      {:reset, [{@secret}]},
      {:reset_exchange, [[@secret]]},
      {:reset_exchange, [:binance]},
      {:reset_exchange, [<<0xFF>>]},
      {:reset, [{"binance", <<0xFF>>, "request"}]},
      {:record_request, [{<<0xFF>>, "k"}, 1]},
      {:sync, [{"binance", <<0xFF>>}, 1, 0]},
      {:pause, [<<0xFF>>, 1]},
      {:pause, [{"binance", @secret <> <<0xFF>>}, 1]},
      {:pause, [{"binance", "k", <<0xFF>>}, 1]},
      {:pause, [{"binance", @secret}, @secret]},
      {:pause, [{"binance", "k"}, -1]},
      {:pause, [42, 1]},
      {:inspect, [{"binance", 1}]},
      {:get_cost, [{1, "k"}]},
      {:get_cost, [{"binance", <<0xFF>>}]},
      {:inspect, [{<<0xFF>>, "k", "request"}]},
      {:back_off, [{"binance", @secret}, @secret]},
      {:back_off, [{"binance", @secret}, :bogus]},
      {:back_off, [{"binance", @secret}, nil]},
      {:back_off, [{"binance", @secret}, "credential"]},
      {:back_off, [{"binance", @secret}, "exchange"]},
      {:back_off, [{"binance", @secret}, <<0xFF, 0xFE>>]},
      {:back_off, [{"binance", @secret, "request"}, :credential]},
      {:back_off, [{@secret}, :credential]},
      {:back_off, [[@secret], :exchange]},
      {:back_off, [@secret, :credential]},
      {:back_off, [{:binance, @secret}, :credential]},
      {:back_off, [{"binance", 10 ** 400}, :credential]},
      {:back_off, [{"binance", String.duplicate("k", 1025)}, :credential]},
      {:back_off, [{String.duplicate("e", 1025), "k"}, :exchange]},
      {:back_off, [{"binance", nil}, :credential]},
      {:back_off, [{"binance", @secret <> <<0xFF>>}, :credential]},
      {:back_off, [{<<0xFF>>, "k"}, :exchange]},
      {:reset_backoff, [{"binance", @secret, "request"}]},
      {:reset_backoff, [{@secret, :public, 1}]},
      {:reset_backoff, [[{"binance", @secret}]]},
      {:reset_backoff, [{"binance", [@secret | :tail]}]},
      {:reset_backoff, [{"binance", String.duplicate("k", 1025)}]},
      {:reset_backoff, [{"binance", %{key: @secret}}]},
      {:reset_backoff, [{"binance", <<0xFF>>}]}
    ]
  end

  test "the same malformed input gets the same error from every backend", %{backends: backends} do
    for {callback, args} <- calls() do
      [{NIF, _} = nif | others] = backends
      want = answer(nif, callback, args)

      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} = want,
             "NIF #{callback}: #{inspect(want)}"

      refute message =~ "SECRET"

      for {backend, _} = other <- others do
        got = answer(other, callback, args)

        assert got == want,
               "#{inspect(backend)}.#{callback}: #{inspect(got)}\n  NIF: #{inspect(want)}"
      end
    end
  end

  test "edge key parts within the rule are buckets of their own on every backend", %{
    backends: backends
  } do
    limit = %{capacity: 1, refill_per_sec: 0.001}

    for {{backend, handle}, i} <- Enum.with_index(backends) do
      exchange = "edge#{i}"

      keys = [
        {"", "k#{i}"},
        {exchange, ""},
        {exchange, "a\0b"},
        {exchange, "a"},
        {exchange, String.duplicate("k", 1024)},
        {exchange, String.duplicate("😀", 256)},
        {exchange, "k", String.duplicate("€", 341) <> "x"},
        {exchange, "k", "\0"}
      ]

      for key <- keys do
        assert backend.check_rate(handle, self(), key, limit, 1, nil) == :ok,
               "#{inspect(backend)}: #{inspect(key, limit: 3)}"
      end

      for key <- keys do
        assert {:delay, _} = backend.check_rate(handle, self(), key, limit, 1, nil)
        assert_in_delta backend.get_cost(handle, key), 1, 0.01
      end
    end
  end

  test "edge values within the rules get the same answer from every backend", %{
    backends: backends
  } do
    ample = %{capacity: 10, refill_per_sec: 10}

    calls = [
      {{"binance", <<0xEF, 0xBF, 0xBF>>}, ample, 1},
      {{"binance", <<0xEF, 0xBF, 0xBE>>}, ample, 1},
      {{"binance", <<0xEF, 0xBB, 0xBF>>}, ample, 1},
      {{"binance", <<0xF4, 0x8F, 0xBF, 0xBF>>}, ample, 1},
      {{"binance", String.duplicate("k", 1020) <> "😀"}, ample, 1},
      {{"binance", "k", ""}, ample, 1},
      {{"binance", "k"}, ample, 1.0e-320},
      {{"binance", "k"}, ample, 0.0},
      {{"binance", "k"}, ample, -0.0},
      {{"binance", "k"}, ample, 1.0e12},
      {{"binance", "k"}, %{capacity: 1.0e-320, refill_per_sec: 1}, 1},
      {{"binance", "k"}, %{capacity: 1, refill_per_sec: 1.0e-320}, 2},
      {{"binance", "k"}, %{requests: 1.0e-320}, 1},
      {{"binance", "k"}, %{requests: 3, period: 1.5}, 4},
      {{"binance", "k"}, %{capacity: 1.0e12, refill_per_sec: 1.0e12}, 1.0e12}
    ]

    for {key, limit, cost} <- calls do
      answers =
        for {{backend, handle}, i} <- Enum.with_index(backends) do
          # Each backend's own bucket: the two daemon backends share one table.
          key = put_elem(key, 0, "edge-value-#{i}-#{System.unique_integer([:positive])}")
          backend.check_rate(handle, self(), key, limit, cost, nil)
        end

      assert length(Enum.uniq(answers)) == 1,
             "#{inspect(key, limit: 3)} #{inspect(limit)} cost #{inspect(cost)}: " <>
               inspect(answers)
    end
  end

  defp answer({backend, handle}, callback, args) do
    case apply(backend, callback, [handle | args]) do
      {:error, %Bourse.Error{} = error} ->
        {:error, Map.take(error, [:__struct__, :type, :message, :exchange])}

      other ->
        other
    end
  end
end
