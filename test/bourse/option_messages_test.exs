defmodule Bourse.OptionMessagesTest do
  # Errors of the Elixir-only options (backends, `Limits`, `Exchange`) describe a bad value
  # by its type and size (`Bourse.Error.describe/1`): bounded whatever the value, and never
  # echoing a credential given in the wrong place.
  use ExUnit.Case, async: true

  alias Bourse.{Error, RateLimiter}
  alias Bourse.RateLimiter.{Exchange, Limits}

  @secret "SECRET-API-KEY-123"
  @huge String.duplicate("x", 10_000_000)
  @long_list Enum.to_list(1..100_000)

  defp assert_described({:error, %Error{type: :invalid_parameters, message: message}}) do
    assert byte_size(message) < 300, message
    refute message =~ "SECRET", message
    refute message =~ "xxxxxxxx", message
    message
  end

  defp start(backend),
    do:
      RateLimiter.start_link(
        name: :"option_messages_#{System.unique_integer()}",
        backend: backend
      )

  test "daemon options" do
    for bad <- [@secret, @huge, {@secret, 1}, @long_list, <<"127.0.0.", 0xFF, ":7000">>] do
      assert_described(start({:daemon, bad}))
      assert_described(start({:daemon, "127.0.0.1:7000", timeout: bad}))
      assert_described(start({:daemon, "127.0.0.1:7000", allow_remote: bad}))
      assert_described(start({:daemon, "127.0.0.1:7000", secret_file: {bad}}))
    end

    assert_described(start({:daemon, "127.0.0.1:7000", [{@secret, 1}]}))
    # No host name holds an `@`: a secret before one is not shown as the host.
    assert_described(start({:daemon, "#{@secret}@127.0.0.1:7000", allow_remote: true}))
    assert_described(start({:daemon, "#{@secret}@127.0.0.1:7000"}))

    assert assert_described(start({:daemon, "/tmp/bourse.sock"})) =~
             "a Unix socket's path is given as {:unix, path}"

    assert_described(start({:daemon, {{127, 0, 0, 1}, 70_000}, []}))

    assert assert_described(start({:daemon, "127.0.0.1:7000", no_such: 1})) =~
             "unknown daemon option :no_such"
  end

  # As the daemon reads its own: never a FIFO waited on, nor a device read without end.
  test "a daemon secret_file is a regular file of a few bytes, refused at once otherwise" do
    dir = Bourse.TempPath.new("bourse-secret-files", "")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf(dir) end)
    fifo = Path.join(dir, "fifo")
    {_, 0} = System.cmd("mkfifo", [fifo])
    File.write!(Path.join(dir, "huge"), String.duplicate("x", 100_000))
    File.write!(Path.join(dir, "long"), String.duplicate("x", 4097) <> "\n")
    File.write!(Path.join(dir, "empty"), "\n\r\n")
    # Refused at start whether a daemon answers or not (none does here).
    File.write!(Path.join(dir, "short"), "0123456789abcde\r\n")

    for {path, says} <- [
          {fifo, "not a regular file"},
          {"/dev/zero", "not a regular file"},
          {dir, "not a regular file"},
          {Path.join(dir, "huge"), "larger than 65536 bytes"},
          {Path.join(dir, "long"), "the secret is longer than 4096 bytes"},
          {Path.join(dir, "empty"), "the secret is empty"},
          {Path.join(dir, "short"), "the secret has 15 bytes, and a daemon's is at least 16"},
          {"/no/a\0b", "cannot read the daemon secret_file"},
          {"/" <> String.duplicate("x", 100_000),
           "secret_file must be a path of at most 4096 bytes"}
        ] do
      started = System.monotonic_time(:millisecond)
      message = assert_described(start({:daemon, "127.0.0.1:7000", secret_file: path}))
      assert message =~ says, message
      assert System.monotonic_time(:millisecond) - started < 2_000, path
    end
  end

  test "a Redis URL or a path that is not UTF-8 is refused or shown as text" do
    for url <- [
          <<"redis://127.0.0.1:1/", 0xFF>>,
          <<"unix:///tmp/", 0xFF>>,
          [<<"redis://h", 0xFF, ":1">>]
        ] do
      assert assert_described(start({:redis, url})) =~ "a Redis URL is UTF-8 text"
    end

    message = assert_described(start({:daemon, "127.0.0.1:7000", secret_file: <<"/no/", 0xFF>>}))
    assert String.valid?(message)
    assert message =~ ~S(secret_file <<47, 110, 111, 47, 255>>)

    # Control characters, as inspect/1 writes them: a message is one line.
    message = assert_described(start({:daemon, "127.0.0.1:7000", secret_file: "/no/a\nb"}))
    assert message =~ ~S(secret_file "/no/a\nb")

    for address <- ["h\0:7000", "h\n:7000", "h x:7000"] do
      assert assert_described(start({:daemon, address, allow_remote: true})) =~
               "daemon address must be"
    end
  end

  test "redis options" do
    for bad <- ["http://user:#{@secret}@host:6379", @huge, {@secret}, @long_list] do
      assert_described(start({:redis, bad}))
      assert_described(start({:redis, "redis://127.0.0.1:6379", prefix: bad}))
      assert_described(start({:redis, "redis://127.0.0.1:6379", redis_timeout_ms: bad}))
    end

    for bad <- [@huge, {@secret}, @long_list] do
      assert_described(start({:redis, "redis://127.0.0.1:6379", password_file: bad}))
    end

    assert_described(start({:redis, "redis://127.0.0.1:6379", [{@secret, 1}]}))

    assert assert_described(start({:redis, "redis://127.0.0.1:6379", no_such: 1})) =~
             "unknown redis option :no_such"
  end

  test "Limits" do
    for bad <- [@secret, @huge, @long_list, %{secret: @secret}] do
      assert_described(Limits.size(bad, 1000))
      assert_described(Limits.size(10, bad))
      assert_described(Limits.size(10, 1000, share: bad))
      assert_described(Limits.size(10, 1000, burst: bad))
      assert_described(Limits.from_binance_exchange_info(bad))
      assert_described(Limits.from_binance_exchange_info(%{"rateLimits" => [bad]}))

      entry = %{
        "rateLimitType" => "REQUEST_WEIGHT",
        "interval" => "MINUTE",
        "intervalNum" => 1,
        "limit" => bad
      }

      assert_described(Limits.from_binance_exchange_info(%{"rateLimits" => [entry]}))
      info = %{"rateLimits" => [%{entry | "limit" => 6000}]}
      assert_described(Limits.from_binance_exchange_info(info, exchange: {bad}))
    end

    # A duplicate entry is named, its type by its size unless it is a short name.
    entry = %{"rateLimitType" => @huge, "interval" => "SECOND", "intervalNum" => 1, "limit" => 5}

    assert assert_described(Limits.from_binance_exchange_info(%{"rateLimits" => [entry, entry]})) =~
             ~s(duplicate rateLimits entry {a binary of 10000000 bytes, 1, "SECOND"})
  end

  test "Exchange" do
    for bad <- [@secret, @huge, @long_list, %{counters: [%{secret: @secret}]}] do
      assert_described(Exchange.buckets(bad))
      assert_described(Exchange.buckets(:binance_spot, share: bad))
      assert_described(Exchange.buckets(:kraken_spot, tier: bad))
      assert_described(Exchange.buckets(:binance_spot, bad))
      assert_described(Exchange.profile(bad))
    end

    assert assert_described(Exchange.buckets(:binance_spot, no_such: 1)) =~
             "unknown option :no_such"
  end

  # An option is an atom: a credential made one was printed whole as "unknown options".
  test "an unknown option is named when it reads as a name, else described by its size" do
    key = {"ex", "k"}
    limit = %{capacity: 10, refill_per_sec: 1}
    name = :"option_messages_#{System.unique_integer([:positive])}"
    secret = [{String.to_atom(@secret), 1}]
    # A hex key of 32 characters reads as a name but for its digits.
    hex = [{:a3f9c2e1b4d5f6a7b8c9d0e1f2a3b4c5, 1}]

    for opts <- [secret, hex, [max_wait: 1]] do
      answers = [
        RateLimiter.wait_for_capacity(key, limit, 1, name, opts),
        RateLimiter.check_rates([{key, limit, 1}], name, opts),
        RateLimiter.observe_response("ex", "k", 200, [], name, opts),
        RateLimiter.start_link([name: name] ++ opts),
        start({:daemon, "127.0.0.1:7000", opts})
      ]

      for answer <- answers do
        message = assert_described(answer)
        if opts == secret, do: assert(message =~ "an atom of 18 bytes", message)
        if opts == hex, do: assert(message =~ "an atom of 32 bytes", message)
        if opts == [max_wait: 1], do: assert(message =~ ":max_wait", message)
      end
    end
  end

  test "a list of thousands of unknown or repeated options gets a short message" do
    key = {"ex", "k"}
    limit = %{capacity: 10, refill_per_sec: 1}
    name = :"option_messages_#{System.unique_integer([:positive])}"
    unknown = for i <- 1..5000, do: {:"opt_#{i}_#{String.duplicate("x", 200)}", 1}
    repeated = List.duplicate({:max_wait_ms, 1}, 2000)

    for opts <- [unknown, repeated, unknown ++ repeated] do
      for answer <- [
            RateLimiter.wait_for_capacity(key, limit, 1, name, opts),
            RateLimiter.check_rates([{key, limit, 1}], name, opts),
            RateLimiter.start_link([name: name] ++ opts)
          ] do
        assert {:error, %Error{type: :invalid_parameters, message: message}} = answer
        assert byte_size(message) < 400, "#{byte_size(message)} bytes"
      end
    end

    assert {:error, %Error{message: "name must be an atom" <> _}} =
             RateLimiter.start_link(name: :undefined)
  end

  test "an option given twice is refused as repeated; an unknown one as unknown" do
    key = {"ex", "k"}
    limit = %{capacity: 10, refill_per_sec: 1}
    name = :"option_messages_#{System.unique_integer([:positive])}"

    assert {:error, %Error{type: :invalid_parameters, message: message}} =
             RateLimiter.wait_for_capacity(key, limit, 1, name, max_wait_ms: 5000, max_wait_ms: 1)

    assert message == "options :max_wait_ms given more than once"

    assert {:error, %Error{message: ^message}} =
             RateLimiter.check_rates([{key, limit, 1}], name, max_wait_ms: 5, max_wait_ms: 5)

    assert {:error, %Error{type: :invalid_parameters, message: message}} =
             RateLimiter.start_link(name: name, name: :other, backend: :nif, backend: :nif)

    assert message == "start_link/1 options :name given more than once"

    assert {:error, %Error{message: message}} =
             RateLimiter.start_link(name: name, no_such: 1, no_such: 2, name: :other)

    assert message =~ ~r/^unknown start_link\/1 options :no_such; expected :name, /

    assert {:error, %Error{message: "daemon option :timeout given more than once"}} =
             RateLimiter.start_link(
               name: name,
               backend: {:daemon, "/tmp/none.sock", timeout: 1, timeout: 2}
             )

    assert {:error, %Error{message: "redis option :prefix given more than once"}} =
             RateLimiter.start_link(
               name: name,
               backend: {:redis, "redis://127.0.0.1:1", prefix: "a", prefix: "b"}
             )

    assert {:error, %Error{message: "option :body given more than once"}} =
             RateLimiter.observe_response("bybit", "k", 200, [], name, body: "{}", body: "{}")

    assert {:error, %Error{message: "option :share given more than once"}} =
             Bourse.RateLimiter.Exchange.buckets(:binance_spot, share: 0.8, share: 0.5)
  end

  test "booking slack and sweep interval are bounded by the core's longest setting, as the daemon's flags are" do
    day = Bourse.Native.bound(:max_setting_ms)
    assert day == 86_400_000

    for {option, min} <- [booking_slack_ms: 0, sweep_interval_ms: 1] do
      name = :"option_messages_#{System.unique_integer()}"

      assert {:error, %Error{message: message}} =
               RateLimiter.start_link([{:name, name}, {option, day + 1}])

      assert message == "#{option} must be an integer from #{min} to #{day}, got 86400001"
    end

    {output, 2} =
      System.cmd(
        RateLimiter.Backend.Port.executable(),
        ["--stdio", "--sweep-interval-ms", "86400001"],
        stderr_to_stdout: true
      )

    assert output =~ "86400000"
  end
end
