defmodule Bourse.RateLimiter.Backend.SlowStoreTest do
  # A daemon whose answers come late, but each within the timeout (a slow network, a busy
  # Redis): a call made of several requests answers within one timeout, not one per request;
  # the user's code it calls (an event callback) keeps its own calls' timeouts.
  use ExUnit.Case, async: true

  import Bourse.BackendCase, only: [start_daemon: 1, start_limiter: 1]

  alias Bourse.RateLimiter

  @timeout_ms 500
  @delay_ms 300
  @limits %{capacity: 6_000, refill_per_sec: 100}

  test "observe_response with three used-weight headers answers within one timeout" do
    daemon = start_daemon(["--listen", "127.0.0.1:0"])
    [host, port] = String.split(daemon.tcp, ":")
    delay = :atomics.new(1, [])
    relay = delaying_relay(String.to_integer(port), delay)
    {:ok, address} = :inet.parse_address(String.to_charlist(host))
    name = start_limiter({:daemon, {address, relay}, timeout: @timeout_ms})

    for axis <- ["ip", "sapi_ip", "sapi_uid"],
        do: assert(:ok = RateLimiter.check_rate({"binance", "k", axis}, @limits, 1, name))

    :atomics.put(delay, 1, @delay_ms)

    headers = [
      {"x-mbx-used-weight-1m", "100"},
      {"x-sapi-used-ip-weight-1m", "100"},
      {"x-sapi-used-uid-weight-1m", "100"}
    ]

    # A read and a sync per header, each 300 ms late: 1.8 s before, one timeout now.
    {took_us, answer} =
      :timer.tc(fn -> RateLimiter.observe_response("binance", "k", 200, headers, name) end)

    assert answer == :ok or match?({:error, %Bourse.Error{type: :unavailable}}, answer)
    assert div(took_us, 1000) < @timeout_ms + 600, "answered after #{div(took_us, 1000)} ms"
  end

  test "an event callback's calls during observe_response wait their own timeouts" do
    test = self()

    # Called on the 429 below, after the limiter's shared timeout has passed.
    on_event = fn event, _measurements, _metadata ->
      if List.last(event) == :rate_limited do
        Process.sleep(@timeout_ms + 100)
        own = RateLimiter.check_rate({"elsewhere", "k"}, @limits, 1, :slow_store_a)
        other = RateLimiter.check_rate({"other", "k"}, @limits, 1, :slow_store_b)
        send(test, {:callback, own, other})
      end
    end

    for {name, opts} <- [slow_store_a: [on_event: on_event], slow_store_b: []] do
      daemon = start_daemon(["--listen", "127.0.0.1:0"])
      backend = {:daemon, daemon.tcp, timeout: @timeout_ms}
      start_supervised!({RateLimiter, [name: name, backend: backend] ++ opts}, id: name)
    end

    assert :ok = RateLimiter.check_rate({"binance", "k"}, @limits, 1, :slow_store_a)
    headers = [{"retry-after", "1"}]

    assert {:error, %Bourse.Error{type: :rate_limit_exceeded}} =
             RateLimiter.observe_response("binance", "k", 429, headers, :slow_store_a)

    assert_receive {:callback, :ok, :ok}, 5_000
  end

  # A TCP relay to `port` that passes requests on at once and each chunk of answers as
  # many ms late as `delay` holds; returns its own port.
  defp delaying_relay(port, delay) do
    {:ok, listener} = :gen_tcp.listen(0, [:binary, active: false, ip: {127, 0, 0, 1}])
    {:ok, relay_port} = :inet.port(listener)
    spawn_link(fn -> accept(listener, port, delay) end)
    relay_port
  end

  defp accept(listener, port, delay) do
    {:ok, client} = :gen_tcp.accept(listener)
    {:ok, daemon} = :gen_tcp.connect({127, 0, 0, 1}, port, [:binary, active: false])
    spawn_link(fn -> pump(client, daemon, nil) end)
    spawn_link(fn -> pump(daemon, client, delay) end)
    accept(listener, port, delay)
  end

  defp pump(from, to, delay) do
    case :gen_tcp.recv(from, 0) do
      {:ok, data} ->
        if delay, do: Process.sleep(:atomics.get(delay, 1))
        :gen_tcp.send(to, data)
        pump(from, to, delay)

      {:error, _closed} ->
        :gen_tcp.close(to)
    end
  end
end
