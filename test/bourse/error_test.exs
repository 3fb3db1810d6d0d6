defmodule Bourse.ErrorTest do
  use ExUnit.Case, async: true

  alias Bourse.Error

  doctest Bourse.Error, only: [describe: 1]

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

    assert error.message == "binance: rate limit exceeded (HTTP 429) retry after 1500 ms"
    assert Exception.message(error) == error.message

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

  test "describe/1 shows a value in bounded size, never a binary's bytes" do
    assert Error.describe(-1) == "-1"
    assert Error.describe(1.5) == "1.5"
    assert Error.describe(nil) == "nil"
    assert Error.describe(:binary.copy("SECRET", 1_000_000)) == "a binary of 6000000 bytes"
    assert Error.describe(<<1::3>>) == "a bitstring of 3 bits"
    assert Error.describe(Enum.to_list(1..1_000_000)) == "a list"
    assert Error.describe(%{a: 1}) == "a map of 1 key"
    assert Error.describe({1}) == "a tuple of 1 element"
    assert Error.describe({1, 2}) == "a tuple of 2 elements"
    assert Error.describe(self()) == "a pid"
    assert Error.describe(make_ref()) == "a reference"
    assert Error.describe(fn -> :ok end) == "a function"

    for term <- [10 ** 100_000, -(10 ** 100_000), Enum.reduce(1..100_000, [], &[&1 | &2])] do
      assert byte_size(Error.describe(term)) < 40
    end
  end

  test "with_exchange/2 fills an exchange id in, never over one already there" do
    assert %Error{exchange: "okx"} = Error.with_exchange(Error.invalid("x"), "okx")
    assert %Error{exchange: nil} = Error.with_exchange(Error.invalid("x"), :okx)

    assert %Error{exchange: nil} =
             Error.with_exchange(Error.invalid("x"), :binary.copy("k", 1025))

    assert %Error{exchange: "a"} = Error.with_exchange(%Error{type: :x, exchange: "a"}, "b")
  end

  test "with_exchange/2 takes an exchange id by the core's rule: UTF-8 text within its bound" do
    for bad <- [<<255>>, "ok" <> <<0xC3>>, <<0xED, 0xA0, 0x80>>, :binary.copy("é", 513)] do
      assert %Error{exchange: nil} = Error.with_exchange(Error.invalid("x"), bad), inspect(bad)
    end

    for good <- ["é", :binary.copy("é", 512), :binary.copy("k", 1024)] do
      assert %Error{exchange: ^good} = Error.with_exchange(Error.invalid("x"), good)
    end
  end
end
