defmodule Bourse.RateLimiter.ObserveResponseEventsTest do
  # Events and secrets of `Bourse.RateLimiter.observe_response/6`.
  use ExUnit.Case, async: true

  alias Bourse.{Error, Fingerprint, RateLimiter}

  @credential "SECRET-API-KEY-123"

  setup do
    name = :"observe_response_events_#{System.unique_integer([:positive])}"
    test = self()
    on_event = fn event, measurements, metadata -> send(test, {event, measurements, metadata}) end
    start_supervised!({RateLimiter, name: name, on_event: on_event})
    %{name: name}
  end

  test "a 429 is a :rate_limited event with the credential's fingerprint", %{name: name} do
    fingerprint = Fingerprint.of(@credential)

    assert {:error, %Error{type: :rate_limit_exceeded, retry_after: 2_000} = error} =
             RateLimiter.observe_response(
               "binance",
               @credential,
               429,
               [{"retry-after", "2"}],
               name
             )

    refute inspect(error) =~ "SECRET"

    assert_received {[:bourse, :rate_limiter, :paused], %{ms: 2_000}, %{credential: ^fingerprint}}

    assert_received {[:bourse, :rate_limiter, :rate_limited], %{retry_after_ms: 2_000},
                     %{
                       limiter: ^name,
                       exchange: "binance",
                       credential: ^fingerprint,
                       axis: nil,
                       http_status: 429,
                       stop: false,
                       signal: nil
                     }}

    assert :ok = RateLimiter.observe_response("binance", @credential, 200, [], name)
    refute_received {[:bourse, :rate_limiter, :rate_limited], _, _}
  end

  test "a signal in the body says which, in the event and the error", %{name: name} do
    fingerprint = Fingerprint.of(@credential)
    body = ~s({"retCode":10006,"retMsg":"Too many visits!"})

    assert {:error, %Error{http_status: 200} = error} =
             RateLimiter.observe_response("bybit", @credential, 200, [], name, body: body)

    refute inspect(error) =~ "SECRET"

    assert_received {[:bourse, :rate_limiter, :rate_limited], %{retry_after_ms: 1_000},
                     %{
                       exchange: "bybit",
                       credential: ^fingerprint,
                       http_status: 200,
                       stop: false,
                       signal: "Bybit retCode 10006 (too many visits)"
                     }}
  end

  test "a malformed credential is not echoed", %{name: name} do
    assert {:error, %Error{type: :invalid_parameters} = error} =
             RateLimiter.observe_response("binance", ~c"SECRET-API-KEY-123", 429, [], name)

    refute inspect(error) =~ "SECRET"
    refute_received {[:bourse, :rate_limiter, _], _, _}
  end
end
