defmodule Bourse.RateLimiter.Backend.UnreachableTest do
  # Bad input while the store cannot answer (no daemon at the socket, a stopped daemon or
  # port, Redis down) is judged by the core: the NIF's :invalid_parameters error, not
  # :unavailable. Checks without a limit answer as the NIF does: they need no store. Other
  # valid input stays :unavailable (docs/CONTRACT.md §8, "Stores").
  use ExUnit.Case, async: true

  import Bourse.BackendCase

  alias Bourse.{Error, OsSignal, RateLimiter}
  alias Bourse.RateLimiter.Backend.{Daemon, NIF}

  require Logger

  @moduletag :capture_log

  @limit %{capacity: 10, refill_per_sec: 1}
  @key {"binance", "api-key", "request"}

  # Malformed input for every callback that takes input, as the callbacks take it.
  defp malformed do
    me = self()
    other = %{capacity: 5, refill_per_sec: 1}

    [
      {:check_rate, [me, :badkey, @limit, 1, nil]},
      {:check_rate, [me, @key, @limit, -1, nil]},
      {:check_rate, [me, @key, %{capacity: 0, refill_per_sec: 1}, 1, 1_000]},
      {:check_rate, [me, @key, @limit, 1, 0]},
      {:check_rate, [me, @key, Map.new(1..5_000, &{&1, &1}), 1, nil]},
      {:check_rates, [me, [{@key, @limit, 1}, {@key, other, 1}], nil]},
      {:check_rates, [me, [{@key, @limit, 1} | :tail], 1_000]},
      {:check_rates, [me, List.duplicate({@key, @limit, 1}, 1_025), nil]},
      {:record_request, [@key, -3]},
      {:get_cost, [{1, "k"}]},
      {:sync, [@key, 1, -1]},
      {:reset, [{"binance"}]},
      {:reset_exchange, [:binance]},
      {:pause, [{"binance", "k"}, -1]},
      {:back_off, [{"binance", "k"}, :bogus]},
      {:reset_backoff, [{"binance", "k", "request"}]},
      {:inspect, [{"binance", 1}]},
      {:busiest, [0]}
    ]
  end

  # Valid input for the same callbacks.
  defp valid do
    me = self()

    [
      {:check_rate, [me, @key, @limit, 1, nil]},
      {:check_rate, [me, @key, @limit, 1, 1_000]},
      {:check_rates, [me, [{@key, @limit, 1}, {{"binance", :public}, nil, 2}], nil]},
      {:record_request, [@key, 3]},
      {:get_cost, [@key]},
      {:sync, [@key, 1, 100]},
      {:reset, [@key]},
      {:reset_exchange, ["binance"]},
      {:pause, [{"binance", "k"}, 100]},
      {:back_off, [{"binance", "k"}, :credential]},
      {:reset_backoff, [{"binance", "k"}]},
      {:inspect, [@key]},
      {:busiest, [10]}
    ]
  end

  defp nif_answer(callback, args) do
    {:ok, table} = NIF.attach(nil, assume_busy_at_start: false, booking_slack_ms: 250)
    apply(NIF, callback, [table | args])
  end

  test "no daemon at the socket: every callback judges bad input as the NIF does" do
    path = Bourse.TempPath.new("bourse-nowhere")
    {:ok, opts} = Daemon.options({:unix, path}, timeout: 200)
    {:ok, handle} = Daemon.attach(nil, backend_opts: opts)

    for {callback, args} <- malformed() do
      want = nif_answer(callback, args)
      assert {:error, %Error{type: :invalid_parameters}} = want, "NIF #{callback}"
      assert apply(Daemon, callback, [handle | args]) == want, "#{callback} #{inspect(want)}"
    end

    for {callback, args} <- valid() do
      assert unavailable?(apply(Daemon, callback, [handle | args])), "#{callback}"
    end
  end

  test "a socket path that is a file or a directory is named as such" do
    file = Bourse.TempPath.new("bourse-file")
    File.write!(file, "")
    on_exit(fn -> File.rm(file) end)

    for {path, what} <- [{file, "a regular file"}, {System.tmp_dir!(), "a directory"}] do
      {:ok, opts} = Daemon.options({:unix, path}, timeout: 200)
      {:ok, handle} = Daemon.attach(nil, backend_opts: opts)

      assert {:error, %Error{type: :unavailable, message: message}} =
               Daemon.check_rate(handle, self(), @key, @limit, 1, nil)

      assert message =~ "#{path} is #{what}, not a socket"
    end
  end

  test "a stopped daemon: bad input is :invalid_parameters, with the NIF's message, once the call times out" do
    {daemon, name} = start_connected_daemon(timeout: 300)
    nif = start_limiter(:nif)
    OsSignal.send(daemon.os_pid, "STOP")
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{daemon.os_pid}"], stderr_to_stdout: true) end)
    assert_public_calls(name, nif)
  end

  @tag timeout: 60_000
  test "a stopped port: bad input is :invalid_parameters, with the NIF's message, once the call times out" do
    name = start_limiter(:port)
    nif = start_limiter(:nif)
    assert :ok = RateLimiter.check_rate(@key, @limit, 1, name)
    stop_port(handle(name))
    assert_public_calls(name, nif)
  end

  test "a stopped daemon or port: bad input is answered long before the call's timeout" do
    {daemon, connected} = start_connected_daemon(timeout: 5_000)
    OsSignal.send(daemon.os_pid, "STOP")
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{daemon.os_pid}"], stderr_to_stdout: true) end)
    port = start_limiter(:port)
    assert :ok = RateLimiter.check_rate(@key, @limit, 1, port)
    stop_port(handle(port))
    nif = start_limiter(:nif)

    for name <- [connected, port] do
      answers =
        bad_calls()
        |> Enum.map(fn call -> Task.async(fn -> :timer.tc(fn -> call.(name) end) end) end)
        |> Task.await_many(30_000)

      for {call, {micros, answer}} <- Enum.zip(bad_calls(), answers) do
        assert {:error, %Error{type: :invalid_parameters}} = want = call.(nif)
        assert answer == want
        # Before, each waited the whole 5 s timeout.
        assert micros < 2_500_000, "answered after #{div(micros, 1000)} ms"
      end
    end
  end

  test "Redis down: bad input is :invalid_parameters, with the NIF's message" do
    name = start_limiter({:redis, "redis://127.0.0.1:1", redis_timeout_ms: 200})
    nif = start_limiter(:nif)
    assert_public_calls(name, nif)
  end

  test "Redis down: calls answer :unavailable, and a warning says why, once in a while" do
    address = "127.0.0.1:#{Bourse.Loopback.free_port()}"

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        name = start_limiter({:redis, "redis://#{address}", redis_timeout_ms: 200})

        for _ <- 1..5 do
          assert {:error, %Error{type: :unavailable, message: message}} =
                   RateLimiter.check_rate(@key, @limit, 1, name)

          assert message =~ "redis at #{address}"
        end

        # The connection logs them: once it handled them all, the log has them.
        :sys.get_state(handle(name).pid)
        Logger.flush()
      end)

    warnings = for line <- String.split(log, "\n"), line =~ "[warning]", do: line
    assert [warning] = Enum.filter(warnings, &(&1 =~ "redis at #{address}")), log
    refute warning =~ "api-key"
  end

  test "a request too large for the daemon's frames is judged by the core" do
    {_daemon, name} = start_connected_daemon([])
    nif = start_limiter(:nif)
    long = String.duplicate("k", 1_000)
    checks = for(i <- 1..400, do: {{"binance", long, "a#{i}"}, @limit, 1}) ++ [{@key, @limit, -1}]

    assert {:error, %Error{type: :invalid_parameters, message: message}} =
             answer = RateLimiter.check_rates(checks, name)

    assert answer == RateLimiter.check_rates(checks, nif)
    assert message =~ "cost"
  end

  # Public calls with malformed input, each for the limiter it is given.
  defp bad_calls do
    other = %{capacity: 5, refill_per_sec: 1}

    [
      fn n -> RateLimiter.check_rate(:badkey, @limit, 1, n) end,
      fn n -> RateLimiter.check_rate(@key, @limit, -1, n) end,
      fn n -> RateLimiter.check_rate(@key, @limit, :nan, n) end,
      fn n -> RateLimiter.check_rates([{@key, @limit, 1}, {@key, other, 1}], n) end,
      fn n -> RateLimiter.wait_for_capacity(@key, %{requests: 0}, 1, n) end,
      fn n -> RateLimiter.get_cost({"binance", 1}, 0, n) end,
      fn n -> RateLimiter.pause("binance", -1, n) end
    ]
  end

  # Public calls on the limiter `name`, whose store does not answer, in parallel (each
  # waits for its timeout): bad input gets what the NIF limiter `nif` answers, checks
  # without a limit :ok (they need no bucket), other valid input :unavailable.
  defp assert_public_calls(name, nif) do
    other = %{capacity: 5, refill_per_sec: 1}
    bad = bad_calls()

    limitless = [
      fn n -> RateLimiter.check_rate(@key, nil, 1, n) end,
      fn n -> RateLimiter.wait_for_capacity(@key, nil, 1, n) end,
      fn n -> RateLimiter.check_rates([{@key, nil, 1}, {{"b", :public}, nil, 2}], n) end,
      fn n -> RateLimiter.check_rates([], n) end,
      fn n -> RateLimiter.check_rate(@key, nil, -1, n) end,
      fn n -> RateLimiter.check_rates([{@key, nil, 1}, {{"b", 1}, nil, 2}], n) end
    ]

    good = [
      fn n -> RateLimiter.check_rate(@key, @limit, 1, n) end,
      fn n -> RateLimiter.check_rates([{@key, @limit, 1}, {{"b", "k"}, other, 1}], n) end,
      fn n -> RateLimiter.check_rates([{@key, nil, 1}, {{"b", "k"}, other, 1}], n) end
    ]

    answers =
      (bad ++ limitless ++ good)
      |> Enum.map(fn call -> Task.async(fn -> call.(name) end) end)
      |> Task.await_many(30_000)

    {bad_answers, answers} = Enum.split(answers, length(bad))
    {limitless_answers, good_answers} = Enum.split(answers, length(limitless))

    for {call, answer} <- Enum.zip(limitless, limitless_answers) do
      assert answer == call.(nif)
    end

    assert Enum.count(limitless_answers, &(&1 == :ok)) == 4

    for {call, answer} <- Enum.zip(bad, bad_answers) do
      assert {:error, %Error{type: :invalid_parameters}} = want = call.(nif)
      assert answer == want
    end

    for answer <- good_answers, do: assert(unavailable?(answer), inspect(answer))
  end
end
