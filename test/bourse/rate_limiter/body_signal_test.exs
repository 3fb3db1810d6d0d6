defmodule Bourse.RateLimiter.BodySignalTest do
  # Rate-limit signals in reply bodies: what is recognised per exchange, the bounded scan
  # of raw bodies, and observe_response/6 with body: (the mock exchange runs them in
  # ExchangeRepliesTest).
  use ExUnit.Case, async: true

  alias Bourse.{Error, RateLimiter}
  alias Bourse.RateLimiter.{BodyScan, BodySignal}

  @slow %{capacity: 5, refill_per_sec: 1}

  setup do
    name = :"body_signal_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name})
    %{name: name}
  end

  defp find(exchange, status, body, headers \\ %{}),
    do: BodySignal.find(exchange, status, body, headers, System.os_time(:millisecond))

  describe "BodySignal.find/5" do
    test "each documented signal, from raw and decoded bodies" do
      now = System.os_time(:millisecond)

      for {exchange, status, body, scope, stop} <- [
            {"binance", 429, ~s({"code":-1003,"msg":"Too much request weight used"}), :exchange,
             false},
            {"binance", 400, %{"code" => -1015, "msg" => "Too many new orders"}, :credential,
             false},
            {"binance", 403, "<html>403 Forbidden</html>", :exchange, true},
            {"binance", 418,
             ~s({"code":-1003,"msg":"Way too much request weight used; IP banned until #{now + 120_000}."}),
             :exchange, true},
            {"bybit", 200, ~s({"retCode":10006,"retMsg":"Too many visits!","result":{}}),
             :credential, false},
            {"bybit", 200, %{retCode: 10018, retMsg: "Exceeded the IP Rate Limit."}, :exchange,
             false},
            {"bybit", 200, %{"retCode" => "10009"}, :exchange, true},
            {"bybit", 403, "access too frequent", :exchange, true},
            # A limit that may be the user's or the IP's.
            {"okx", 429, ~s({"code":"50011","data":[],"msg":"Rate limit reached."}), :unnamed,
             false},
            {"okx", 200, %{"code" => "50061", "msg" => "Sub-account rate limit reached"},
             :credential, false},
            # A batch that failed, in whole or in part: each order's sCode.
            {"okx", 200,
             ~s({"code":"1","data":[{"ordId":"","sCode":"50011","sMsg":"Rate limit reached"}],"msg":"All operations failed"}),
             :unnamed, false},
            {"okx", 200, %{"code" => "2", "data" => [%{"sCode" => "0"}, %{"sCode" => "50061"}]},
             :credential, false},
            {"kraken", 200, ~s({"error":["EAPI:Rate limit exceeded"],"result":{}}), :credential,
             false},
            {"kraken", 200, %{"error" => ["EOrder:Rate limit exceeded"]}, :credential, false},
            {"kraken", 200, %{error: ["EService: Throttled: #{div(now, 1000) + 5}"]}, :credential,
             false},
            {"kraken", 200, ~s({"error":["EGeneral:Temporary lockout"]}), :credential, true},
            {"binance", 429,
             %{
               "code" => -1015,
               "msg" => "Too many new orders; current limit is 200000 orders per DAY."
             }, {:axis, "orders_1d"}, true},
            {"coinbase", 429,
             ~s({"errors":[{"id":"rate_limit_exceeded","message":"Too many requests"}]}),
             :unnamed, false},
            {"coinbase", 200, %{"error" => "rate_limit_exceeded"}, :unnamed, false},
            # Ids that extend a known one.
            {"binance_usdm", 429, %{"code" => -1003}, :exchange, false},
            {"bybit-testnet", 200, %{"retCode" => 10006}, :credential, false}
          ] do
        assert %{scope: ^scope, stop: ^stop, reason: "" <> _} = find(exchange, status, body),
               "#{exchange} #{status} #{inspect(body)}"
      end
    end

    test "waits the reply names: Bybit's reset timestamp, Kraken's throttle, Binance's ban" do
      now = System.os_time(:millisecond)
      headers = %{"x-bapi-limit-reset-timestamp" => "#{now + 1500}"}
      assert %{wait_ms: ms} = find("bybit", 200, %{"retCode" => 10006}, headers)
      # The time left until the reset: less as the test runs late on a loaded machine.
      assert ms in 1..1500

      # Not limited, Bybit sends the current time: no wait named.
      headers = %{"x-bapi-limit-reset-timestamp" => "#{now}"}
      assert %{wait_ms: nil} = find("bybit", 200, %{"retCode" => 10006}, headers)

      assert %{wait_ms: ms} =
               find("kraken", 200, %{"error" => ["EService:Throttled: #{div(now, 1000) + 3}"]})

      assert ms in 1..3000

      assert %{wait_ms: 900_000} =
               find("kraken", 200, %{"error" => ["EGeneral:Temporary lockout"]})

      # Binance's -1015: the rest of the order window its message names.
      for {window, interval} <- [{"10 SECOND", 10_000}, {"SECOND", 1_000}, {"2 MINUTE", 120_000}] do
        msg = "Too many new orders; current limit is 50 orders per #{window}."
        body = %{"code" => -1015, "msg" => msg}
        assert %{wait_ms: ms} = BodySignal.find("binance", 429, body, %{}, now)
        assert ms == interval - rem(now, interval), "#{window}: #{ms}"
      end

      # A day's: the rest of the UTC day, on its own axis.
      for window <- ["DAY", "1 DAY"] do
        msg = "Too many new orders; current limit is 160000 orders per #{window}."
        body = %{"code" => -1015, "msg" => msg}

        assert %{wait_ms: ms, scope: {:axis, "orders_1d"}} =
                 BodySignal.find("binance", 429, body, %{}, now)

        assert ms == 86_400_000 - rem(now, 86_400_000)
      end

      assert %{wait_ms: nil} = find("binance", 429, %{"code" => -1015, "msg" => "Too many"})

      msg = "Way too much request weight used; IP banned until #{now + 60_000}."
      assert %{wait_ms: ms, stop: true} = find("binance", 418, %{"code" => -1003, "msg" => msg})
      assert ms in 50_000..60_000

      assert %{wait_ms: 600_000} = find("bybit", 403, "")
    end

    test "success, other codes, other exchanges and non-JSON bodies are no signal" do
      for {exchange, status, body} <- [
            {"binance", 200, ~s({"symbol":"BTCUSDT"})},
            {"binance", 400, %{"code" => -1121, "msg" => "Invalid symbol."}},
            {"bybit", 200, ~s({"retCode":0,"retMsg":"OK","result":{"retCode":10006}})},
            {"okx", 200, %{"code" => "0", "data" => [%{"sCode" => "50011"}]}},
            {"kraken", 200, %{"error" => [], "result" => %{}}},
            {"kraken", 200, %{"error" => "EAPI:Rate limit exceeded"}},
            {"coinbase", 400, %{"errors" => [%{"id" => "invalid_request"}]}},
            {"mock", 200, %{"retCode" => 10006}},
            {"okxx", 200, %{"code" => "50011"}},
            {"bybit", 200, "<html>maintenance</html>"},
            {"bybit", 200, nil},
            {"bybit", 200, [1, 2, 3]},
            {"okx", 500, %{"code" => 50011.0}}
          ] do
        assert find(exchange, status, body) == nil, "#{exchange} #{inspect(body)}"
      end
    end
  end

  describe "BodyScan.fields/1" do
    test "top-level fields; nested values; escapes" do
      assert BodyScan.fields(~s( {"a": 1, "b" : "x\\"y\\u00e9\\ud83d", "c": [true, null, -2.5e3],
               "d": {"e": []}, "a": 2} )) ==
               %{
                 "a" => 1,
                 "b" => "x\"yé\uFFFD",
                 "c" => [true, nil, "-2.5e3"],
                 "d" => %{"e" => []}
               }
    end

    test "keeps what it read before a cut, garbage or too deep a value" do
      assert BodyScan.fields(~s({"retCode":10006,"retMsg":"Too many vis)) == %{"retCode" => 10006}

      assert BodyScan.fields(~s({"code":-1003,"msg":"x"} trailing)) == %{
               "code" => -1003,
               "msg" => "x"
             }

      assert BodyScan.fields(~s({"code":"50011",oops})) == %{"code" => "50011"}
      deep = String.duplicate("[", 8) <> String.duplicate("]", 8)
      assert BodyScan.fields(~s({"code":1,"x":#{deep},"y":2})) == %{"code" => 1}

      assert BodyScan.fields(~s({"x":#{String.duplicate("[", 7)}#{String.duplicate("]", 7)}})) ==
               %{"x" => [[[[[[[]]]]]]]}
    end

    test "wanted keys only: other values are passed over, the scan stops when all are found" do
      body =
        ~s({"a":{"b":[1,"x\\"}]",{"c":"]"}]},"code":-1003,"d":tru,"msg":"m","code":1,"e":[[[[[[[[[[]]]]]]]]]]})

      assert BodyScan.fields(body, ["code", "msg"]) == %{"code" => -1003, "msg" => "m"}
      assert BodyScan.fields(body, ["msg"]) == %{"msg" => "m"}
      # Deep values are passed over when not wanted.
      assert BodyScan.fields(
               ~s({"e":#{String.duplicate("[", 50)}#{String.duplicate("]", 50)},"code":7}),
               ["code"]
             ) ==
               %{"code" => 7}

      assert BodyScan.fields(~s({"a":"cut), ["code"]) == %{}
      assert BodyScan.fields(~s({"a":[1,2), ["code"]) == %{}
      assert BodyScan.fields(~s({"a":"x\\), ["code"]) == %{}
    end

    test "hostile bodies: huge, deep, invalid, non-UTF-8" do
      mb = 1024 * 1024
      huge_string = ~s({"retCode":10006,"x":") <> String.duplicate("a", 50 * mb)
      assert BodyScan.fields(huge_string) == %{"retCode" => 10006}

      for body <- [
            String.duplicate("[", 10 * mb),
            "{" <> String.duplicate(~s("a":{), 2 * mb),
            String.duplicate(~s({"a":), 2 * mb),
            ~s({"a":) <> String.duplicate("9", 10 * mb),
            ~s({") <> String.duplicate("\\", 10 * mb),
            :crypto.strong_rand_bytes(mb),
            <<0xFF, 0xFE, ?{, ?", 0xC3, ?", ?:, 1>>,
            "",
            "{",
            "{}",
            "null"
          ] do
        assert is_map(BodyScan.fields(body))
        assert is_map(BodyScan.fields(body, ["code", "msg"]))
      end

      # A \u escape is four hex digits: a sign or a short one ends the scan there.
      for bad <- ["-041", "+041", " 41", "04", "0x4", "00g1"] do
        assert BodyScan.fields(~s({"retCode":10006,"a":"\\u#{bad}"})) == %{"retCode" => 10006}
        assert BodyScan.fields(~s({"retCode":10006,"\\u#{bad}":1})) == %{"retCode" => 10006}
        assert BodyScan.fields(~s({"\\u#{bad}":1,"retCode":10006}), ["retCode"]) == %{}
      end

      assert BodyScan.fields(~s({"\\u00E9\\u00e9":1})) == %{"éé" => 1}

      long_number = ~s({"code":#{String.duplicate("1", 40)}})
      assert %{"code" => text} = BodyScan.fields(long_number)
      assert is_binary(text)
    end
  end

  describe "observe_response/6 with body:" do
    test "a body with a malformed escape before the signal is no signal", %{name: name} do
      body = ~s({"\\u-041":1,"retCode":10006})
      assert :ok = RateLimiter.observe_response("bybit", "k", 200, [], name, body: body)
      assert :ok = RateLimiter.check_rate({"bybit", "k", "request"}, @slow, 1, name)
    end

    test "a 200 with Bybit retCode 10006 is answered and paused like a 429", %{name: name} do
      body = ~s({"retCode":10006,"retMsg":"Too many visits!","result":{},"time":1})

      assert {:error, %Error{} = error} =
               RateLimiter.observe_response("bybit", "k", 200, [], name, body: body)

      assert %Error{
               type: :rate_limit_exceeded,
               http_status: 200,
               retry_after: 1000,
               stop: false,
               exchange: "bybit"
             } = error

      assert error.message =~ "retCode 10006"
      assert {:delay, ms} = RateLimiter.check_rate({"bybit", "k", "request"}, @slow, 1, name)
      assert ms in 1..1000
      # The credential only.
      assert :ok = RateLimiter.check_rate({"bybit", "k2", "request"}, @slow, 1, name)

      # The backoff counts it: the next one without a usable wait, once its pause has
      # ended, waits 2 s.
      Process.sleep(1_000)

      assert {:error, %Error{retry_after: 2000}} =
               RateLimiter.observe_response("bybit", "k", 200, [], name, body: %{retCode: 10006})

      # A 200 without a signal back while that pause holds was sent before it: the count
      # stays, and the next signal, sent before the pause too, waits as long again.
      assert :ok = RateLimiter.observe_response("bybit", "k", 200, [], name, body: %{retCode: 0})

      assert {:error, %Error{retry_after: 2000}} =
               RateLimiter.observe_response("bybit", "k", 200, [], name, body: %{retCode: 10006})
    end

    test "Binance's -1015 for the day's orders holds the credential's orders_1d bucket until 00:00 UTC",
         %{name: name} do
      msg = "Too many new orders; current limit is 200000 orders per DAY."
      body = ~s({"code":-1015,"msg":"#{msg}"})

      assert {:error, %Error{stop: true, retry_after: ms} = error} =
               RateLimiter.observe_response("binance", "k", 429, [], name, body: body)

      left = 86_400_000 - rem(System.os_time(:millisecond), 86_400_000)
      # Read after the answer: no longer than its wait.
      assert ms in left..(left + 5_000)
      assert error.message =~ "-1015"
      assert {:delay, _} = RateLimiter.check_rate({"binance", "k", "orders_1d"}, @slow, 1, name)
      # Its other requests (queries, cancels) go on.
      assert :ok = RateLimiter.check_rate({"binance", "k", "request"}, @slow, 1, name)
      assert :ok = RateLimiter.check_rate({"binance", "k", "orders_10s"}, @slow, 1, name)
    end

    test "IP-wide signals pause every credential; bans stop; Retry-After comes first",
         %{name: name} do
      assert {:error, %Error{stop: false, retry_after: 3000}} =
               RateLimiter.observe_response("bybit", "k", 200, [{"retry-after", "3"}], name,
                 body: %{"retCode" => 10018}
               )

      assert {:delay, _} = RateLimiter.check_rate({"bybit", :public, "ip"}, @slow, 1, name)

      assert {:error, %Error{http_status: 403, stop: true} = error} =
               RateLimiter.observe_response("binance", "k", 403, [], name, body: "")

      assert error.message =~ "WAF"
      assert {:delay, _} = RateLimiter.check_rate({"binance", "other", "ip"}, @slow, 1, name)

      assert {:error, %Error{http_status: 403, stop: true, retry_after: 600_000}} =
               RateLimiter.observe_response("bybit-eu", "k", 403, [], name)
    end

    test "the /5 form and the options form without a name", %{name: name} do
      assert :ok = RateLimiter.observe_response("okx", "k", 200, [], name)
      assert :ok = RateLimiter.observe_response("okx", "k", 200, [], name, [])
      assert :ok = RateLimiter.observe_response("okx", "k", 200, [], name, body: nil)

      # The default limiter is not running in this test: the options form reaches it.
      assert catch_exit(RateLimiter.observe_response("okx", "k", 429, [], body: "{}")) |> elem(0) ==
               :noproc
    end

    test "hostile bodies are answered", %{name: name} do
      mb = 1024 * 1024

      for body <- [
            ~s({"retCode":10006,"x":") <> String.duplicate("a", 20 * mb),
            String.duplicate("[", 5 * mb),
            String.duplicate(~s({"retCode":), mb),
            :crypto.strong_rand_bytes(mb),
            %{"retCode" => String.duplicate("1", mb)},
            %{"retCode" => %{"deep" => [[[[]]]]}},
            %{"error" => Stream.cycle(["x"]) |> Enum.take(100_000)},
            %{"errors" => [%{"id" => "rate_limit_exceeded"} | :improper]},
            List.duplicate(%{"code" => -1003}, 1000)
          ],
          exchange <- ["bybit", "kraken", "coinbase", "binance"] do
        answer = RateLimiter.observe_response(exchange, "hostile", 200, [], name, body: body)
        assert answer == :ok or match?({:error, %Error{type: :rate_limit_exceeded}}, answer)
      end

      # The first still reads as Bybit's signal: the code comes first.
      body = ~s({"retCode":10006,"x":") <> String.duplicate("a", 20 * mb)

      assert {:error, %Error{type: :rate_limit_exceeded}} =
               RateLimiter.observe_response("bybit", "hostile2", 200, [], name, body: body)
    end

    test "bad options are invalid_parameters and touch nothing", %{name: name} do
      for opts <- [[body: 5], [body: {:ok, "x"}], [bod: "x"], [:body], %{body: ""}] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 RateLimiter.observe_response("bybit", "k", 200, [], name, opts)

        assert byte_size(message) < 300
      end

      assert :ok = RateLimiter.check_rate({"bybit", "k", "request"}, @slow, 1, name)
    end
  end
end
