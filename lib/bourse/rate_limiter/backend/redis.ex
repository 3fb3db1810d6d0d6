defmodule Bourse.RateLimiter.Backend.Redis do
  @moduledoc """
  `backend: {:redis, url}`: the buckets live in Redis, shared by every limiter, on any
  machine, that uses the same Redis server and key prefix. `backend: {:redis, [url, ...]}`,
  a list of seed nodes, means a Redis Cluster (even with one seed); a seed that is a Redis
  server without cluster support fails the start with `:invalid_parameters`.

      {Bourse.RateLimiter, name: MyApp.Limiter, backend: {:redis, "redis://10.0.0.5:6379"}}
      {Bourse.RateLimiter,
       name: MyApp.Limiter,
       backend: {:redis, ["redis://10.0.0.5:7000", "redis://10.0.0.6:7000"]}}
      {Bourse.RateLimiter,
       name: MyApp.Limiter,
       backend: {:redis, "redis://10.0.0.5:6379/2", prefix: "bots", redis_timeout_ms: 500},
       assume_busy_at_start: true}

  The limiter runs `bourse_daemon --stdio --redis URL` as its port, exactly as
  `Bourse.RateLimiter.Backend.Port` does (same connection process, pipelining, restarts):
  only the daemon's storage differs. Each check is one atomic script in Redis, timed by
  the Redis server's clock, so the machines' own clocks do not matter and a check over
  several buckets pays on all or none whatever the other machines do (docs/PROTOCOL.md,
  "Redis").

  A password in the URL (`redis://:secret@host:6379`, percent-encoded, or
  `unix:///path?pass=secret`, a field's name read percent-decoded as the daemon's client
  reads it: `%70ass=` is `pass=`) reaches the daemon in its environment
  (`BOURSE_REDIS_PASSWORD`), never on its command line (a cluster has one password: the
  first seed's that holds one). A URL that could carry it there otherwise is refused with
  `:invalid_parameters`, without showing it: a password elsewhere (`?password=`,
  `?p%61ssword=`, a `pass` or `password` field in another letter case such as `?PASS=`,
  any `unix://` userinfo), a user name without a password
  (`redis://NAME@host` or `redis://NAME:@host`, which authenticate nothing: most often a
  password missing its colon, or with the colon on the wrong side) unless `:password_file`
  gives its password, spaces or control
  characters, a fragment, an `@` after the host (percent-encode `/`, `?` and `#` in a
  password), no `//` after the scheme. TLS (`rediss://`) is not supported: reach a Redis
  that requires it through a local TLS tunnel. Redis key names hold keyed fingerprints of credentials, never API keys
  (docs/PROTOCOL.md, "Redis"); set `BOURSE_REDIS_KEY_SECRET` in the VM's environment to
  key them with a secret shared by every limiter on that Redis.

  Options of `{:redis, url, opts}`:

    * `:prefix` – every Redis key starts with it (default `"bourse"`); limiters share
      buckets only with the same prefix;
    * `:redis_timeout_ms` – the longest wait for Redis per command (default 1000); a call
      told `:unavailable` by then pays nothing. Callers wait for the daemon itself at most
      four times this, and at least 5 s;
    * `:password_file` – a file holding the Redis password (a trailing newline is not part
      of it), instead of one in the URL (the URL may name its ACL user,
      `redis://USER@host:port`): the daemon reads it at each start
      (`--redis-password-file`), so neither the limiter's options nor its state hold the
      password. A file it cannot read, or that holds nothing or no UTF-8 text, fails the
      start with `:invalid_parameters`, naming the file.

  The limiter's `:booking_slack_ms` applies to its daemon (`:sweep_interval_ms` does not:
  keys expire by their TTL, see docs/PROTOCOL.md); with
  `:assume_busy_at_start`, a bucket new to Redis within its fill time after the limiter
  started, or after its exchange's state began in Redis if later, starts as if empty then,
  so a Redis that lost its data never hands out a fresh burst.

  ## When Redis is down

  Nothing is admitted: calls answer `{:error, %Bourse.Error{type: :unavailable}}` within
  the Redis timeout, never hang, and work again as soon as Redis answers (the daemon
  reconnects by itself). The limiter starts even while Redis is down; a Redis that answers
  at start and refuses the limiter (a password it does not take or asks for, a user that
  may not run scripts, no database of the URL's number, a `maxmemory` with a policy that
  evicts keys, a single server given as a list of cluster seeds) fails the start with
  `:invalid_parameters`, naming why (within `:redis_timeout_ms`, at most 1 s).

  ## Redis Cluster

  Every key of one exchange carries one hash tag, so it lives in one slot: each check runs
  on the master serving it, atomically, whatever the number of buckets of that exchange it
  checks. A `check_rates/3` over buckets of several exchanges would span slots: it is
  refused with `:invalid_parameters` rather than split. The daemon follows the cluster as
  slots move (`MOVED`, `ASK`, `TRYAGAIN` retried within `:redis_timeout_ms`).

  While no master serves a slot (a master died and its replica has not yet taken over),
  checks answer `:unavailable` within `:redis_timeout_ms` and nothing is admitted.
  Replication is asynchronous: a replica that takes over may lack the master's last
  writes, so tokens paid just before the failover can be spent again, at most one capacity
  per bucket. With `assume_busy_at_start: true` a bucket whose master changed since it
  was last paid starts over as if empty at the change, so a failover never hands out more
  than the bound (docs/PROTOCOL.md, "Redis Cluster").
  """

  use Bourse.RateLimiter.Backend.Protocol

  alias Bourse.{Error, Native}
  alias Bourse.RateLimiter.Backend.Port
  alias Bourse.RateLimiter.Options

  @default_prefix "bourse"
  @default_redis_timeout_ms 1_000
  @schemes ~w(redis unix)
  @max_seeds 64

  @impl true
  def attach(previous, opts) do
    redis = Keyword.fetch!(opts, :backend_opts)

    servers =
      case redis[:url] do
        url when is_binary(url) -> ["--redis", url]
        seeds -> Enum.flat_map(seeds, &["--redis-cluster", &1])
      end

    password_file = if path = redis[:password_file], do: ["--redis-password-file", path], else: []

    redis_args =
      servers ++
        password_file ++
        [
          "--redis-prefix",
          redis[:prefix],
          "--redis-timeout-ms",
          Integer.to_string(redis[:redis_timeout_ms])
        ]

    env =
      if password = redis[:password],
        do: [{~c"BOURSE_REDIS_PASSWORD", String.to_charlist(password)}],
        else: []

    # The daemon reads a request until three quarters of its caller's wait, and its script
    # may run until three quarters of the Redis timeout after that: callers that wait four
    # Redis timeouts are told how every request they sent ended, never :unavailable for one
    # that pays later.
    # The buckets stay in Redis when the daemon is started again: it starts as the first
    # one did, not assuming every bucket busy (which would empty them for every limiter).
    opts =
      Keyword.merge(opts,
        env: env,
        timeout: 4 * redis[:redis_timeout_ms],
        table_outlives_daemon: true
      )

    Port.run_daemon(previous, redis_args, opts)
  end

  # The password goes to the daemon in its environment, never on its command line (which
  # every local user can read in /proc): a redis:// URL's userinfo, percent-encoded (a `+`
  # is a plus), or the `pass` field of a unix:// URL's query, its name and value
  # form-encoded (`%70ass` is `pass`), as the daemon's Redis client reads each. It is cut
  # out of the URL's text, which is otherwise left as given (rebuilt from its parsed
  # parts, a malformed host or port could change, and the password go elsewhere).
  defp split_password(url) do
    [scheme, rest] = String.split(url, "://", parts: 2)

    if String.downcase(scheme) == "unix",
      do: split_query_password(url),
      else: split_userinfo_password(scheme, rest, url)
  end

  defp split_userinfo_password(scheme, rest, url) do
    {authority, tail} = split_at_first(rest, ["/", "?", "#"])

    with [_ | _] = ats <- :binary.matches(authority, "@"),
         {at, 1} = List.last(ats),
         <<userinfo::binary-size(at), "@", host::binary>> = authority,
         [user, password] <- String.split(userinfo, ":", parts: 2) do
      user = if user == "", do: "", else: user <> "@"
      {scheme <> "://" <> user <> host <> tail, decoded(password, &URI.decode/1)}
    else
      _ -> {url, nil}
    end
  end

  defp split_query_password(url) do
    case split_at_first(url, ["?", "#"]) do
      {before, "?" <> query_and_fragment} ->
        {query, fragment} = split_at_first(query_and_fragment, ["#"])
        split_query_password(url, before, String.split(query, "&"), fragment)

      _no_query ->
        {url, nil}
    end
  end

  defp split_query_password(url, before, fields, fragment) do
    {passwords, kept} = Enum.split_with(fields, &(field_name(&1) == "pass"))

    case passwords do
      [] ->
        {url, nil}

      _ ->
        query = if kept == [], do: "", else: "?" <> Enum.join(kept, "&")
        password = passwords |> List.last() |> String.split("=", parts: 2) |> Enum.at(1, "")
        {before <> query <> fragment, decoded(password, &URI.decode_www_form/1)}
    end
  end

  defp field_name(field),
    do: field |> String.split("=", parts: 2) |> hd() |> decoded(&URI.decode_www_form/1)

  # A malformed percent-encoding is `:malformed`, refused by `utf8_password/1`.
  defp decoded(text, decode) do
    decode.(text)
  rescue
    ArgumentError -> :malformed
  end

  # `text` cut before the first of `separators`: `{before, from_it_on}`.
  defp split_at_first(text, separators) do
    case :binary.match(text, separators) do
      {at, _} -> {binary_part(text, 0, at), binary_part(text, at, byte_size(text) - at)}
      :nomatch -> {text, ""}
    end
  end

  @impl true
  def options([url]), do: options(url, [])
  def options([url, opts]), do: options(url, opts)
  def options(_args), do: {:error, "backend :redis takes {:redis, url} or {:redis, url, opts}"}

  @doc """
  Checks the URL (or the cluster's seed URLs) and the options of `{:redis, url, opts}`;
  returns what `attach/2` expects in `:backend_opts`, or `{:error, message}`: the URL
  without its password, and the password apart (`:password`, which the limiter's crash
  reports leave out).
  """
  @spec options(term(), term()) :: {:ok, keyword()} | {:error, String.t()}
  def options(url, opts) do
    with :ok <- known_options(opts),
         {:ok, url} <- url(url),
         {:ok, prefix} <- prefix(Keyword.get(opts, :prefix, @default_prefix)),
         {:ok, timeout} <-
           redis_timeout(Keyword.get(opts, :redis_timeout_ms, @default_redis_timeout_ms)),
         :ok <- no_bare_user(url, Keyword.has_key?(opts, :password_file)),
         {url, password} = without_password(url),
         :ok <- no_password_left(url),
         :ok <- utf8_password(password),
         {:ok, password_file} <- password_file(Keyword.fetch(opts, :password_file), password) do
      {:ok,
       url: url,
       password: password,
       password_file: password_file,
       prefix: prefix,
       redis_timeout_ms: timeout}
    end
  end

  # A path the daemon reads the password from, on its command line (UTF-8 text without
  # NUL); one password, from the file or from the URL.
  defp password_file(:error, _password), do: {:ok, nil}

  defp password_file({:ok, path}, nil) do
    with {:ok, path} <- Options.secret_path(:password_file, path) do
      if String.valid?(path) and not String.contains?(path, <<0>>),
        do: {:ok, path},
        else: {:error, "password_file must be a path of UTF-8 text without NUL"}
    end
  end

  defp password_file({:ok, path}, _password) when is_binary(path) and path != "",
    do: {:error, "the Redis password is given twice: in the URL and in password_file"}

  defp password_file({:ok, other}, _password), do: Options.secret_path(:password_file, other)

  # What is left of the URL goes on the daemon's command line: a password field its
  # Redis client would not read (`password=`, `pass=` in a redis:// URL, either in any
  # letter case; names form-decoded, as the daemon judges them) is refused here, before the
  # command line is written.
  defp no_password_left(seeds) when is_list(seeds),
    do: seeds |> Enum.map(&no_password_left/1) |> Enum.find(:ok, &(&1 != :ok))

  defp no_password_left(url) do
    fields =
      case URI.parse(url) do
        %URI{query: query} when is_binary(query) -> query |> URI.query_decoder() |> Enum.to_list()
        _ -> []
      end

    if Enum.any?(fields, &(String.downcase(elem(&1, 0)) in ["pass", "password"])),
      do:
        {:error,
         "the Redis URL's query must not hold a password: give it as redis://:PASSWORD@host:port " <>
           "(or pass=PASSWORD in a unix:// URL's query)"},
      else: :ok
  rescue
    ArgumentError -> :ok
  end

  # A redis:// URL's userinfo that names a user without a password (no colon, or nothing
  # after it) authenticates nothing (a client sends AUTH only with a password) and would
  # go on the command line: most often a password without its colon, or with the colon on
  # the wrong side, so it is refused, and not shown.
  # A user alone (`NAME@`) takes its password from the password file, if one is given.
  defp no_bare_user(seeds, password_file?) when is_list(seeds),
    do: seeds |> Enum.map(&no_bare_user(&1, password_file?)) |> Enum.find(:ok, &(&1 != :ok))

  defp no_bare_user(url, password_file?) do
    bare = if password_file?, do: [[""]], else: [[], [""]]
    [scheme, rest] = String.split(url, "://", parts: 2)
    {authority, _tail} = split_at_first(rest, ["/", "?", "#"])

    with "redis" <- String.downcase(scheme),
         [_ | _] = ats <- :binary.matches(authority, "@"),
         {at, 1} = List.last(ats),
         [user | password] when user != "" <-
           String.split(binary_part(authority, 0, at), ":", parts: 2),
         true <- password in bare do
      {:error,
       "the Redis URL names a user without a password (not shown): a password is " <>
         "written after a colon, redis://:PASSWORD@host:port or " <>
         "redis://USER:PASSWORD@host:port, or given in password_file:"}
    else
      _ -> :ok
    end
  end

  # Redis clients take passwords of text, and an environment variable (where the daemon
  # reads it) holds no NUL; nothing of the password is shown.
  defp utf8_password(password) do
    if password == nil or
         (is_binary(password) and String.valid?(password) and
            not String.contains?(password, <<0>>)),
       do: :ok,
       else:
         {:error, "the Redis password in the URL must be percent-encoded UTF-8 text without NUL"}
  end

  # One password for the whole cluster: the first seed's that has one.
  defp without_password(url) when is_binary(url), do: split_password(url)

  defp without_password(seeds) do
    split = Enum.map(seeds, &split_password/1)
    {Enum.map(split, &elem(&1, 0)), Enum.find_value(split, &elem(&1, 1))}
  end

  @doc false
  # The options of `{:redis, url, opts}`.
  @spec option_names() :: [atom()]
  def option_names, do: [:prefix, :redis_timeout_ms, :password_file]

  defp known_options(opts) do
    Options.known_options(
      opts,
      "redis option",
      option_names(),
      ":prefix, :redis_timeout_ms or :password_file"
    )
  end

  defp url(seeds) when is_list(seeds), do: seeds(seeds, 0, [])

  defp url(url) when is_binary(url) do
    case URI.parse(url) do
      %URI{scheme: scheme} = uri when scheme in @schemes ->
        cond do
          control_characters?(url) -> {:error, control_characters()}
          not String.valid?(url) -> {:error, not_utf8()}
          not String.starts_with?(String.downcase(url), scheme <> "://") -> {:error, bad_url(url)}
          uri.fragment != nil -> {:error, "a Redis URL has no fragment (\"#...\")"}
          at_past_host?(uri) -> {:error, at_past_host()}
          unix_userinfo_password?(uri) -> {:error, unix_userinfo_password()}
          true -> {:ok, url}
        end

      _ ->
        {:error, bad_url(url)}
    end
  end

  defp url(other), do: {:error, bad_url(other)}

  # A cluster's seeds: 1 to @max_seeds redis:// URLs (a proper list).
  defp seeds([], count, seeds) when count > 0, do: {:ok, Enum.reverse(seeds)}

  defp seeds([seed | rest], count, seeds) when is_binary(seed) and count < @max_seeds do
    case URI.parse(seed) do
      %URI{scheme: scheme, host: host} = uri
      when scheme == "redis" and host not in [nil, ""] ->
        cond do
          control_characters?(seed) -> {:error, control_characters()}
          not String.valid?(seed) -> {:error, not_utf8()}
          at_past_host?(uri) -> {:error, at_past_host()}
          true -> seeds(rest, count + 1, [seed | seeds])
        end

      _ ->
        {:error, bad_seeds()}
    end
  end

  defp seeds(_, _, _), do: {:error, bad_seeds()}

  # An "@" after the host of a redis:// URL: a password holding "/", "?" or "#" that was
  # not percent-encoded ended the host early, and the URL (password and all) would reach
  # the daemon's command line. (A unix:// URL's path may hold "@"; its password is a
  # query field.)
  defp at_past_host?(%URI{scheme: "redis"} = uri),
    do: String.contains?("#{uri.path}?#{uri.query}##{uri.fragment}", "@")

  defp at_past_host?(_uri), do: false

  # A URL parser drops tabs and newlines wherever they are (a field named "pa\tss" would be
  # read as "pass") and trims spaces at its ends (which cutting the password out could
  # make of inner ones): no space or control character goes through.
  defp control_characters?(url), do: String.match?(url, ~r/[\x00-\x20\x7f]/)

  defp control_characters,
    do:
      "a Redis URL cannot contain spaces or control characters (NUL, tab, newline, ...): " <>
        "percent-encode them"

  defp not_utf8, do: "a Redis URL is UTF-8 text: percent-encode any other byte"

  # The daemon's client reads a unix:// URL's password from its query only, and nothing of
  # its userinfo (which would go on the command line).
  defp unix_userinfo_password?(%URI{scheme: "unix", userinfo: userinfo}) when is_binary(userinfo),
    do: userinfo != ""

  defp unix_userinfo_password?(_uri), do: false

  defp unix_userinfo_password,
    do: "a unix:// Redis URL takes its password in its query: unix:///PATH?pass=PASSWORD"

  defp at_past_host do
    "a Redis URL has an \"@\" after its host: percent-encode \"/\", \"?\" and \"#\" in " <>
      "its password (redis://:PASSWORD@HOST:PORT)"
  end

  defp bad_seeds do
    "redis cluster seeds must be a list of 1 to #{@max_seeds} URLs " <>
      "\"redis://HOST:PORT\" (TLS, rediss://, is not supported)"
  end

  defp bad_url(url) do
    "redis URL must be a string \"redis://HOST:PORT[/DB]\" or \"unix:///PATH\" " <>
      "(TLS, rediss://, is not supported), got #{Error.describe(url)}"
  end

  defp prefix(prefix) when is_binary(prefix) do
    if prefix =~ ~r/\A[A-Za-z0-9_.:-]{1,64}\z/,
      do: {:ok, prefix},
      else: {:error, bad_prefix(prefix)}
  end

  defp prefix(other), do: {:error, bad_prefix(other)}

  defp bad_prefix(prefix),
    do: "redis prefix must be 1 to 64 of A-Z a-z 0-9 _ - . :, got #{Error.describe(prefix)}"

  defp redis_timeout(ms) do
    max = Native.bound(:max_store_timeout_ms)

    if is_integer(ms) and ms in 1..max,
      do: {:ok, ms},
      else:
        {:error,
         "redis_timeout_ms must be an integer from 1 to #{max}, got #{Error.describe(ms)}"}
  end
end
