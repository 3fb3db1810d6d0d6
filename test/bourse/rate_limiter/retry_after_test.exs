defmodule Bourse.RateLimiter.RetryAfterTest do
  use ExUnit.Case, async: true

  alias Bourse.RateLimiter.RetryAfter

  @now ~U[2015-10-21 07:28:00Z]

  defp parse(value, opts \\ []), do: RetryAfter.parse(value, Keyword.put_new(opts, :now, @now))

  describe "seconds" do
    test "integer and decimal text, rounded up to whole ms" do
      assert parse("2") == {:ok, 2000}
      assert parse(" \t2\r\n") == {:ok, 2000}
      assert parse("1.5") == {:ok, 1500}
      assert parse("1.0001") == {:ok, 1001}
      assert parse("3e1") == {:ok, 30_000}
      assert parse("2.5E+2") == {:ok, 250_000}
      assert parse("1234e-3") == {:ok, 1234}
      assert parse("0001.25") == {:ok, 1250}
    end

    test "numbers are seconds" do
      assert parse(3) == {:ok, 3000}
      assert parse(1.25) == {:ok, 1250}
      assert parse(1.0e-300) == {:ok, 1000}
      assert parse(-7.5) == {:ok, 1000}
      assert {:stop, ms} = parse(1.0e300)
      assert ms > 1.0e302
    end

    test "tiny, zero and negative values get the floor" do
      for value <- [
            "1e-400",
            "0",
            "0.0",
            "-0",
            "-5",
            "0.0001",
            "-1e-400",
            "1e-99999999999999999999"
          ] do
        assert parse(value) == {:ok, 1000}, value
      end
    end

    test "infinity, NaN and other unusable text are :error" do
      for value <-
            ~w(1e400 -1e400 1.8e308 1e99999999999999999999 inf -inf Infinity nan NaN) ++
              ["", " ", "1,5", "0x10", "1.", ".5", "+5", "1 2", "five", "1e", "--1", "1e+"] do
        assert parse(value) == :error, value
      end
    end

    test "the largest finite double is finite, so it is a ban" do
      assert {:stop, _} = parse("1.7976931348623157e308")
    end

    test "an integer answers as its text does" do
      for n <- [2, 86_400, Integer.pow(10, 200), -Integer.pow(10, 200)] do
        assert parse(n) == parse(Integer.to_string(n)), inspect(n)
      end

      largest = trunc(1.7976931348623157e308)
      assert {:stop, _} = parse(largest)
      assert parse(largest + 1) == :error
      assert parse(Integer.pow(10, 400)) == parse("1e400")
      assert parse(-Integer.pow(10, 400)) == parse("-1e400")
    end
  end

  describe "HTTP dates" do
    test "IMF-fixdate, RFC 850 and asctime" do
      assert parse("Wed, 21 Oct 2015 07:28:05 GMT") == {:ok, 5000}
      assert parse("Wednesday, 21-Oct-15 07:28:05 GMT") == {:ok, 5000}
      assert parse("Wed Oct 21 07:28:05 2015") == {:ok, 5000}
      assert parse("Wed Oct  1 07:28:05 2015", now: ~U[2015-10-01 07:28:00Z]) == {:ok, 5000}
    end

    test "zones as Python's email.utils reads them" do
      for zone <- ~w(GMT UTC UT Z gmt -0000 +0000) do
        assert parse("Wed, 21 Oct 2015 07:28:05 #{zone}") == {:ok, 5000}, zone
      end

      assert parse("Wed, 21 Oct 2015 07:28:05") == {:ok, 5000}
      assert parse("21 Oct 2015 07:28:05 GMT") == {:ok, 5000}
      assert parse("Wed, 21 Oct 2015 09:28:05 +0200") == {:ok, 5000}
      assert parse("Wed, 21 Oct 2015 02:28:05 -0500") == {:ok, 5000}
    end

    test "a date in the past or now gets the floor" do
      assert parse("Wed, 21 Oct 2015 07:28:00 GMT") == {:ok, 1000}
      assert parse("Tue, 20 Oct 2015 07:28:05 GMT") == {:ok, 1000}
      assert parse("Sun, 06 Nov 1994 08:49:37 GMT") == {:ok, 1000}
    end

    test "a date beyond the cap is a ban" do
      assert parse("Thu, 22 Oct 2015 07:28:00 GMT") == {:stop, 86_400_000}
    end

    test "two-digit years more than 50 years ahead are in the previous century" do
      assert parse("Sunday, 06-Nov-94 08:49:37 GMT") == {:ok, 1000}
      assert parse("Sunday, 06-Nov-94 08:49:37 GMT", now: ~U[1994-11-06 08:49:30Z]) == {:ok, 7000}
      assert parse("Thursday, 22-Oct-66 07:28:00 GMT") == {:ok, 1000}

      assert parse("Monday, 22-Oct-35 07:28:00 GMT", cap_ms: Integer.pow(10, 12)) ==
               {:ok, 631_238_400_000}
    end

    test ":now may be unix milliseconds" do
      now = DateTime.to_unix(@now, :millisecond)
      assert RetryAfter.parse("Wed, 21 Oct 2015 07:28:02 GMT", now: now) == {:ok, 2000}
    end

    test "the default :now is the system clock" do
      future =
        DateTime.utc_now() |> DateTime.add(60) |> Calendar.strftime("%a, %d %b %Y %H:%M:%S GMT")

      assert {:ok, ms} = RetryAfter.parse(future)
      assert ms in 50_000..60_000
    end

    test "impossible dates are :error" do
      for value <- [
            "Wed, 32 Oct 2015 07:28:05 GMT",
            "Wed, 30 Feb 2015 07:28:05 GMT",
            "Wed, 21 Foo 2015 07:28:05 GMT",
            "Wed, 21 Oct 2015 25:28:05 GMT",
            "Wed, 21 Oct 2015 07:28:05 PST8",
            "Wed, 21 Oct 15015 07:28:05 GMT",
            "Wed Oct 21 07:28:05 15"
          ] do
        assert parse(value) == :error, value
      end
    end
  end

  describe "options" do
    test ":floor_ms and :cap_ms" do
      assert parse("0", floor_ms: 250) == {:ok, 250}
      assert parse("0.0001", floor_ms: 0) == {:ok, 1}
      assert parse("-5", floor_ms: 0) == {:ok, 0}
      assert parse("301") == {:stop, 301_000}
      assert parse("300") == {:ok, 300_000}
      assert parse("86400", cap_ms: 86_400_000) == {:ok, 86_400_000}
      assert parse("10", cap_ms: 5_000) == {:stop, 10_000}
      # The floor never passes the cap: by default it is the cap when lower.
      assert parse("0.1", cap_ms: 500) == {:ok, 500}
      assert parse("1", cap_ms: 500) == {:stop, 1000}

      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               parse("0.5", floor_ms: 5000, cap_ms: 1000)

      assert message =~ "floor_ms"
    end
  end

  test "non-text terms are :error" do
    for value <- [nil, :soon, ~c"5", ["5"], {5}, %{}, self(), make_ref(), <<1::3>>] do
      assert parse(value) == :error, inspect(value)
    end
  end

  test "no binary makes it raise" do
    alphabet = ~c"0123456789.eE+- \t,:GMTWedOctZ" ++ [0, 255]

    for _ <- 1..5_000 do
      value =
        if :rand.uniform(2) == 1,
          do: :crypto.strong_rand_bytes(:rand.uniform(40)),
          else: for(_ <- 1..:rand.uniform(30), into: "", do: <<Enum.random(alphabet)>>)

      result = parse(value)

      assert result == :error or
               match?({tag, ms} when tag in [:ok, :stop] and is_integer(ms), result),
             inspect(value)
    end

    assert parse(String.duplicate("9", 10_000)) == :error
  end

  test "options other than :floor_ms, :cap_ms and :now are :invalid_parameters, naming them" do
    for {opts, word} <- [
          {:x, "keyword list"},
          {[cap: 1], ":cap"},
          {[cap_ms: "x"], "cap_ms"},
          {[floor_ms: -1], "floor_ms"},
          {[now: "today"], "now"},
          {[now: 10 ** 40], "now"},
          {[now: -1], "now"}
        ] do
      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               RetryAfter.parse("2", opts),
             inspect(opts)

      assert message =~ word
    end
  end
end
