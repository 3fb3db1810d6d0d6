defmodule Bourse.RateLimiter.FeedbackTest do
  # observe_response/5 through the public API, with the default header-to-axis table
  # (tests that change it are in FeedbackConfigTest, which does not run concurrently).
  use ExUnit.Case, async: true

  alias Bourse.{Error, RateLimiter}

  @binance %{capacity: 480, refill_per_sec: 72}
  @slow %{capacity: 5, refill_per_sec: 1}

  setup do
    name = :"feedback_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name})
    %{name: name}
  end

  defp observe(status, headers, name, credential \\ "k"),
    do: RateLimiter.observe_response("binance", credential, status, headers, name)

  defp tokens(key, name), do: RateLimiter.inspect_key(key, name).tokens

  # The tokens of `key`, `expected` when its allowance was set (not before `set_at`,
  # monotonic ms), read later: up to what `refill_per_sec` added since then (a loaded machine
  # may be slow between the two).
  defp assert_tokens_since(key, name, expected, refill_per_sec, set_at) do
    tokens = tokens(key, name)
    refilled = refill_per_sec * (System.monotonic_time(:millisecond) - set_at) / 1000

    assert tokens >= expected - 0.2 and tokens <= expected + refilled + 0.2,
           "#{tokens} tokens, expected #{expected} (+ up to #{refilled} refilled since)"
  end

  defp window_left(window_ms), do: Bourse.Window.left(window_ms)
  defp clear_of_window_edges(window_ms), do: Bourse.Window.clear_of_edges(window_ms)

  defp bybit_headers(limit, remaining, reset_ms) do
    [
      {"X-Bapi-Limit", "#{limit}"},
      {"X-Bapi-Limit-Status", "#{remaining}"},
      {"X-Bapi-Limit-Reset-Timestamp", "#{reset_ms}"}
    ]
  end

  defp assert_invalid(answer),
    do: assert({:error, %Error{type: :invalid_parameters, message: "" <> _}} = answer)

  defp assert_paused(key, name, range) do
    assert {:delay, ms} = RateLimiter.check_rate(key, @slow, 1, name)
    assert ms in range, "#{inspect(key)} paused for #{ms} ms, expected #{inspect(range)}"
    ms
  end

  describe "used-weight headers" do
    test "x-mbx-used-weight-1m: what the bucket may admit until the minute ends fits B - used",
         %{name: name} do
      key = {"binance", "k", "ip"}
      clear_of_window_edges(60_000)
      assert :ok = RateLimiter.check_rate(key, @binance, 1, name)
      # B = 480 + 72 * 60 = 4800 per minute: 1200 more may go before the minute ends.
      assert :ok = observe(200, [{"x-mbx-used-weight-1m", "3600"}], name)
      left = window_left(60_000)
      assert_in_delta tokens(key, name), min(479, 1200 - 72 * left / 1000), 72 * 0.2
    end

    test "a bucket sized at the exchange's limit is held to that limit (6,000 a minute)",
         %{name: name} do
      key = {"binance", "k", "ip"}
      # B = 6000 + 100 * 60 = 12,000 a minute; Binance spot admits 6,000.
      clear_of_window_edges(60_000)
      assert :ok = RateLimiter.check_rate(key, %{requests: 6000, period: 60_000}, 1, name)
      assert :ok = observe(200, [{"X-MBX-USED-WEIGHT-1M", "5900"}], name)
      # 100 more until the minute ends, 100 a second of it from the refill.
      left = window_left(60_000)
      assert_in_delta tokens(key, name), min(5999, 100 - 100 * left / 1000), 100 * 0.2

      # Another exchange id with its own limit set (as exchangeInfo does): 2,400.
      exchange = "binance_usdm_#{System.unique_integer([:positive])}"
      key = {exchange, "k", "ip"}

      :ok =
        Bourse.RateLimiter.Feedback.put_header_limits(exchange, %{"X-MBX-USED-WEIGHT-1M" => 2400})

      clear_of_window_edges(60_000)
      assert :ok = RateLimiter.check_rate(key, %{requests: 2400, period: 60_000}, 1, name)

      assert :ok =
               RateLimiter.observe_response(
                 exchange,
                 "k",
                 200,
                 [{"x-mbx-used-weight-1m", "2300"}],
                 name
               )

      left = window_left(60_000)
      assert_in_delta tokens(key, name), min(2399, 100 - 40 * left / 1000), 40 * 0.2
    end

    test "put_header_limits/2 takes an exchange id by the rule of every call" do
      limits = %{"x-mbx-used-weight-1m" => 2400}

      for exchange <- [<<255, 0>>, String.duplicate("e", 1025)] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 Bourse.RateLimiter.Feedback.put_header_limits(exchange, limits)

        assert message =~ "exchange_id"
        refute :persistent_term.get({Bourse.RateLimiter.Feedback, :header_limits, exchange}, nil)
      end

      # A limit past the core's bound is refused by that bound.
      assert {:error, %Error{type: :invalid_parameters, message: message}} =
               Bourse.RateLimiter.Feedback.put_header_limits("ex", %{"x" => 2.0e12})

      assert message =~ "at most #{Bourse.Native.bound(:max_amount)}"
    end

    test "limits: the adapter's definitions, read from no table: the same allowance",
         %{name: name} do
      {:ok, buckets} = Bourse.RateLimiter.Exchange.buckets(:binance_spot)

      for {credential, opts} <- [{"read", []}, {"given", [limits: buckets]}] do
        key = {"binance", credential, "ip"}
        clear_of_window_edges(60_000)
        assert :ok = RateLimiter.check_rate(key, buckets["ip"], 1, name)
        headers = [{"x-mbx-used-weight-1m", "3600"}]
        assert :ok = RateLimiter.observe_response("binance", credential, 200, headers, name, opts)
        left = window_left(60_000)
        assert_in_delta tokens(key, name), min(479, 1200 - 72 * left / 1000), 72 * 0.2
      end

      # A key the table holds no definition for is still left alone.
      assert :ok =
               RateLimiter.observe_response(
                 "binance",
                 "none",
                 200,
                 [{"x-mbx-used-weight-1m", "9"}],
                 name,
                 limits: buckets
               )

      assert RateLimiter.inspect_key({"binance", "none", "ip"}, name) == nil

      for bad <- [
            [limits: %{"ip" => %{capacity: -1, refill_per_sec: 1}}],
            [limits: []],
            [limits: %{ip: %{capacity: 1, refill_per_sec: 1}}],
            [limits: %{"ip" => %{requests: 0}}],
            [limits: %{"ip" => %{capacity: 1}}]
          ] do
        assert_invalid(RateLimiter.observe_response("binance", "k", 200, [], name, bad))
      end
    end

    test "limits: any form a check takes, read as its capacity and refill", %{name: name} do
      # 10 + 10/s: 610 per minute.
      for {credential, limit} <- [
            {"map", %{capacity: 10, refill_per_sec: 10}},
            {"period", %{requests: 10, period: 1_000}},
            {"per_second", %{requests: 10}}
          ] do
        key = {"binance", credential, "ip"}
        clear_of_window_edges(60_000)
        assert :ok = RateLimiter.check_rate(key, limit, 1, name)
        headers = [{"x-mbx-used-weight-1m", "600"}]
        opts = [limits: %{"ip" => limit}]
        assert :ok = RateLimiter.observe_response("binance", credential, 200, headers, name, opts)
        left = window_left(60_000)
        assert_in_delta tokens(key, name), min(9, 10 - 10 * left / 1000), 10 * 0.2
      end
    end

    test "alone on the counter, the bucket is not lowered; tokens are never raised",
         %{name: name} do
      key = {"binance", "k", "ip"}
      assert :ok = RateLimiter.check_rate(key, @binance, 100, name)
      before = tokens(key, name)
      # 100 spent by this bucket, all the exchange saw: nothing to take.
      assert :ok = observe(200, [{"x-mbx-used-weight-1m", "100"}], name)
      assert_in_delta tokens(key, name), before, 72 * 0.2

      RateLimiter.record_request(key, 400, name)
      drained = tokens(key, name)
      assert :ok = observe(200, [{"x-mbx-used-weight-1m", "0"}], name)
      assert tokens(key, name) < drained + 72 * 0.2
    end

    test "names are case-insensitive; values may be charlists, integers, lists; maps of values",
         %{name: name} do
      cases = [
        {[{~c"X-MBX-USED-WEIGHT-1M", ~c"9999999"}], "ip"},
        # A count of more digits than any exchange sends holds the bucket all the same.
        {[{"x-mbx-used-weight-1m", String.duplicate("9", 40)}], "ip"},
        {[{"x-mbx-used-weight-1m", 9_999_999}], "ip"},
        {%{"X-Sapi-Used-Ip-Weight-1m" => ["9999999", "0"]}, "sapi_ip"},
        {%{"x-sapi-used-uid-weight-1m" => ~c" 9999999 "}, "sapi_uid"},
        {[{"x-mbx-order-count-10s", "9999999"}], "orders_10s"},
        {[{"x-mbx-order-count-1d", "9999999"}], "orders_1d"}
      ]

      for {{headers, axis}, i} <- Enum.with_index(cases) do
        key = {"binance", "k#{i}", axis}
        Bourse.Window.clear_of_edges([60_000, 10_000, 86_400_000])
        assert :ok = RateLimiter.check_rate(key, @binance, 1, name)
        assert :ok = observe(200, headers, name, "k#{i}")
        # At or above B nothing more may go before the window ends.
        assert tokens(key, name) <= 0, "#{axis}: #{tokens(key, name)}"
      end
    end

    test "x-mbx-used-weight without an interval, unknown keys and garbage are ignored",
         %{name: name} do
      key = {"binance", "k", "ip"}
      assert :ok = RateLimiter.check_rate(key, @binance, 1, name)
      before = tokens(key, name)

      for value <- ["-5", "1e400", "nan", "", "12abc", String.duplicate("9", 40) <> "x"] do
        assert :ok = observe(200, [{"x-mbx-used-weight-1m", value}], name)
      end

      assert :ok = observe(200, [{"x-mbx-used-weight", "6000"}], name)
      assert tokens(key, name) >= before

      # No definition for the axis: left alone, nothing created.
      assert :ok = observe(200, [{"x-mbx-used-weight-1m", "6000"}], name, "other")
      assert RateLimiter.inspect_key({"binance", "other", "ip"}, name) == nil
    end

    test "Bybit: limit and remaining, with a 1 s window; reset timestamp in ms", %{name: name} do
      key = {"binance", "k", "request"}
      limit = %{capacity: 5, refill_per_sec: 5}
      assert :ok = RateLimiter.check_rate(key, limit, 1, name)
      now = System.os_time(:millisecond)

      # Not limited: the reset timestamp is now, so the allowance holds now.
      # B = min(5 + 5 * 1, 10) = 10; used = 10 - 7 = 3: 7 tokens (capped at 5) stay.
      headers = bybit_headers(10, 7, now)

      assert :ok = observe(200, headers, name)
      assert tokens(key, name) > 3.9

      # 2 remaining: 2 tokens.
      headers = List.keyreplace(headers, "X-Bapi-Limit-Status", 0, {"x-bapi-limit-status", "2"})
      set_at = System.monotonic_time(:millisecond)
      assert :ok = observe(200, headers, name)
      assert_tokens_since(key, name, 2, limit.refill_per_sec, set_at)

      # Limited for 400 ms more, nothing remaining: 0 left at the reset, so -2 tokens now.
      set_at = System.monotonic_time(:millisecond)

      headers = [
        {"x-bapi-limit", "10"},
        {"x-bapi-limit-status", "0"},
        {"x-bapi-limit-reset-timestamp", "#{System.os_time(:millisecond) + 400}"}
      ]

      assert :ok = observe(200, headers, name)
      assert_tokens_since(key, name, -2, limit.refill_per_sec, set_at)
    end

    test "keys sharing an IP, ip: :public: the IP's counters sync its one bucket, a key's own its own",
         %{name: name} do
      ip = {"binance", :public, "ip"}
      orders = %{capacity: 10, refill_per_sec: 0.001}
      checks = fn key -> [{ip, @binance, 10}, {{"binance", key, "orders_10s"}, orders, 1}] end
      Bourse.Window.clear_of_edges([60_000, 10_000])
      for key <- ["key-a", "key-b"], do: assert(:ok = RateLimiter.check_rates(checks.(key), name))

      # B = 4800 per minute; the IP used 4000 of it: 800 more until the minute ends.
      # The account of key-a placed 9 of its 10 orders in the 10 s window.
      headers = [{"x-mbx-used-weight-1m", "4000"}, {"x-mbx-order-count-10s", "9"}]
      opts = [ip: :public, limits: %{"orders_10s" => orders}]
      assert :ok = RateLimiter.observe_response("binance", "key-a", 200, headers, name, opts)
      left = window_left(60_000)
      assert_in_delta tokens(ip, name), min(460, 800 - 72 * left / 1000), 72 * 0.2
      assert tokens({"binance", "key-a", "orders_10s"}, name) < 1.01
      assert tokens({"binance", "key-b", "orders_10s"}, name) > 8.9
      assert RateLimiter.inspect_key({"binance", "key-a", "ip"}, name) == nil

      # An account's order limit holds that key alone; the IP's limit, every key.
      assert :ok = RateLimiter.reset(ip, name)
      body = ~s({"code":-1015,"msg":"Too many new orders."})
      opts = [ip: :public, body: body]
      assert {:error, _} = RateLimiter.observe_response("binance", "key-a", 429, [], name, opts)
      assert {:delay, _} = RateLimiter.check_rates(checks.("key-a"), name)
      assert :ok = RateLimiter.check_rates(checks.("key-b"), name)
      body = ~s({"code":-1003,"msg":"Too much request weight used."})
      opts = [ip: :public, body: body]
      assert {:error, _} = RateLimiter.observe_response("binance", "key-a", 429, [], name, opts)
      assert {:delay, _} = RateLimiter.check_rates(checks.("key-b"), name)

      # A limit that may be the key's or the IP's (OKX's 50011, Coinbase's
      # rate_limit_exceeded): the IP's buckets are held with the key's.
      for {exchange, body} <- [
            {"okx", ~s({"code":"50011","msg":"Rate limit reached."})},
            {"coinbase", ~s({"errors":[{"id":"rate_limit_exceeded"}]})}
          ] do
        opts = [ip: :public, body: body]
        assert {:error, _} = RateLimiter.observe_response(exchange, "key-a", 200, [], name, opts)
        assert {:delay, _} = RateLimiter.check_rate({exchange, :public, "ip"}, @binance, 1, name)
        assert {:delay, _} = RateLimiter.check_rate({exchange, "key-a", "ip"}, @binance, 1, name)
        assert :ok = RateLimiter.check_rate({exchange, "key-b", "ip"}, @binance, 1, name)
      end

      # A 429 that names no limit (a proxy's page) may be the IP's: it holds the key and the
      # IP's bucket, for Retry-After or for the key's backoff; other keys' own buckets run.
      key_b_orders = {{"binance", "key-b", "orders_10s"}, orders, 1}

      for {headers, wait} <- [{[{"retry-after", "30"}], 30_000}, {[], 1_000}] do
        assert :ok = RateLimiter.reset_exchange("binance", name)
        opts = [ip: :public, body: "<html>429 Too Many Requests</html>"]

        assert {:error, %Error{retry_after: ^wait}} =
                 RateLimiter.observe_response("binance", "key-a", 429, headers, name, opts)

        assert {:delay, ms} = RateLimiter.check_rates([{ip, @binance, 1}], name)
        assert ms in (wait - 200)..wait
        assert {:delay, _} = RateLimiter.check_rates(checks.("key-a"), name)
        assert :ok = RateLimiter.check_rates([key_b_orders], name)
      end

      # Its backoff is the IP's, shared by the keys that pass it: key-b's next one doubles
      # key-a's; a 2xx to either, once that pause ended, starts it again.
      bare_429 = fn key ->
        RateLimiter.observe_response("binance", key, 429, [], name, ip: :public)
      end

      Process.sleep(1_000)
      assert {:error, %Error{retry_after: 2_000}} = bare_429.("key-b")
      Process.sleep(2_000)
      assert :ok = RateLimiter.observe_response("binance", "key-a", 200, [], name, ip: :public)
      assert {:error, %Error{retry_after: 1_000}} = bare_429.("key-b")

      assert_invalid(RateLimiter.observe_response("binance", "key-a", 200, [], name, ip: :other))
    end

    test "axis: the per-endpoint headers sync the bucket of the reply's endpoint", %{name: name} do
      {:ok, %{"order_create" => limit}} = RateLimiter.Exchange.buckets(:bybit_v5)
      key = {"bybit", "k", "order_create"}
      assert :ok = RateLimiter.check_rate(key, limit, 1, name)
      headers = bybit_headers(10, 0, System.os_time(:millisecond))
      set_at = System.monotonic_time(:millisecond)

      assert :ok =
               RateLimiter.observe_response("bybit", "k", 200, headers, name, axis: "order_create")

      # Nothing remains: the bucket holds what refilled since.
      refilled = limit.refill_per_sec * (System.monotonic_time(:millisecond) - set_at) / 1000
      assert tokens(key, name) <= refilled + 0.01
      assert RateLimiter.inspect_key({"bybit", "k", "request"}, name) == nil

      for bad <- [:order_create, 5, String.duplicate("a", 1_025)] do
        assert {:error, %Error{type: :invalid_parameters, message: "axis: " <> _}} =
                 RateLimiter.observe_response("bybit", "k", 200, headers, name, axis: bad)
      end
    end

    test "generic x-ratelimit-*: the window is unknown, so the allowance is the remaining count",
         %{name: name} do
      key = {"binance", "k", "request"}
      limit = %{capacity: 50, refill_per_sec: 10}

      for {reset, expected} <- [
            {"2", 10..10},
            {"2.000", 10..10},
            # Epoch seconds, read when the headers are made: the reset is 1 to 2 s away.
            {:two_seconds_on, 10..20},
            # Epoch ms (before, read as seconds: the bucket was held for a day).
            {:two_seconds_on_ms, 10..20}
          ] do
        assert :ok = RateLimiter.reset(key, name)
        assert :ok = RateLimiter.check_rate(key, limit, 1, name)
        set_at = System.monotonic_time(:millisecond)

        reset =
          case reset do
            :two_seconds_on -> "#{System.os_time(:second) + 2}"
            :two_seconds_on_ms -> "#{System.os_time(:millisecond) + 2000}"
            seconds -> seconds
          end

        headers = [
          {"x-ratelimit-limit", "100"},
          {"x-ratelimit-remaining", "30"},
          {"x-ratelimit-reset", reset}
        ]

        assert :ok = observe(200, headers, name)
        # 30 until the reset, up to 20 of them from the refill, and what refilled since.
        tokens = tokens(key, name)
        refilled = limit.refill_per_sec * (System.monotonic_time(:millisecond) - set_at) / 1000
        assert tokens >= expected.first - 0.3 and tokens <= expected.last + refilled + 0.3, reset
      end

      # Without a reset header the allowance holds now.
      assert :ok = RateLimiter.reset(key, name)
      assert :ok = RateLimiter.check_rate(key, limit, 1, name)
      headers = [{"x-ratelimit-limit", "100"}, {"x-ratelimit-remaining", "20"}]
      set_at = System.monotonic_time(:millisecond)
      assert :ok = observe(200, headers, name)
      assert_tokens_since(key, name, 20, limit.refill_per_sec, set_at)
    end
  end

  describe "Binance spot's default limits" do
    # The only test that reads the warning: it is said once per header in the VM's life,
    # also when many replies are read at once (it was said by 71 of 200).
    test "another exchange id held to them is warned about, once per header", %{name: name} do
      :persistent_term.erase(
        {Bourse.RateLimiter.Feedback, :defaulted, "x-sapi-used-uid-weight-1m"}
      )

      headers = [{"x-sapi-used-uid-weight-1m", "10"}]

      observe = fn ->
        RateLimiter.observe_response("binance_coinm", "API-KEY-1", 200, headers, name)
      end

      log =
        ExUnit.CaptureLog.capture_log(fn ->
          tasks = for _ <- 1..200, do: Task.async(observe)
          assert Enum.all?(Task.await_many(tasks), &(&1 == :ok))
          assert :ok = observe.()
        end)

      assert [_once] = Regex.scan(~r/x-sapi-used-uid-weight-1m is held to Binance spot's/, log)
      assert log =~ "binance_coinm"
      refute log =~ "API-KEY-1"
    end
  end

  describe "KuCoin gw-ratelimit-*" do
    test "sync the allowance to what remains, and a 429 waits for the reset they name",
         %{name: name} do
      key = {"kucoin", "k", "request"}
      limit = %{capacity: 320, refill_per_sec: 10}
      assert :ok = RateLimiter.check_rate(key, limit, 1, name)
      set_at = System.monotonic_time(:millisecond)

      headers = [
        {"gw-ratelimit-limit", "4000"},
        {"gw-ratelimit-remaining", "5"},
        {"gw-ratelimit-reset", "12000"}
      ]

      assert :ok = RateLimiter.observe_response("kucoin", "k", 200, headers, name)
      # 5 more until the reset in 12 s: the refill until then is taken off now.
      assert_tokens_since(key, name, 5 - 12 * limit.refill_per_sec, limit.refill_per_sec, set_at)

      body = ~s({"code":"429000","msg":"Too Many Requests"})

      assert {:error, %Error{type: :rate_limit_exceeded, retry_after: 12_000, stop: false}} =
               RateLimiter.observe_response("kucoin", "k", 429, headers, name, body: body)

      # Every axis of the credential.
      assert_paused({"kucoin", "k", "other"}, name, 11_000..12_000)
    end

    test "a 429 with a reset header in the past, or none, backs off from 1 s", %{name: name} do
      past = "#{System.os_time(:second) - 5}"

      for {headers, i} <-
            Enum.with_index([[{"x-ratelimit-reset", past}], [{"gw-ratelimit-reset", "0"}], []]) do
        assert {:error, %Error{retry_after: 1000}} =
                 RateLimiter.observe_response("kucoin", "k-#{i}", 429, headers, name)
      end
    end

    test "a reset header sets the wait of a 429 only, within its family's window when known",
         %{name: name} do
      # A 418 without Retry-After is a ban of the shortest length, not the reset's second.
      assert {:error, %Error{retry_after: 120_000, stop: true}} =
               observe(418, [{"x-ratelimit-reset", "1"}], name, "banned")

      # Bybit's window is a second: a reset timestamp 2 minutes on waits that second.
      reset = "#{System.os_time(:millisecond) + 120_000}"

      assert {:error, %Error{retry_after: 1000, stop: false, message: message}} =
               RateLimiter.observe_response(
                 "bybit",
                 "k",
                 429,
                 [{"x-bapi-limit-reset-timestamp", reset}],
                 name
               )

      assert message =~ "the reply asks to wait 1000 ms"
    end

    test "a 429 with an x-ratelimit-reset in epoch ms waits until then", %{name: name} do
      reset = "#{System.os_time(:millisecond) + 4000}"

      assert {:error, %Error{retry_after: ms}} =
               observe(429, [{"x-ratelimit-reset", reset}], name)

      assert ms in 3000..4000
      assert_paused({"binance", "k", "a"}, name, 2000..4000)
    end
  end

  describe "429 and 418" do
    test "with the table's pauses of credentials all in use, a 429 pauses the exchange",
         %{name: name} do
      for i <- 1..Bourse.Native.bound(:max_pauses),
          do: :ok = RateLimiter.pause({"binance", "held-#{i}"}, 60_000, name)

      assert {:error, %Error{type: :rate_limit_exceeded}} =
               observe(429, [{"Retry-After", "5"}], name, "new")

      assert_paused({"binance", "new", "a"}, name, 4_000..5_000)
      assert_paused({"binance", "another", "a"}, name, 4_000..5_000)
      assert :ok = RateLimiter.check_rate({"okx", "new", "a"}, @slow, 1, name)
    end

    test "with the table's pauses of exchanges all in use, a 418 pauses every exchange",
         %{name: name} do
      for i <- 1..Bourse.Native.bound(:max_pauses),
          do: :ok = RateLimiter.pause("held-#{i}", 60_000, name)

      assert {:error, %Error{type: :rate_limit_exceeded, stop: true, retry_after: 120_000}} =
               observe(418, [{"Retry-After", "120"}], name)

      assert_paused({"binance", "k", "a"}, name, 119_000..120_000)
      assert_paused({"okx", "other", "a"}, name, 119_000..120_000)
    end

    test "a 429 pauses every axis of the credential, for every caller, per Retry-After",
         %{name: name} do
      assert {:error, %Error{} = error} = observe(429, [{"Retry-After", "2"}], name)

      assert %Error{
               type: :rate_limit_exceeded,
               http_status: 429,
               retry_after: 2000,
               exchange: "binance",
               stop: false
             } = error

      task =
        Task.async(fn ->
          for key <- [{"binance", "k"}, {"binance", "k", "ip"}, {"binance", "k", "orders_10s"}],
              do: assert_paused(key, name, 1500..2000)
        end)

      Task.await(task)

      for key <- [{"binance", "k2"}, {"binance", :public, "ip"}, {"bybit", "k"}],
          do: assert(:ok = RateLimiter.check_rate(key, @slow, 1, name))
    end

    test "a 418 (IP ban) pauses every credential of the exchange and says stop",
         %{name: name} do
      assert {:error, %Error{http_status: 418, retry_after: 120_000, stop: true}} =
               observe(418, [{"retry-after", "120"}], name)

      for key <- [{"binance", "k"}, {"binance", "k2", "ip"}, {"binance", :public, "ip"}],
          do: assert_paused(key, name, 100_000..120_000)

      assert :ok = RateLimiter.check_rate({"bybit", "k"}, @slow, 1, name)
    end

    test "a wait above the 300 s cap: stop, and the pause lasts the whole time asked",
         %{name: name} do
      assert {:error, %Error{http_status: 429, retry_after: 86_400_000, stop: true} = error} =
               observe(429, [{"retry-after", "86400"}], name)

      assert error.message =~ "asked to wait 86400000 ms, longer"

      assert_paused({"binance", "k", "ip"}, name, 86_000_000..86_400_000)

      # Asked for 1e308 s: retry_after is as long as Process.sleep/1 takes.
      assert {:error, %Error{retry_after: 4_294_967_295, stop: true, message: message}} =
               observe(429, [{"retry-after", "1e308"}], name, "k2")

      assert byte_size(message) < 200
      assert message =~ "asked to wait 4294967295 ms or more"
      # The operator can lift it.
      assert :ok = RateLimiter.reset_exchange("binance", name)
      assert :ok = RateLimiter.check_rate({"binance", "k", "ip"}, @slow, 1, name)
    end

    test "Retry-After: floors, dates, and unusable values that fall back to the backoff",
         %{name: name} do
      past = "Wed, 21 Oct 2015 07:28:00 -0000"

      for value <- ["1e-400", "0", "-5", past] do
        assert {:error, %Error{retry_after: 1000}} = observe(429, [{"retry-after", value}], name)
      end

      soon =
        DateTime.utc_now()
        |> DateTime.add(10, :second)
        |> Calendar.strftime("%a, %d %b %Y %H:%M:%S GMT")

      assert {:error, %Error{retry_after: ms}} = observe(429, [{"retry-after", soon}], name)
      assert ms in 5_000..10_000

      # An unusable value falls back to the backoff.
      for value <- ["1e400", "nan", "soon"] do
        assert {:error, %Error{retry_after: 1000, stop: false}} =
                 observe(429, [{"retry-after", value}], name, "unusable")
      end
    end

    test "backoff 1 s, 2 s, 4 s ... per consecutive 429 without Retry-After; a 2xx resets it",
         %{name: name} do
      # A 429 that comes back while the backoff's pause holds was sent before it: it
      # pauses as long again and is not counted.
      for _ <- 1..3 do
        assert {:error, %Error{retry_after: 1000}} = observe(429, [], name)
      end

      Process.sleep(1_000)
      assert {:error, %Error{retry_after: 2000}} = observe(429, [], name)

      # Per credential; a 429 with a usable Retry-After neither counts nor resets.
      assert {:error, %Error{retry_after: 1000}} = observe(429, [], name, "k2")
      assert {:error, %Error{retry_after: 3000}} = observe(429, [{"retry-after", "3"}], name)
      Process.sleep(2_000)

      # Other statuses leave it alone; a 2xx starts again, unless it comes back while the
      # backoff's pause holds (it was sent before it).
      assert :ok = observe(503, [], name)
      assert {:error, %Error{retry_after: 4000}} = observe(429, %{}, name)
      assert :ok = observe(204, [], name)
      assert {:error, %Error{retry_after: 4000}} = observe(429, [], name)
      assert :ok = observe(204, [], name, "k2")
      assert {:error, %Error{retry_after: 1000}} = observe(429, [], name, "k2")
    end

    test "the backoff count is kept beside the buckets: none shows, none is paid for",
         %{name: name} do
      for _ <- 1..3, do: {:error, %Error{retry_after: 1000}} = observe(429, [], name)

      # No bucket, no debit, nothing among the busiest: only the pause's own record.
      assert %{buckets: 0, debited: 0} = RateLimiter.stats(name)
      assert RateLimiter.busiest(10, name) == []

      assert %{limit: nil, tokens: 0.0, pause_ms: ms} =
               RateLimiter.inspect_key({"binance", "k", "bourse:backoff"}, name)

      assert ms in 1..1000

      # Per limiter: another one counts from 1 s.
      other = :"#{name}_other"
      start_supervised!({RateLimiter, name: other}, id: other)
      assert {:error, %Error{retry_after: 1000}} = observe(429, [], other)
      Process.sleep(1_000)
      assert {:error, %Error{retry_after: 2000}} = observe(429, [], name)
    end

    test "overlapping pauses keep the later end", %{name: name} do
      assert {:error, _} = observe(429, [{"retry-after", "5"}], name)
      assert {:error, %Error{retry_after: 1000}} = observe(429, [{"retry-after", "1"}], name)
      assert_paused({"binance", "k", "ip"}, name, 4000..5000)
    end

    test "other statuses answer :ok and pause nothing", %{name: name} do
      # (Binance's 403, its WAF ban, stops: BodySignalTest.)
      for status <- [200, 201, 301, 400, 401, 404, 500, 503] do
        assert :ok = observe(status, [{"retry-after", "60"}], name)
      end

      assert :ok = RateLimiter.check_rate({"binance", "k"}, @slow, 1, name)
    end
  end

  test "a header it does not read is not judged: the 429 is acted on", %{name: name} do
    for {headers, credential} <- [
          {[{"retry-after", "30"}, {"content-length", 123}], "k1"},
          {[{"retry-after", 30}], "k3"},
          {%{"Retry-After" => "30", "x-trace" => nil, "x-list" => [1, 2]}, "k2"}
        ] do
      assert {:error, %Error{type: :rate_limit_exceeded, retry_after: 30_000}} =
               observe(429, headers, name, credential)

      assert {:delay, ms} = RateLimiter.check_rate({"binance", credential}, @slow, 1, name)
      assert ms > 25_000
    end
  end

  @malformed_headers [
    :none,
    "retry-after: 5",
    [{:"retry-after", "5"}],
    [{"retry-after", "5", "x"}],
    ["retry-after"],
    [{"retry-after", "5"} | :tail],
    [{"retry-after", ["5" | :tail]}],
    [{"retry-after", [1 | 2]}],
    [{"retry-after", :soon}],
    %{"retry-after" => nil},
    %{"retry-after" => ["5", :soon]}
  ]

  describe "repeated headers: the most cautious reading" do
    test "the largest count used, in either order, also as a map's list of values",
         %{name: name} do
      for {headers, i} <-
            Enum.with_index([
              [{"x-mbx-used-weight-1m", "10"}, {"x-mbx-used-weight-1m", "5000"}],
              [{"x-mbx-used-weight-1m", "5000"}, {"x-mbx-used-weight-1m", "10"}],
              %{"x-mbx-used-weight-1m" => ["10", "5000"]},
              [{"x-mbx-used-weight-1m", "garbage"}, {"X-MBX-USED-WEIGHT-1M", 5000}]
            ]) do
        key = {"binance", "k#{i}", "ip"}
        clear_of_window_edges(60_000)
        assert :ok = RateLimiter.check_rate(key, @binance, 1, name)
        # B = 4800 a minute, 5000 used: nothing more until the minute ends.
        assert :ok = observe(200, headers, name, "k#{i}")
        assert tokens(key, name) <= 0, inspect(headers)
      end
    end

    test "the longest Retry-After", %{name: name} do
      date =
        "#{Calendar.strftime(DateTime.add(DateTime.utc_now(), 9), "%a, %d %b %Y %H:%M:%S")} GMT"

      for {headers, range} <- [
            {[{"retry-after", "1"}, {"retry-after", "6"}], 6_000..6_000},
            {[{"retry-after", "6"}, {"Retry-After", "1"}], 6_000..6_000},
            {%{"retry-after" => ["6", "garbage"]}, 6_000..6_000},
            {[{"retry-after", "garbage"}, {"retry-after", 2}], 2_000..2_000},
            {[{"retry-after", "1"}, {"retry-after", date}], 7_000..9_000},
            # A list of values, whatever comes first; character codes alone are a charlist.
            {[{"retry-after", [9, "0"]}], 9_000..9_000},
            {[{"retry-after", ["0", 9]}], 9_000..9_000},
            {[{"retry-after", [1.5, 2.5]}], 2_500..2_500},
            {[{"retry-after", [-1, 5]}], 5_000..5_000},
            {[{"retry-after", ~c"7"}], 7_000..7_000}
          ] do
        credential = "k#{System.unique_integer([:positive])}"

        assert {:error, %Error{type: :rate_limit_exceeded, retry_after: ms}} =
                 observe(429, headers, name, credential)

        assert ms in range, "#{inspect(headers)}: #{ms} ms"
        assert_paused({"binance", credential}, name, (range.first - 2_000)..range.last)
      end
    end

    test "the smallest remaining, the largest limit, the latest reset", %{name: name} do
      # Generic headers (window unknown): the allowance is what remains.
      key = {"ex", "k", "request"}
      limit = %{capacity: 50, refill_per_sec: 1}

      for remaining <- [["90", "3"], ["3", "90"]] do
        assert :ok = RateLimiter.reset(key, name)
        assert :ok = RateLimiter.check_rate(key, limit, 1, name)
        set_at = System.monotonic_time(:millisecond)

        headers = [
          {"x-ratelimit-limit", "100"} | for(r <- remaining, do: {"x-ratelimit-remaining", r})
        ]

        assert :ok = RateLimiter.observe_response("ex", "k", 200, headers, name)
        assert_tokens_since(key, name, 3, limit.refill_per_sec, set_at)
      end

      # Bybit's 1 s window, B = 20: of limits 20 and 100 with 15 remaining, 100 says 85
      # were used, more than B.
      key = {"bybit", "k", "request"}

      for limits <- [["20", "100"], ["100", "20"]] do
        assert :ok = RateLimiter.reset(key, name)
        assert :ok = RateLimiter.check_rate(key, %{capacity: 10, refill_per_sec: 10}, 1, name)
        now = System.os_time(:millisecond)

        headers =
          for(l <- limits, do: {"x-bapi-limit", l}) ++
            [{"x-bapi-limit-status", "15"}, {"x-bapi-limit-reset-timestamp", "#{now}"}]

        assert :ok = RateLimiter.observe_response("bybit", "k", 200, headers, name)
        assert tokens(key, name) <= 1, inspect(limits)
      end

      # A 429 without Retry-After waits for the latest reset named.
      for resets <- [["2", "7"], ["7", "2"]] do
        headers = for reset <- resets, do: {"x-ratelimit-reset", reset}
        credential = "reset-#{Enum.join(resets)}"

        assert {:error, %Error{retry_after: 7_000}} =
                 RateLimiter.observe_response("ex", credential, 429, headers, name)
      end
    end
  end

  describe "odd and malformed headers: a limited reply is never lost" do
    test "a number value is read as its text: a float or negative Retry-After",
         %{name: name} do
      for {value, expected} <- [{2.5, 2_500}, {-2, 1_000}, {-2.5, 1_000}, {2, 2_000}] do
        credential = "k#{System.unique_integer([:positive])}"

        assert {:error, %Error{type: :rate_limit_exceeded, retry_after: ^expected}} =
                 observe(429, [{"retry-after", value}], name, credential)

        assert_paused({"binance", credential}, name, 1..expected)
      end

      # An unusable value is no Retry-After: the backoff.
      assert {:error, %Error{type: :rate_limit_exceeded, retry_after: 1_000, message: message}} =
               observe(429, [{"retry-after", "garbage"}], name, "garbage")

      assert message =~ "no usable Retry-After"
    end

    test "a 429 or 418 is acted on, from the well-formed entries, and answered invalid_parameters",
         %{name: name} do
      for headers <- @malformed_headers do
        credential = "k#{System.unique_integer([:positive])}"

        assert {:error,
                %Error{
                  type: :invalid_parameters,
                  http_status: 429,
                  retry_after: ms,
                  stop: false,
                  exchange: "binance",
                  message: "headers must be " <> _ = message
                }} = observe(429, headers, name, credential)

        assert message =~ "acted on: binance: HTTP 429"
        assert byte_size(message) < 400
        # A well-formed Retry-After beside the odd entry is read; else the backoff.
        assert ms in [1_000, 5_000], inspect(headers)
        assert_paused({"binance", credential, "ip"}, name, 1..ms)
      end

      assert {:error, %Error{type: :invalid_parameters, http_status: 429, retry_after: 2_000}} =
               observe(429, [{"retry-after", "2", "x"}, {"retry-after", "2"}], name, "both")

      # The ban pauses the whole exchange.
      exchange = "binance_ban_#{System.unique_integer([:positive])}"

      assert {:error, %Error{type: :invalid_parameters, http_status: 418, stop: true}} =
               RateLimiter.observe_response(exchange, "k", 418, [{:"retry-after", "2"}], name)

      assert {:delay, _} = RateLimiter.check_rate({exchange, "other"}, @slow, 1, name)
    end
  end

  test "bad arguments are invalid_parameters, and touch nothing", %{name: name} do
    ok_headers = [{"retry-after", "5"}]

    for {exchange, credential} <- [{:binance, "k"}, {"binance", 1}, {"binance", nil}, {nil, "k"}] do
      assert_invalid(RateLimiter.observe_response(exchange, credential, 429, ok_headers, name))
    end

    for status <- [99, 600, "429", 429.0, nil, -1] do
      assert_invalid(observe(status, ok_headers, name))
    end

    # Malformed headers on a reply that is not limited: nothing synced, even from the
    # well-formed entries.
    ip = {"binance", "k", "ip"}
    clear_of_window_edges(60_000)
    assert :ok = RateLimiter.check_rate(ip, @binance, 1, name)

    for headers <- @malformed_headers do
      headers =
        case headers do
          headers when is_map(headers) -> Map.put(headers, "x-mbx-used-weight-1m", "5000")
          headers when is_list(headers) -> [{"x-mbx-used-weight-1m", "5000"} | headers]
          headers -> headers
        end

      assert_invalid(observe(200, headers, name))
    end

    assert tokens(ip, name) >= 479
    assert :ok = RateLimiter.check_rate({"binance", "k"}, @slow, 5, name)
    assert RateLimiter.inspect_key({"binance", "k", "bourse:backoff"}, name) == nil

    # A key the table refuses: answered, with a bounded message.
    huge = String.duplicate("x", 100_000)

    assert {:error, %Error{type: :invalid_parameters, message: message}} =
             RateLimiter.observe_response(huge, "k", 429, [], name)

    assert byte_size(message) < 200

    # Names are checked even when a reply needs no call to the bucket table.
    for bad <- ["api-key-as-name", nil, 42, {:global}] do
      assert_invalid(RateLimiter.observe_response("binance", "k", 200, [], bad))
    end
  end

  # A name on a node that does not answer costs one remote timeout (5 s), not two: the
  # name is asked once, and the call exits as a call to it would. Counted here with a
  # node that is not there, whose every asking fails at once.
  test "observe_response asks a name on another node once, and exits as a call would" do
    name = {:far_limiter, :"nowhere@127.0.0.1"}
    route = {Bourse.RateLimiter.Router, :route, 1}
    Code.ensure_loaded!(Bourse.RateLimiter.Router)
    test = self()
    tracer = spawn_link(fn -> send(test, {:asked, asked(name)}) end)
    :erlang.trace(self(), true, [:call, {:tracer, tracer}])
    1 = :erlang.trace_pattern(route, true, [:local])

    result =
      catch_exit(RateLimiter.observe_response("ex", "k", 429, [{"retry-after", "1"}], name))

    :erlang.trace(self(), false, [:call])
    :erlang.trace_pattern(route, false, [:local])
    send(tracer, :done)
    assert {{:nodedown, :"nowhere@127.0.0.1"}, {RateLimiter, :call, [^name]}} = result
    assert_receive {:asked, 1}
  end

  # The calls of `Router.route(name)` traced until `:done`.
  defp asked(name) do
    receive do
      {:trace, _pid, :call, {Bourse.RateLimiter.Router, :route, [^name]}} -> 1 + asked(name)
      {:trace, _pid, :call, _other} -> asked(name)
      :done -> 0
    end
  end
end
