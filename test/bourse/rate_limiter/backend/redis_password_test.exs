defmodule Bourse.RateLimiter.Backend.RedisPasswordTest do
  # A Redis that asks for a password: the password written in the URL, as Redis clients
  # write it, reaches Redis as it is, and never the daemon's command line, which every
  # local user can read in /proc.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  import Bourse.BackendCase, only: [daemon_command_lines: 1, start_limiter: 1]

  alias Bourse.{Loopback, RateLimiter, RedisServer}

  unless RedisServer.installed?(), do: @moduletag(skip: "no redis-server (make deps installs it)")

  # `+` and `=` are plain characters of a URL's userinfo (a base64 secret has them).
  @password "s3+cr=t+pw"
  @limit %{capacity: 5, refill_per_sec: 0.001}

  # A redis-server asking for `@password`, on a free port and on a Unix socket; killed and its
  # socket file removed when the test ends.
  defp start_redis do
    port = Loopback.free_port()

    socket = Bourse.TempPath.new("bourse-redis", ".sock")

    server =
      Port.open({:spawn_executable, System.find_executable("redis-server")}, [
        :binary,
        args:
          ["--port", "#{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"] ++
            ["--unixsocket", socket, "--unixsocketperm", "700", "--requirepass", @password]
      ])

    {:os_pid, os_pid} = Port.info(server, :os_pid)

    on_exit(fn ->
      System.cmd("kill", ["-9", "#{os_pid}"], stderr_to_stdout: true)
      File.rm(socket)
    end)

    Loopback.wait_until(fn -> ready?(port) end, "redis-server answers PING", 10_000)
    Loopback.wait_until(fn -> File.exists?(socket) end, "redis-server listens", 10_000)
    %{port: port, socket: socket}
  end

  defp ready?(port) do
    with {:ok, socket} <- :gen_tcp.connect(~c"127.0.0.1", port, [:binary, active: false]) do
      :ok = :gen_tcp.send(socket, "AUTH #{@password}\r\nPING\r\n")
      reply = :gen_tcp.recv(socket, 0, 1_000)
      :gen_tcp.close(socket)
      match?({:ok, "+OK\r\n" <> _}, reply)
    else
      _ -> false
    end
  end

  # No piece of the password, as written or percent-encoded, is in `line`. Only pieces holding
  # a character outside base64url are looked for: the daemon's socket directory has a random
  # base64url name, which may hold "pw" or "s3" by chance.
  defp refute_password_shown(line) do
    for form <- [
          @password,
          URI.encode_www_form(@password),
          URI.encode(@password, &URI.char_unreserved?/1)
        ],
        piece <- pieces(form) do
      refute line =~ piece
    end
  end

  defp pieces(form) do
    for i <- 0..(byte_size(form) - 3),
        piece = binary_part(form, i, 3),
        piece =~ ~r/[^A-Za-z0-9_-]/,
        do: piece
  end

  test "a password in a redis:// URL is Redis's password, and never on the daemon's command line" do
    redis = start_redis()
    url = "redis://:#{@password}@127.0.0.1:#{redis.port}"
    name = start_limiter({:redis, url, redis_timeout_ms: 4_000})
    assert :ok = RateLimiter.check_rate({"binance", "tcp"}, @limit, 1, name)
    assert RateLimiter.get_cost({"binance", "tcp"}, 1_000, name) >= 0.99

    assert [line] = daemon_command_lines("127.0.0.1:#{redis.port}")
    refute_password_shown(line)
  end

  # A file holding `text`, owner-only, removed when the test ends.
  defp password_file(text) do
    path = Bourse.TempPath.new("bourse-redis-password")
    File.write!(path, text)
    File.chmod!(path, 0o600)
    on_exit(fn -> File.rm(path) end)
    path
  end

  test "a password_file holds Redis's password (its newline not part of it); the daemon's command line names the file, never the password" do
    redis = start_redis()
    path = password_file(@password <> "\n")
    url = "redis://127.0.0.1:#{redis.port}"
    name = start_limiter({:redis, url, password_file: path, redis_timeout_ms: 4_000})
    assert :ok = RateLimiter.check_rate({"binance", "file"}, @limit, 1, name)

    assert [line] = daemon_command_lines("127.0.0.1:#{redis.port}")
    assert line =~ path
    refute_password_shown(line)
  end

  test "a user named in the URL takes its password from the password_file" do
    redis = start_redis()
    {:ok, socket} = :gen_tcp.connect(~c"127.0.0.1", redis.port, [:binary, active: false])

    :ok =
      :gen_tcp.send(socket, "AUTH #{@password}\r\nACL SETUSER alice on >alice-pw ~* +@all\r\n")

    assert {:ok, "+OK\r\n+OK\r\n"} = :gen_tcp.recv(socket, 10, 2_000)
    :gen_tcp.close(socket)

    url = "redis://alice@127.0.0.1:#{redis.port}"
    name = start_limiter({:redis, url, password_file: password_file("alice-pw\n")})
    assert :ok = RateLimiter.check_rate({"binance", "alice"}, @limit, 1, name)
    assert_start_refused(url, password_file(@password), "it refused the password given")

    assert {:error, message} = RateLimiter.Backend.Redis.options(url, [])
    assert message =~ "names a user without a password"
  end

  test "a password_file that cannot be read, holds nothing, or holds a password Redis refuses fails the start, naming the file and not the password" do
    redis = start_redis()
    url = "redis://127.0.0.1:#{redis.port}"
    missing = Bourse.TempPath.new("bourse-no-such-password")

    for {path, why} <- [
          {missing, "cannot read #{missing}"},
          {password_file("\n"), "the secret is empty"},
          {password_file("wrong-secret-part"), "it refused the password given"}
        ] do
      assert_start_refused(url, path, why)
    end
  end

  test "a password in the URL and a password_file both, or a password_file that is no path, are refused before the daemon starts" do
    path = password_file(@password)

    for {url, file, why} <- [
          {"redis://:secret-part@127.0.0.1:6379", path, "given twice"},
          {"redis://127.0.0.1:6379", "", "password_file must be a path, got a binary of 0 bytes"},
          {"redis://127.0.0.1:6379", :file, "password_file must be a path, got :file"},
          {"redis://127.0.0.1:6379", "a\0b", "password_file must be a path of UTF-8 text"}
        ] do
      assert_start_refused(url, file, why)
    end
  end

  # A limiter given `url` and `password_file: file` does not start, saying `why`, and
  # nothing of a password.
  defp assert_start_refused(url, file, why) do
    assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
             RateLimiter.start_link(
               name: :redis_password_file_refused,
               backend: {:redis, url, password_file: file}
             )

    assert message =~ why
    refute message =~ "secret-part"
  end

  # A misconfiguration fails the start, rather than every call later.
  test "a password Redis refuses fails the start, named as refused, and not shown" do
    redis = start_redis()
    url = "redis://:wrong-secret-part@127.0.0.1:#{redis.port}"

    assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
             RateLimiter.start_link(name: :redis_wrong_password, backend: {:redis, url})

    assert message =~ "redis at 127.0.0.1:#{redis.port}: it refused the password given"
    refute message =~ "secret-part"
  end

  # A supervisor reports the start arguments of a child that failed to start: they showed
  # the URL with its password ("Start Call: Bourse.RateLimiter.start_link([name: ...,
  # backend: {:redis, "redis://:...@..."}])").
  test "a supervisor's report of a limiter that failed to start does not show the URL's password" do
    redis = start_redis()
    url = "redis://:wrong-secret-part@127.0.0.1:#{redis.port}"
    name = :"redis_supervised_#{System.unique_integer([:positive])}"
    Process.flag(:trap_exit, true)
    # Supervisor reports are SASL reports, which Elixir's Logger leaves out unless told.
    {:ok, %{config: config}} = :logger.get_handler_config(Logger)
    :ok = :logger.update_handler_config(Logger, :config, %{config | sasl: true})
    on_exit(fn -> :logger.update_handler_config(Logger, :config, config) end)

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        children = [{RateLimiter, name: name, backend: {:redis, url}}]

        assert {:error, {:shutdown, {:failed_to_start_child, ^name, reason}}} =
                 Supervisor.start_link(children, strategy: :one_for_one)

        assert %Bourse.Error{type: :invalid_parameters} = reason
      end)

    assert log =~ "Start Call: Bourse.RateLimiter.start_hidden(#Function<"
    refute log =~ "secret-part"
    # Options without a password are shown as they are.
    assert %{start: {RateLimiter, :start_link, _}} = RateLimiter.child_spec(name: name)
    plain = {:redis, ["redis://127.0.0.1:1", "redis://127.0.0.1:2"]}
    assert %{start: {RateLimiter, :start_link, _}} = RateLimiter.child_spec(backend: plain)
    # Refused options that may hold one are hidden too: start_link prints nothing of them.
    secret = "redis://:wrong-secret-part@127.0.0.1:1"

    for opts <- [
          [backend: :nif, backend: {:redis, secret}],
          %{backend: {:redis, secret}},
          [backend: {:redis, String.to_charlist(secret)}],
          [backend: {:redis, "redis://127.0.0.1:1", password: "wrong-secret-part"}]
        ] do
      assert %{start: {RateLimiter, :start_hidden, [_]}} = RateLimiter.child_spec(opts)
    end
  end

  # A restart is no first start: it must not fail the supervisor.
  test "a limiter restarted after its Redis's password changed starts, and answers :unavailable" do
    redis = start_redis()
    url = "redis://:#{URI.encode_www_form(@password)}@127.0.0.1:#{redis.port}"
    name = :"redis_rotated_#{System.unique_integer([:positive])}"
    {:ok, first} = RateLimiter.start_link(name: name, backend: {:redis, url})
    Process.unlink(first)
    assert :ok = RateLimiter.check_rate({"binance", "k"}, @limit, 1, name)

    {"OK\n", 0} = System.cmd("redis-cli", ~w(-p #{redis.port} --no-auth-warning -a #{@password}
        CONFIG SET requirepass another-password))

    ref = Process.monitor(first)
    Process.exit(Bourse.BackendCase.handle(name).pid, :kill)
    Process.exit(first, :kill)
    assert_receive {:DOWN, ^ref, :process, _, _}

    {:ok, second} = RateLimiter.start_link(name: name, backend: {:redis, url})
    on_exit(fn -> Process.exit(second, :kill) end)

    assert {:error, %Bourse.Error{type: :unavailable, message: message}} =
             RateLimiter.check_rate({"binance", "k"}, @limit, 1, name)

    assert message =~ "it refused the password given"
    refute_password_shown(message)
  end

  test "no password for a Redis that asks for one fails the start, saying where to give it" do
    redis = start_redis()
    url = "redis://127.0.0.1:#{redis.port}"

    assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
             RateLimiter.start_link(name: :redis_no_password, backend: {:redis, url})

    assert message =~ "redis at 127.0.0.1:#{redis.port}: it asks for a password"
    assert message =~ "redis://:PASSWORD@host:port"
  end

  test "a database the Redis does not have fails the start" do
    redis = start_redis()
    url = "redis://:#{URI.encode_www_form(@password)}@127.0.0.1:#{redis.port}/16"

    assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
             RateLimiter.start_link(name: :redis_no_database, backend: {:redis, url})

    assert message =~ "redis at 127.0.0.1:#{redis.port}: it has no database 16"
    refute_password_shown(message)
  end

  test "a password in a unix:// URL's query (?pass=, or a percent-encoded name such as ?%70ass=) is Redis's password, and never on the daemon's command line" do
    # Each with the rest of the query the daemon is given.
    for {query, kept} <- [{"pass=", ""}, {"db=0&%70ass=", "db=0"}] do
      redis = start_redis()
      url = "unix://#{redis.socket}?#{query}#{URI.encode_www_form(@password)}"
      name = start_limiter({:redis, url, redis_timeout_ms: 4_000})
      assert :ok = RateLimiter.check_rate({"binance", "unix"}, @limit, 1, name)

      assert [line] = daemon_command_lines(redis.socket)
      assert line =~ kept
      refute_password_shown(line)
    end
  end

  test "a password that is no UTF-8 text, or holds NUL, once decoded is refused, and nothing of it is shown" do
    for url <- [
          "redis://:pw%FFsecret-part@127.0.0.1:6379",
          "redis://:%00secret-part@127.0.0.1:6379"
        ] do
      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               RateLimiter.start_link(name: :redis_password_not_utf8, backend: {:redis, url})

      assert message =~ "UTF-8 text without NUL"
      refute message =~ "secret"
      refute message =~ "115, 101, 99"
    end
  end

  test "a password in a query field the client would not read, or not percent-encoded, is refused before the daemon starts" do
    for url <- [
          "redis://127.0.0.1:6379/?password=secret-part",
          "redis://127.0.0.1:6379/0?pass=secret-part",
          "unix:///tmp/r.sock?password=secret-part",
          # The client reads a field's name percent-decoded: "p%61ss" is "pass".
          "unix:///tmp/r.sock?%70assword=secret-part",
          "unix:///tmp/r.sock?db=1&passw%6Frd=secret-part",
          "unix:///tmp/r.sock?passw%6frd=secret-part",
          "redis://127.0.0.1:6379/?p%61ss=secret-part",
          "redis://127.0.0.1:6379/?%70%61%73%73%77%6F%72%64=secret-part",
          # ... in any letter case (the client reads none of these).
          "unix:///tmp/r.sock?PASS=secret-part",
          "unix:///tmp/r.sock?Password=secret-part",
          "redis://127.0.0.1:6379/?PASSWORD=secret-part",
          "unix:///tmp/r.sock?%50ass=secret-part",
          ["redis://127.0.0.1:1", "redis://127.0.0.1:2/?%70ass=secret-part"],
          ["redis://127.0.0.1:1", "redis://127.0.0.1:2/?password=secret-part"],
          "redis://:pw/secret-part@127.0.0.1:6379",
          "redis://:pw?secret-part@127.0.0.1:6379",
          "redis://:pw#secret-part@127.0.0.1:6379",
          ["redis://127.0.0.1:1", "redis://:pw/secret-part@127.0.0.1:2"],
          # A URL parser drops tabs and newlines: "pa\tss" would be read as "pass".
          "unix:///tmp/r.sock?pa\tss=secret-part",
          "redis://:secret-part@127.0.0.1:6379\n",
          "unix://:secret-part@/tmp/r.sock",
          # Without "//" after the scheme, or a "://" further on, the URL's text is not
          # cut where the client reads its parts.
          "unix:/run/redis.sock?pass=secret-part",
          "unix:/tmp/x://:secret-part@y.sock",
          "redis:secret-part",
          "unix:///run/redis.sock ?pass=secret-part",
          "unix:///run/redis.sock#?pass=secret-part",
          # A user name alone authenticates nothing: most often a password without its
          # colon.
          "redis://secret-part@127.0.0.1:6379",
          "REDIS://secret-part@127.0.0.1:6379/0",
          ["redis://127.0.0.1:1", "redis://secret-part@127.0.0.1:2"],
          # ... or with its colon on the wrong side; a unix:// URL's userinfo is not read.
          "redis://secret-part:@127.0.0.1:6379",
          ["redis://secret-part:@127.0.0.1:1"],
          "unix://secret-part@localhost/tmp/r.sock",
          "unix://secret-part@/tmp/r.sock",
          "UNIX://secret-part@/tmp/r.sock"
        ] do
      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               RateLimiter.start_link(name: :redis_password_in_query, backend: {:redis, url})

      assert message =~ "the Redis URL's query must not hold a password" or
               message =~ ~s(has an "@" after its host) or
               message =~ "redis cluster seeds must be a list of 1 to" or
               message =~ "cannot contain spaces or control characters" or
               message =~ "redis URL must be a string" or
               message =~ "has no fragment" or
               message =~ "takes its password in its query" or
               message =~ "names a user without a password"

      refute message =~ "secret"
      refute message =~ "bourse_daemon refused"
    end
  end

  test "the options keep the password apart from the URL, decoded as the daemon's client decodes it" do
    alias Bourse.RateLimiter.Backend.Redis

    for {url, without, password} <- [
          {"redis://:p%2Bw+x@h:1/2", "redis://h:1/2", "p+w+x"},
          {"redis://user:pw@h:1", "redis://user@h:1", "pw"},
          {"unix:///tmp/r.sock?db=2&pass=a+b%21", "unix:///tmp/r.sock?db=2", "a b!"},
          {"unix:///tmp/r.sock?pass=x", "unix:///tmp/r.sock", "x"},
          {"unix:///tmp/r.sock?db=2&pass=x&b", "unix:///tmp/r.sock?db=2&b", "x"},
          {"unix:///tmp/r.sock??db=3&pass=x", "unix:///tmp/r.sock??db=3", "x"},
          # A field's name read percent-decoded, as the client reads it: "%70ass" is "pass";
          # "pa+ss" ("pa ss") and "%2570ass" ("%70ass") are not ("%50ass", "Pass", is
          # refused: above).
          {"unix:///tmp/r.sock?db=2&%70ass=x", "unix:///tmp/r.sock?db=2", "x"},
          {"unix:///tmp/r.sock?p%61s%73=a+b&db=2", "unix:///tmp/r.sock?db=2", "a b"},
          {"unix:///tmp/r.sock?%70%61%73%73=x", "unix:///tmp/r.sock", "x"},
          {"unix:///tmp/r.sock?pa+ss=y&%2570ass=z", "unix:///tmp/r.sock?pa+ss=y&%2570ass=z", nil},
          # The rest of the URL as given, for the daemon to judge: rebuilt from its parsed
          # parts, a malformed host or port changed (to "fe80", or port 6391), and the
          # password went there.
          {"redis://:pw@[fe80::1%25lo]:6392", "redis://[fe80::1%25lo]:6392", "pw"},
          {"redis://:pw@127.0.0.1:6391x", "redis://127.0.0.1:6391x", "pw"},
          {"redis://a@b:pw@h:1", "redis://a@b@h:1", "pw"},
          # An empty userinfo names nobody.
          {"redis://@h:1", "redis://@h:1", nil},
          {["redis://a:1", "redis://:first@b:2", "redis://:second@c:3"],
           ["redis://a:1", "redis://b:2", "redis://c:3"], "first"}
        ] do
      assert {:ok, opts} = Redis.options(url, [])
      assert {opts[:url], opts[:password]} == {without, password}, inspect(url)
    end
  end
end
