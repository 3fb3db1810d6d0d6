defmodule Bourse.ContractTests.Backoff do
  @moduledoc false
  # The backoff of `observe_response/6`: limited replies without a usable wait, counted
  # per credential (per exchange for replies limiting the whole exchange) in the limiter's
  # table (shared by the limiters sharing it).
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "backoff" do
        test "429s without Retry-After back off 1 s, 2 s, 4 s per credential; a 2xx starts again",
             %{name: name} do
          # Replies that come back while the backoff's pause holds were sent before it: a
          # burst of them is one backoff.
          for _ <- 1..4 do
            assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: 1000}} =
                     limited_reply("k", 429, name)
          end

          # Every axis of the credential is held for the backoff; others are not.
          assert_delay(check_rate({"ex", "k", "ip"}, @still, 1, name), 1..1_000)
          assert :ok = check_rate({"ex", "k2", "ip"}, @still, 1, name)

          # Each credential, and the public pool, counts for itself.
          assert {:error, %{retry_after: 1000}} = limited_reply("k2", 429, name)
          assert {:error, %{retry_after: 1000}} = limited_reply(:public, 429, name)

          # Once the pause has ended, the next one doubles it.
          Process.sleep(1_000)
          assert {:error, %{retry_after: 2000}} = limited_reply("k", 429, name)

          # A usable Retry-After neither counts nor resets; other statuses leave it alone.
          assert {:error, %{retry_after: 3000}} =
                   observe_response("ex", "k", 429, [{"retry-after", "3"}], name)

          assert :ok = observe_response("ex", "k", 503, [], name)
          Process.sleep(2_000)
          assert {:error, %{retry_after: 4000}} = limited_reply("k", 429, name)
          # A 2xx back while the backoff holds was sent before it: the count stays.
          assert :ok = observe_response("ex", "k", 200, [], name)
          assert {:error, %{retry_after: 4000}} = limited_reply("k", 429, name)
          # One after it (k2's backoff ended long ago) starts the count again.
          assert :ok = observe_response("ex", "k2", 200, [], name)
          assert {:error, %{retry_after: 1000}} = limited_reply("k2", 429, name)
        end

        test "replies limiting the IP without a usable wait back off the whole exchange, counted for it",
             %{name: name} do
          # Binance's -1003: the IP's request weight, whichever key the reply came to.
          ip_limited = fn credential ->
            Bourse.RateLimiter.observe_response("binance", credential, 429, [], name,
              body: %{"code" => -1003}
            )
          end

          assert {:error, %{retry_after: 1000, stop: false}} = ip_limited.("k")
          assert_delay(check_rate({"binance", "other", "ip"}, @still, 1, name), 1..1_000)
          assert :ok = check_rate({"ex2", "k", "ip"}, @still, 1, name)
          Process.sleep(1_000)
          # Keys sharing the IP share its count, whichever key the reply came to.
          assert {:error, %{retry_after: 2000}} = ip_limited.("other")
          # Sent before that pause: held as long again, not counted.
          assert {:error, %{retry_after: 2000}} = ip_limited.("k")
          # A credential's own 429s count apart.
          assert {:error, %{retry_after: 1000}} = observe_response("binance", "k", 429, [], name)
          # A 2xx back while the exchange's backoff holds was sent before it: the count stays.
          assert :ok = observe_response("binance", "k2", 200, [], name)
          assert {:error, %{retry_after: 2000}} = ip_limited.("other")
          # Once it ended, a 2xx to any key starts the exchange's count again.
          Process.sleep(2_000)
          assert :ok = observe_response("binance", "k2", 200, [], name)
          assert {:error, %{retry_after: 1000}} = ip_limited.("other")
        end

        test "a ban that names no wait (a 418 without Retry-After) pauses the exchange 2 minutes, not a backoff",
             %{name: name} do
          for _ <- 1..2 do
            assert {:error, %{retry_after: 120_000, stop: true, message: message}} =
                     observe_response("binance", "k", 418, [], name)

            assert message =~ "names no usable wait"
          end

          assert_delay(check_rate({"binance", "other", "ip"}, @still, 1, name), 119_000..120_000)
          assert :ok = check_rate({"ex2", "k", "ip"}, @still, 1, name)
          # No backoff counted: the exchange's first backoff is still 1 s.
          assert :ok = reset_exchange("binance", name)

          assert {:error, %{retry_after: 1000}} =
                   Bourse.RateLimiter.observe_response("binance", "k", 429, [], name,
                     body: %{"code" => -1003}
                   )
        end

        test "malformed headers: a 429 is still acted on, answered invalid_parameters; a 2xx starts nothing again",
             %{name: name} do
          for headers <- [[{:"retry-after", "5"}], [{"retry-after", "5", "x"}], :none] do
            assert {:error,
                    %Bourse.Error{
                      type: :invalid_parameters,
                      http_status: 429,
                      retry_after: 1000,
                      stop: false
                    }} = observe_response("ex", "k", 429, headers, name)
          end

          assert_delay(check_rate({"ex", "k", "ip"}, @still, 1, name), 1..1_000)
          Process.sleep(1_000)
          # Not judged a success: the count stays.
          assert {:error, %Bourse.Error{type: :invalid_parameters, http_status: nil}} =
                   observe_response("ex", "k", 200, [{"retry-after", :soon}], name)

          assert {:error, %{retry_after: 2000}} = limited_reply("k", 429, name)

          # Repeated headers read the longest wait; a number value is read as its text.
          assert {:error, %{type: :rate_limit_exceeded, retry_after: 6000}} =
                   observe_response(
                     "ex",
                     "k2",
                     429,
                     [{"retry-after", "1"}, {"retry-after", "6"}],
                     name
                   )

          assert {:error, %{type: :rate_limit_exceeded, retry_after: 2500}} =
                   observe_response("ex", "k3", 429, [{"retry-after", 2.5}], name)
        end

        test "the count is no bucket, and resets forget it with the pauses", %{name: name} do
          %{buckets: buckets, debited: debited} = stats(name)
          for _ <- 1..3, do: limited_reply("k", 429, name)
          assert %{buckets: ^buckets, debited: ^debited} = stats(name)
          assert busiest(10, name) == []

          assert :ok = reset_exchange("ex", name)
          assert :ok = check_rate({"ex", "k"}, @still, 1, name)
          assert {:error, %{retry_after: 1000}} = limited_reply("k", 429, name)
          assert :ok = reset_all(name)
          assert {:error, %{retry_after: 1000}} = limited_reply("k", 429, name)
        end

        test "limiters sharing a table share the count; others count for themselves",
             %{name: name, backend: backend} do
          other = :"limiter_#{System.unique_integer([:positive])}"
          start_supervised!({Bourse.RateLimiter, name: other, backend: backend}, id: other)
          assert {:error, %{retry_after: 1000}} = limited_reply("k", 429, name)
          Process.sleep(1_000)
          shared = :own_table in @contract_skip
          next = if shared, do: 2000, else: 1000
          assert {:error, %{retry_after: ^next}} = limited_reply("k", 429, other)
        end
      end

      defp limited_reply(credential, status, name),
        do: observe_response("ex", credential, status, [], name)
    end
  end
end
