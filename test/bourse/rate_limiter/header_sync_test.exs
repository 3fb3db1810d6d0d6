defmodule Bourse.RateLimiter.HeaderSyncTest do
  # Header sync against the mock exchange, and `config :bourse, :header_axes`. The
  # application environment is global, so these tests do not run alongside others.
  use ExUnit.Case, async: false

  alias Bourse.{Error, RateLimiter}
  alias Bourse.Testing.{HTTP, MockExchange}

  setup do
    name = :"header_sync_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name})

    on_exit(fn ->
      Application.delete_env(:bourse, :header_axes)
      Application.delete_env(:bourse, :header_limits)
    end)

    %{name: name}
  end

  describe "Fincode's field report's experiment" do
    @describetag timeout: 120_000

    # The mock counts 10 weight per 1 s window per IP. Our bot, a bucket of 2 plus 7 a
    # second, makes 30 calls; a second program on the same IP sends every 0.25 s,
    # ignoring any limiter. Without header sync both together ask for 11 a window.
    test "with header sync the bot draws no 429; without, it draws some", %{name: name} do
      # The mock's generic headers describe its 1 s window; the bot's bucket is "ip".
      Application.put_env(:bourse, :header_axes, %{"x-ratelimit" => {"ip", 1_000}})

      without = experiment(name, false)
      with_sync = experiment(name, true)

      IO.puts(
        "\nheader experiment, 30 calls (429s drawn by the bot / by the other program): " <>
          "without sync #{without.bot} / #{without.other}, " <>
          "with sync #{with_sync.bot} / #{with_sync.other}"
      )

      # Without sync the two ask for more than a window holds, unless a loaded machine
      # slowed them below it.
      assert without.bot >= 1 or without.asked_per_s < 10.5, "#{inspect(without)}"
      assert with_sync.bot == 0
    end
  end

  # Runs one bot of 30 calls beside the other program; counts the 429s each drew.
  defp experiment(name, sync?) do
    :ok = RateLimiter.reset_all(name)
    {:ok, mock} = MockExchange.start(limit: 10, window_ms: 1000)
    url = mock.url <> "/api/v3/ping"
    started_at = System.monotonic_time(:millisecond)
    other = start_other(url)
    bot = Enum.sum(for _ <- 1..30, do: bot_call(url, name, sync?, 0))
    send(other, {:stop, self()})
    other = receive(do: ({:other, limited} -> limited))
    seconds = (System.monotonic_time(:millisecond) - started_at) / 1000
    %{served: served} = MockExchange.stats(mock)
    MockExchange.stop(mock)
    %{bot: bot, other: other, asked_per_s: Float.round(served / seconds, 1)}
  end

  # One call, retried until it passes: returns the 429s drawn. Without sync the bot does
  # not report replies at all (as a limiter without header support would).
  defp bot_call(url, name, sync?, limited) do
    :ok =
      RateLimiter.wait_for_capacity(
        {"mock", :public, "ip"},
        %{capacity: 2, refill_per_sec: 7},
        1,
        name
      )

    {:ok, status, headers, _body} = HTTP.get(url)
    if sync?, do: RateLimiter.observe_response("mock", :public, status, headers, name)

    if status == 429, do: bot_call(url, name, sync?, limited + 1), else: limited
  end

  # Sends at every quarter of a wall-clock second, like a `sleep(0.25)` loop.
  defp start_other(url) do
    spawn_link(fn -> other_loop(url, 0) end)
  end

  defp other_loop(url, limited) do
    receive do
      {:stop, from} -> send(from, {:other, limited})
    after
      250 - rem(System.os_time(:millisecond), 250) ->
        {:ok, status, _headers, _body} = HTTP.get(url)
        other_loop(url, limited + if(status == 429, do: 1, else: 0))
    end
  end

  describe "config :bourse, :header_axes" do
    test "renames an axis, adds a used counter with its window, ignores a header",
         %{name: name} do
      Application.put_env(:bourse, :header_axes, %{
        "X-MBX-USED-WEIGHT-1M" => "weight",
        "x-used-weight" => {"ip", 1_000},
        "x-mbx-order-count-10s" => nil
      })

      limit = %{capacity: 5, refill_per_sec: 5}
      # Before the buckets are made: a full idle bucket is swept after its fill time (1 s;
      # 50 s for the one whose header is ignored, looked at last).
      Bourse.Window.clear_of_edges([60_000, 1_000])

      for {axis, limit} <- [
            {"weight", limit},
            {"ip", limit},
            {"orders_10s", %{capacity: 5, refill_per_sec: 0.1}}
          ],
          do: :ok = RateLimiter.check_rate({"ex", "k", axis}, limit, 1, name)

      headers = [
        {"x-mbx-used-weight-1m", "99999"},
        {"x-used-weight", "10"},
        {"x-mbx-order-count-10s", "99999"}
      ]

      assert :ok = RateLimiter.observe_response("ex", "k", 200, headers, name)
      tokens = &RateLimiter.inspect_key({"ex", "k", &1}, name).tokens

      assert tokens.("weight") < 0
      # B = 5 + 5 * 1 = 10 per second, all used: nothing more until the second ends.
      assert tokens.("ip") <= 0
      assert tokens.("orders_10s") > 3.9
    end

    test "a window for the generic headers keeps room for other programs", %{name: name} do
      key = {"ex", "k", "request"}
      limit = %{capacity: 2, refill_per_sec: 7}
      headers = [{"x-ratelimit-limit", "10"}, {"x-ratelimit-remaining", "5"}]

      # Unknown window: the allowance is the 5 remaining, above the 2 tokens held.
      Bourse.Window.clear_of_edges(60_000)
      assert :ok = RateLimiter.check_rate(key, limit, 0, name)
      assert :ok = RateLimiter.observe_response("ex", "k", 200, headers, name)
      assert_in_delta RateLimiter.inspect_key(key, name).tokens, 2, 0.1

      # A 1 s window: B = 2 + 7 * 1 = 9 of 10; 9 used leave nothing for this bucket (read
      # later, it holds what it refilled since, 7 a second: a loaded machine may be slow).
      Application.put_env(:bourse, :header_axes, %{"x-ratelimit" => {"request", 1_000}})
      headers = [{"x-ratelimit-limit", "10"}, {"x-ratelimit-remaining", "1"}]
      set_at = System.monotonic_time(:millisecond)
      assert :ok = RateLimiter.observe_response("ex", "k", 200, headers, name)
      tokens = RateLimiter.inspect_key(key, name).tokens
      refilled = limit.refill_per_sec * (System.monotonic_time(:millisecond) - set_at) / 1000
      assert tokens >= -0.1 and tokens <= refilled + 0.1, "#{tokens} tokens"
    end

    test ":header_limits bounds a used counter; nil lifts the default bound", %{name: name} do
      key = {"ex", "k", "ip"}
      limit = %{requests: 6000, period: 60_000}
      headers = [{"x-mbx-used-weight-1m", "2000"}]
      window_left = fn -> Bourse.Window.left(60_000) end

      # Configured: 2,400 a minute, 400 more until the minute ends.
      Application.put_env(:bourse, :header_limits, %{"X-MBX-USED-WEIGHT-1M" => 2400})
      Bourse.Window.clear_of_edges(60_000)
      assert :ok = RateLimiter.check_rate(key, limit, 0, name)
      assert :ok = RateLimiter.observe_response("ex", "k", 200, headers, name)
      expected = min(6000, 400 - 100 * window_left.() / 1000)
      assert_in_delta RateLimiter.inspect_key(key, name).tokens, expected, 20

      # Without a bound, only B = 12,000 counts: 10,000 more, more than the bucket holds
      # while more than 40 s of the minute are left.
      Application.put_env(:bourse, :header_limits, %{"x-mbx-used-weight-1m" => nil})
      assert :ok = RateLimiter.reset(key, name)
      Bourse.Window.clear_of_edges(60_000)
      assert :ok = RateLimiter.check_rate(key, limit, 0, name)
      assert :ok = RateLimiter.observe_response("ex", "k", 200, headers, name)
      expected = min(6000, 10_000 - 100 * window_left.() / 1000)
      assert_in_delta RateLimiter.inspect_key(key, name).tokens, expected, 20

      for config <- [%{"x-mbx-used-weight-1m" => 0}, %{"x" => "10"}, [x: 1], %{x: 1}] do
        Application.put_env(:bourse, :header_limits, config)

        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 RateLimiter.observe_response("ex", "k", 200, headers, name)

        assert message =~ "header_limits", inspect(config)
      end
    end

    test "a malformed setting is invalid_parameters", %{name: name} do
      for config <- [
            [{"x-ratelimit", "ip"}],
            %{"x-new-header" => "ip"},
            %{"x-new-header" => {"ip", nil}},
            %{"x-ratelimit" => {"ip", 0}},
            %{"x-ratelimit" => :ip},
            %{x_ratelimit: "ip"}
          ] do
        Application.put_env(:bourse, :header_axes, config)

        assert {:error, %Error{type: :invalid_parameters, message: message}} =
                 RateLimiter.observe_response("ex", "k", 200, [], name)

        assert message =~ "header_axes", inspect(config)
      end
    end
  end
end
