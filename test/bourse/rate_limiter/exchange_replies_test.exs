defmodule Bourse.RateLimiter.ExchangeRepliesTest do
  # The seed report's scripted replies, through Bourse.AdapterLoop: wait_for_capacity,
  # an HTTP GET to a scripted mock exchange, observe_response, then retry or return.
  use ExUnit.Case, async: true

  alias Bourse.{AdapterLoop, Error}
  alias Bourse.Testing.MockExchange

  @limit %{capacity: 2, refill_per_sec: 7}
  @data ~s({"symbol":"BTCUSDT"})

  setup do
    name = :"replies_#{System.unique_integer([:positive])}"
    start_supervised!({Bourse.RateLimiter, name: name})
    %{name: name}
  end

  # Runs the loop against a mock playing `script`:
  # {elapsed ms, answer, 200 and 429 replies served}.
  defp run(script, name, exchange \\ "mock") do
    {:ok, mock} = MockExchange.start(script: script)
    started = System.monotonic_time(:millisecond)
    url = mock.url <> "/api/v3/ticker"
    answer = AdapterLoop.get(url, exchange, "k", @limit, limiter: name)
    elapsed = System.monotonic_time(:millisecond) - started
    %{accepted: accepted, rejected: rejected} = MockExchange.stats(mock)
    MockExchange.stop(mock)
    {elapsed, answer, accepted + rejected}
  end

  defp limited(retry_after), do: {429, [{"retry-after", retry_after}], ~s({"code":-1003})}
  defp ok, do: {200, [], @data}

  test "Retry-After: 1e400 is rejected; a 1 s backoff, then the data", %{name: name} do
    {elapsed, answer, requests} = run([limited("1e400"), ok()], name)
    assert answer == {:ok, @data}
    assert requests == 2
    assert elapsed >= 950
  end

  test "Retry-After 1e-400, -5 and a past date get the 1 s floor", %{name: name} do
    past = "Wed, 21 Oct 2015 07:28:00 -0000"

    # One exchange each, on one limiter, at the same time.
    ["1e-400", "-5", past]
    |> Task.async_stream(fn value -> run([limited(value), ok()], name, "mock #{value}") end,
      max_concurrency: 3,
      timeout: 30_000
    )
    |> Enum.each(fn {:ok, {elapsed, answer, requests}} ->
      assert answer == {:ok, @data}
      assert requests == 2
      assert elapsed >= 950
    end)
  end

  test "Retry-After: 86400 stops at once, with stop: true", %{name: name} do
    {_elapsed, answer, requests} = run([limited("86400"), ok()], name)

    assert {:error, %Error{http_status: 429, retry_after: 86_400_000, stop: true}} = answer
    assert requests == 1
  end

  test "429 four times with Retry-After: 1 gives up after 3 s of waiting", %{name: name} do
    {elapsed, answer, requests} = run([limited("1")], name)

    assert {:error, %Error{http_status: 429, retry_after: 1000, stop: false}} = answer
    assert requests == 4
    assert elapsed >= 2_900
  end

  @tag :slow
  test "429 four times without Retry-After: 1 + 2 + 4 = 7 s of backoff, then it gives up",
       %{name: name} do
    {elapsed, answer, requests} = run([{429, [], ~s({"code":-1003})}], name)

    # The fourth 429 asks for 8 s more: the loop stops there.
    assert {:error, %Error{http_status: 429, retry_after: 8000, stop: false}} = answer
    assert requests == 4
    assert elapsed >= 6_900
  end

  test "401, 418, 503 and HTML with 200 stop the loop without a retry", %{name: name} do
    # The mock counts 200s and 429s: a retry would have drawn the 200 that follows.
    cases = [
      {{401, [], ~s({"code":-2015,"msg":"Invalid API-key"})}, 0,
       &match?({:error, {:http, 401, "{" <> _}}, &1)},
      {{418, [{"retry-after", "120"}], ~s({"code":-1003})}, 0,
       &match?({:error, %Error{http_status: 418, stop: true}}, &1)},
      {{503, [], "Service Unavailable"}, 0, &match?({:error, {:http, 503, _}}, &1)},
      {{200, [{"content-type", "text/html"}], "<html>maintenance</html>"}, 1,
       &match?({:error, {:not_json, 200}}, &1)}
    ]

    for {{status, _, _} = reply, counted, expected?} <- cases do
      {_elapsed, answer, requests} = run([reply, ok()], name, "mock#{status}")
      assert expected?.(answer), "#{status}: #{inspect(answer)}"
      assert requests == counted, "#{status}: #{requests} requests"
    end
  end

  test "connection refused reaches the caller", %{name: name} do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :ok = :gen_tcp.close(socket)

    assert {:error, {:failed_connect, _}} =
             AdapterLoop.get("http://127.0.0.1:#{port}/", "mock", "k", @limit, limiter: name)
  end
end
