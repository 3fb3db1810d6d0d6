defmodule Bourse.RateLimiter.ExchangeRepliesTest do
  # The field report's scripted replies (docs/CONTRACT.md, Sources), through
  # Bourse.Testing.AdapterLoop: wait_for_capacity, an HTTP GET to a scripted mock
  # exchange, observe_response, then retry or return.
  use ExUnit.Case, async: true

  alias Bourse.Error
  alias Bourse.Testing.{AdapterLoop, MockExchange}

  @limit %{capacity: 2, refill_per_sec: 7}
  @data ~s({"symbol":"BTCUSDT"})

  setup do
    name = :"replies_#{System.unique_integer([:positive])}"
    start_supervised!({Bourse.RateLimiter, name: name})
    %{name: name}
  end

  # Runs the loop against a mock playing `script`: {elapsed ms, answer, replies served}.
  defp run(script, name, exchange \\ "mock") do
    {:ok, mock} = MockExchange.start(script: script)
    started = System.monotonic_time(:millisecond)
    url = mock.url <> "/api/v3/ticker"
    answer = AdapterLoop.get(url, exchange, "k", @limit, limiter: name)
    elapsed = System.monotonic_time(:millisecond) - started
    %{served: served} = MockExchange.stats(mock)
    MockExchange.stop(mock)
    {elapsed, answer, served}
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
    # A retry would have drawn the 200 that follows.
    cases = [
      {{401, [], ~s({"code":-2015,"msg":"Invalid API-key"})},
       &match?({:error, {:http, 401, "{" <> _}}, &1)},
      {{418, [{"retry-after", "120"}], ~s({"code":-1003})},
       &match?({:error, %Error{http_status: 418, stop: true}}, &1)},
      {{503, [], "Service Unavailable"}, &match?({:error, {:http, 503, _}}, &1)},
      {{200, [{"content-type", "text/html"}], "<html>maintenance</html>"},
       &match?({:error, {:not_json, 200}}, &1)}
    ]

    for {{status, _, _} = reply, expected?} <- cases do
      {_elapsed, answer, requests} = run([reply, ok()], name, "mock#{status}")
      assert expected?.(answer), "#{status}: #{inspect(answer)}"
      assert requests == 1, "#{status}: #{requests} requests"
    end
  end

  describe "rate-limit signals in the body" do
    # Each exchange's signal, then the data: the loop waits (1 s floor, or the wait the
    # reply names) and retries once; bans stop at once.
    test "are answered like a 429: one retry after the wait, then the data", %{name: name} do
      now = System.os_time(:millisecond)

      [
        {"binance", {429, [], ~s({"code":-1003,"msg":"Too much request weight used"})}, 950},
        {"binance", {400, [], ~s({"code":-1015,"msg":"Too many new orders"})}, 950},
        {"bybit", {200, [], ~s({"retCode":10006,"retMsg":"Too many visits!","result":{}})}, 950},
        {"bybit",
         {200, [{"x-bapi-limit-reset-timestamp", "#{now + 2000}"}], ~s({"retCode":10006})},
         {:since_now, 1_500}},
        {"bybit", {200, [], ~s({"retCode":10018,"retMsg":"Exceeded the IP Rate Limit."})}, 950},
        {"okx", {429, [], ~s({"code":"50011","data":[],"msg":"Rate limit reached."})}, 950},
        {"okx", {200, [], ~s({"code":"50061","data":[],"msg":""})}, 950},
        {"kraken", {200, [], ~s({"error":["EAPI:Rate limit exceeded"],"result":{}})}, 950},
        {"kraken", {200, [], ~s({"error":["EOrder:Rate limit exceeded"]})}, 950},
        {"kraken", {200, [], ~s({"error":["EService: Throttled: #{div(now, 1000) + 3}"]})},
         {:since_now, 1_500}},
        {"coinbase",
         {429, [], ~s({"errors":[{"id":"rate_limit_exceeded","message":"Too many requests"}]})},
         950},
        {"coinbase", {200, [], ~s({"error":"rate_limit_exceeded","message":"slow down"})}, 950}
      ]
      |> Enum.with_index()
      |> Task.async_stream(
        fn {{exchange, reply, at_least_ms}, i} ->
          outcome = run([reply, ok()], name, "#{exchange}_#{i}")
          {outcome, System.os_time(:millisecond), exchange, reply, at_least_ms}
        end,
        max_concurrency: 12,
        timeout: 30_000
      )
      |> Enum.each(fn {:ok, {{elapsed, answer, requests}, finished, exchange, reply, at_least}} ->
        label = "#{exchange} #{inspect(reply)}"
        assert answer == {:ok, @data}, "#{label}: #{inspect(answer)}"
        assert requests == 2, label

        # A wait until an instant the reply names counts from when the replies were written
        # (a row may start late, behind the others), a relative one from the row's start.
        case at_least do
          {:since_now, ms} -> assert finished - now >= ms, "#{label}: #{finished - now} ms"
          ms -> assert elapsed >= ms, "#{label}: #{elapsed} ms"
        end
      end)
    end

    test "bans and Binance's 403 stop at once, without a retry", %{name: name} do
      banned =
        "Way too much request weight used; IP banned until #{System.os_time(:millisecond) + 120_000}."

      for {exchange, reply} <- [
            {"binance", {403, [{"content-type", "text/html"}], "<html>403 Forbidden</html>"}},
            {"binance", {418, [], ~s({"code":-1003,"msg":"#{banned}"})}},
            {"bybit", {403, [], "access too frequent"}},
            {"bybit", {200, [], ~s({"retCode":10009,"retMsg":"IP has been banned."})}}
          ] do
        {_elapsed, answer, requests} = run([reply, ok()], name, "#{exchange}_stop")
        assert {:error, %Error{type: :rate_limit_exceeded, stop: true}} = answer
        assert requests == 1, "#{exchange}: #{requests}"
        :ok = Bourse.RateLimiter.reset_exchange("#{exchange}_stop", name)
      end
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
