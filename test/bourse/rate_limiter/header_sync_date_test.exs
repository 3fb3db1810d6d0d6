defmodule Bourse.RateLimiter.HeaderSyncDateTest do
  # A used-weight reading counted by the exchange in a window that has ended (its reply
  # crossed the window boundary on the way back) says nothing about the new window: it
  # must not hold the bucket through the new window. The reply's `Date` header tells which
  # window it was made in.
  use ExUnit.Case, async: true

  alias Bourse.RateLimiter

  # A Binance spot "ip" bucket sized as `Limits` sizes it (share 0.8): B = 480 + 72 * 60.
  @ip %{capacity: 480, refill_per_sec: 72}
  @key {"binance", "date-key", "ip"}

  setup do
    name = :"header_sync_date_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name})
    # Not within 2 s of a minute's end, so that "now" stays in one minute throughout, nor
    # in its first 1.5 s, where a reading without a Date is not applied.
    now = System.os_time(:millisecond)
    if rem(now, 60_000) > 58_000, do: Process.sleep(60_000 - rem(now, 60_000) + 1_500)
    if rem(now, 60_000) < 1_500, do: Process.sleep(1_500 - rem(now, 60_000))
    :ok = RateLimiter.check_rate(@key, @ip, 1, name)
    %{name: name}
  end

  defp http_date(unix_ms) do
    unix_ms
    |> DateTime.from_unix!(:millisecond)
    |> Calendar.strftime("%a, %d %b %Y %H:%M:%S GMT")
  end

  defp observe(name, used, date) do
    RateLimiter.observe_response(
      "binance",
      "date-key",
      200,
      [{"Date", date}, {"X-MBX-USED-WEIGHT-1M", Integer.to_string(used)}],
      name,
      limits: %{"ip" => @ip}
    )
  end

  test "a reading dated in the previous minute does not hold the bucket through this one",
       %{name: name} do
    previous_minute = System.os_time(:millisecond) - 60_000
    assert :ok = observe(name, 4800, http_date(previous_minute))
    assert :ok = RateLimiter.check_rate(@key, @ip, 1, name)
    assert RateLimiter.inspect_key(@key, name).tokens > 470
  end

  test "a reading dated in this minute is applied as before", %{name: name} do
    assert :ok = observe(name, 4800, http_date(System.os_time(:millisecond)))
    assert {:delay, ms} = RateLimiter.check_rate(@key, @ip, 1, name)
    assert ms > 1_000
  end

  test "an unreadable or absent Date, read past a window's first second, changes nothing",
       %{name: name} do
    assert :ok = observe(name, 4800, "not a date")
    assert {:delay, _} = RateLimiter.check_rate(@key, @ip, 1, name)
  end

  # Binance's 10-second order count: its first second. A machine too slow to read the
  # reply within it tries again, on a fresh key, in the next window.
  test "an undated reading read in a window's first second is not applied", %{name: name} do
    limit = %{capacity: 8, refill_per_sec: 7.2}
    reading = [{"X-MBX-ORDER-COUNT-10S", "80"}]
    opts = [limits: %{"orders_10s" => limit}]

    credential =
      Enum.find_value(1..3, fn attempt ->
        credential = "undated-#{attempt}"
        :ok = RateLimiter.check_rate({"binance", credential, "orders_10s"}, limit, 1, name)
        into_window(100)
        answer = RateLimiter.observe_response("binance", credential, 200, reading, name, opts)
        assert answer == :ok
        rem(System.os_time(:millisecond), 10_000) < 1_000 and credential
      end) || flunk("no reply read within a window's first second")

    key = {"binance", credential, "orders_10s"}
    assert :ok = RateLimiter.check_rate(key, limit, 1, name)

    into_window(1_100)
    assert :ok = RateLimiter.observe_response("binance", credential, 200, reading, name, opts)
    assert {:delay, _} = RateLimiter.check_rate(key, limit, 1, name)
  end

  # Sleeps until `ms` into a 10-second window (of the next one, if past that already).
  defp into_window(ms) do
    at = rem(System.os_time(:millisecond), 10_000)
    Process.sleep(if at <= ms, do: ms - at, else: 10_000 - at + ms)
  end
end
