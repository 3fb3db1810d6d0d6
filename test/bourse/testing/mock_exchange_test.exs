defmodule Bourse.Testing.MockExchangeTest do
  use ExUnit.Case, async: true

  alias Bourse.Testing.{HTTP, MockExchange}

  defp get(mock, headers \\ []), do: HTTP.get(mock.url <> "/api/v3/ping", headers)

  defp header(headers, name), do: headers |> List.keyfind(name, 0, {name, nil}) |> elem(1)

  # Sleeps until shortly after the start of the next window of `window_ms`.
  defp align(window_ms) do
    Process.sleep(window_ms - rem(System.os_time(:millisecond), window_ms) + 20)
  end

  # Runs `attempt` from the start of a window of `window_ms`, with the mock's counts
  # reset, until a run ends in the window it began in (a loaded machine may spill into
  # the next): returns that run's result.
  defp in_one_window(mock, window_ms, attempt, tries \\ 5) do
    align(window_ms)
    :ok = MockExchange.reset_stats(mock)
    window = div(System.os_time(:millisecond), window_ms)
    result = attempt.()

    cond do
      div(System.os_time(:millisecond), window_ms) == window -> result
      tries > 1 -> in_one_window(mock, window_ms, attempt, tries - 1)
      true -> flunk("no attempt ran within one window of #{window_ms} ms")
    end
  end

  describe "fixed_window mode" do
    # The mock is linked to the test process, and stops with it.
    setup tags do
      {:ok, mock} = MockExchange.start(Map.get(tags, :mock, []))
      %{mock: mock}
    end

    test "15 requests at once in one window: 10 pass, 5 get 429 with Retry-After", %{mock: mock} do
      replies =
        in_one_window(mock, 1_000, fn ->
          1..15
          |> Task.async_stream(fn _ -> get(mock) end, max_concurrency: 15, timeout: 30_000)
          |> Enum.map(fn {:ok, {:ok, status, headers, body}} -> {status, headers, body} end)
        end)

      {ok, limited} = Enum.split_with(replies, &(elem(&1, 0) == 200))
      assert length(ok) == 10
      assert Enum.all?(limited, &(elem(&1, 0) == 429))

      assert ok
             |> Enum.map(&String.to_integer(header(elem(&1, 1), "x-used-weight")))
             |> Enum.sort() ==
               Enum.to_list(1..10)

      for {429, headers, body} <- limited do
        assert header(headers, "retry-after") == "1"
        assert header(headers, "x-used-weight") == "10"
        assert header(headers, "x-mbx-used-weight-1m") == "10"
        assert header(headers, "x-ratelimit-limit") == "10"
        assert header(headers, "x-ratelimit-remaining") == "0"
        reset = String.to_float(header(headers, "x-ratelimit-reset"))
        assert reset > 0 and reset <= 1
        assert header(headers, "content-type") == "application/json"
        assert body =~ ~s("code":-1003)
      end

      assert MockExchange.stats(mock) == %{accepted: 10, rejected: 5, served: 15}
      assert :ok = MockExchange.reset_stats(mock)
      assert MockExchange.stats(mock) == %{accepted: 0, rejected: 0, served: 0}
    end

    test "weights, and separate counters per client IP", %{mock: mock} do
      requests = [
        [{"x-weight", "4"}],
        [{"x-weight", "6"}],
        [],
        [{"x-weight", "0"}],
        [{"x-client-ip", "10.0.0.2"}, {"x-weight", "10"}],
        [{"x-client-ip", "10.0.0.2"}],
        [{"x-weight", "-1"}],
        [{"x-weight", "heavy"}]
      ]

      replies = in_one_window(mock, 1_000, fn -> Enum.map(requests, &get(mock, &1)) end)

      assert [
               {:ok, 200, four, ~s({"ok":true,"usedWeight":4})},
               {:ok, 200, ten, _},
               {:ok, 429, _, _},
               {:ok, 200, _, _},
               {:ok, 200, other_ip, _},
               {:ok, 429, _, _},
               {:ok, 400, _, _},
               {:ok, 400, _, _}
             ] = replies

      assert header(four, "x-mbx-used-weight-1m") == "4"
      assert header(ten, "x-used-weight") == "10"
      assert header(other_ip, "x-used-weight") == "10"
      assert MockExchange.stats(mock) == %{accepted: 4, rejected: 2, served: 6}
    end

    @tag mock: [limit: 2, window_ms: 1_000]
    test "a new window starts a new count", %{mock: mock} do
      replies = in_one_window(mock, 1_000, fn -> [get(mock, [{"x-weight", "2"}]), get(mock)] end)
      assert [{:ok, 200, _, _}, {:ok, 429, headers, _}] = replies
      assert header(headers, "retry-after") == "1"
      align(1_000)
      assert {:ok, 200, headers, _} = get(mock)
      assert header(headers, "x-used-weight") == "1"
    end
  end

  describe "rolling_window mode" do
    test "any window of window_ms holds at most limit; refusals are not counted" do
      # A window long enough that the first three calls fall in it on a loaded machine too
      # (with 600 ms the first once aged out before the third).
      {:ok, mock} = MockExchange.start(mode: :rolling_window, limit: 3, window_ms: 2_000)
      assert {:ok, 200, _, _} = get(mock, [{"x-weight", "2"}])
      assert {:ok, 200, _, _} = get(mock)
      assert {:ok, 429, headers, _} = get(mock)
      # Until the first call leaves the window, in whole seconds (1 on a slow machine).
      assert header(headers, "retry-after") in ["1", "2"]
      assert header(headers, "x-used-weight") == nil
      # Not aligned to the clock: 2 s after the first request, not at a boundary.
      Process.sleep(2_050)
      assert {:ok, 200, _, _} = get(mock, [{"x-weight", "3"}])
      assert {:ok, 429, _, _} = get(mock, [{"x-client-ip", "10.0.0.9"}, {"x-weight", "4"}])
      assert {:ok, 200, _, _} = get(mock, [{"x-client-ip", "10.0.0.9"}, {"x-weight", "3"}])
      assert MockExchange.stats(mock) == %{accepted: 4, rejected: 2, served: 6}
    end
  end

  describe "decaying mode" do
    test "a counter per API key, raised by each cost, decaying; Kraken's refusal" do
      {:ok, mock} =
        MockExchange.start(
          mode: :decaying,
          max: 4,
          decay_per_sec: 1,
          client: :api_key,
          reject: :kraken,
          costs: %{"/0/private/Ledgers" => 2}
        )

      key = [{"x-api-key", "a"}]
      ledgers = fn headers -> HTTP.get(mock.url <> "/0/private/Ledgers?ofs=0", headers) end
      assert {:ok, 200, _, ~s({"ok":true,"usedWeight":2})} = ledgers.(key)
      assert {:ok, 200, _, _} = ledgers.(key)
      assert {:ok, 200, _, body} = get(mock, key)
      assert body =~ "EAPI:Rate limit exceeded"
      # Another key has its own counter.
      assert {:ok, 200, _, ~s({"ok":true,"usedWeight":1})} = get(mock, [{"x-api-key", "b"}])
      # 1 a second (the three calls above may take most of a second on a loaded machine):
      # after 1.1 s the first key has room for 1 again.
      Process.sleep(1_100)
      assert {:ok, 200, _, ~s({"ok":true,"usedWeight":) <> _} = get(mock, key)
      assert MockExchange.stats(mock) == %{accepted: 4, rejected: 1, served: 5}
    end
  end

  test "scripted mode replays Fincode's field report's replies in order, then repeats the last" do
    script = [
      {429, [{"Retry-After", "1e400"}], ~s({"code":-1003})},
      {429, [{"Retry-After", "86400"}], "{}"},
      {401, [], ~s({"code":-2015,"msg":"Invalid API-key"})},
      {418, [{"Retry-After", "120"}], "{}"},
      {503, [], "{}"},
      {200, [{"Content-Type", "text/html"}], "<html>maintenance</html>"}
    ]

    {:ok, mock} = MockExchange.start(script: script)

    for {status, headers, body} <- script do
      assert {:ok, ^status, reply_headers, ^body} = get(mock)

      for {name, value} <- headers,
          do: assert(header(reply_headers, String.downcase(name)) == value)
    end

    assert {:ok, 200, headers, "<html>maintenance</html>"} = get(mock)
    assert header(headers, "content-type") == "text/html"
    assert MockExchange.stats(mock) == %{accepted: 2, rejected: 2, served: 7}
    MockExchange.stop(mock)
  end

  test "stop/1 closes the port, and the server stops with the process that started it" do
    {:ok, mock} = MockExchange.start()
    assert :ok = MockExchange.stop(mock)
    assert {:error, _} = get(mock)

    owner = self()

    {pid, ref} =
      spawn_monitor(fn ->
        {:ok, mock} = MockExchange.start()
        send(owner, {:mock, mock})
      end)

    assert_receive {:mock, mock}
    assert_receive {:DOWN, ^ref, :process, ^pid, :normal}
    ref = Process.monitor(mock.pid)
    assert_receive {:DOWN, ^ref, :process, _, _}
    assert {:error, _} = get(mock)
  end

  test "bad options raise" do
    assert_raise ArgumentError, fn -> MockExchange.start(limit: 0) end
    assert_raise ArgumentError, fn -> MockExchange.start(script: []) end
  end

  test "HTTP.get/2 reports connection errors" do
    assert {:error, _} = HTTP.get("http://127.0.0.1:1/")
  end
end
