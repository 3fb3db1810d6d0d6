defmodule Bourse.ErrorTest do
  use ExUnit.Case, async: true

  alias Bourse.Error

  test "invalid/1 builds an :invalid_parameters error carrying its message" do
    error = Error.invalid("cost must be >= 0")
    assert %Error{type: :invalid_parameters, message: "cost must be >= 0", stop: false} = error
    assert Exception.message(error) == "cost must be >= 0"
    assert_raise Error, "cost must be >= 0", fn -> raise error end
  end

  test "rate_limited/2 builds a :rate_limit_exceeded error with a descriptive message" do
    error = Error.rate_limited(1500, exchange: "binance", http_status: 429)

    assert %Error{type: :rate_limit_exceeded, retry_after: 1500, exchange: "binance"} = error
    assert error.http_status == 429
    assert error.stop == false

    assert Exception.message(error) ==
             "binance: rate limit exceeded (HTTP 429) retry after 1500 ms"

    assert Exception.message(Error.rate_limited(120_000, stop: true)) ==
             "rate limit exceeded retry after 120000 ms (stop: do not retry)"

    assert Exception.message(Error.rate_limited(5, message: "slow down")) == "slow down"
  end

  test "unavailable/1 builds an :unavailable error carrying its message" do
    error = Error.unavailable("bourse_daemon at 127.0.0.1:7878 is down")
    assert %Error{type: :unavailable, message: "bourse_daemon at 127.0.0.1:7878 is down"} = error
    assert Exception.message(%Error{type: :unavailable}) == "rate limiter unavailable"
  end

  test "the exception can be raised with keyword fields" do
    assert_raise Error, "invalid parameters", fn -> raise Error, type: :invalid_parameters end
  end
end
