defmodule Bourse.RateLimiter.Backend.Daemon do
  @moduledoc """
  `backend: {:daemon, address}`: the buckets live in a shared `bourse_daemon` server, one
  limiter for every OS process, BEAM node and program (Python, ...) on the host that
  connects to it.

      bourse_daemon --listen 127.0.0.1:7878 --assume-busy-at-start

      {Bourse.RateLimiter, name: MyApp.Limiter, backend: {:daemon, "127.0.0.1:7878"}}
      {Bourse.RateLimiter, name: MyApp.Limiter, backend: {:daemon, {:unix, "/run/bourse.sock"}}}

  `address` is `"IP:PORT"` (`"127.0.0.1:7878"`, `"[::1]:7878"`, `"localhost:7878"`),
  `{ip_tuple, port}` or `{:unix, path}`. Requests travel in clear, so only loopback
  addresses and Unix sockets are accepted unless the backend is given as
  `{:daemon, address, allow_remote: true}` (then host names are accepted too). Other
  options of that form: `timeout: ms`, how long a call waits for its answer (default
  #{5_000}, at most a day), `secret_file: path`, and `daemon_uid: uid`, the user a
  daemon at a Unix socket runs as (default: this program's user).

  ## Access

  A Unix socket is owner-only (the daemon's `--socket-mode 660` lets its group in too).
  On Linux the client asks the kernel which user listens at the socket (`SO_PEERCRED`)
  and talks only to a daemon run as `daemon_uid:` (by default its own user): another
  user listening at that path first is refused (`:unavailable`, naming that user's uid),
  never sent a key. Give `daemon_uid:` when the daemon runs as a user of its own (a
  service user whose group the socket lets in), and keep the socket in a directory that
  only the daemon's user may write (`/run/bourse/`, say). Elsewhere the client takes
  whatever listens at the path for the daemon.
  Over TCP the daemon serves nothing but `hello` until the client proves the shared
  secret it was started with: the HMAC-SHA256 of a nonce from the daemon's hello; the
  daemon then proves it in turn, over a challenge of the client's, so that a program
  without it listening on that port is refused (`:unavailable`, "another program may be
  listening there"), never believed. The secret never travels. The limiter reads the
  secret from `secret_file:` (a regular file of at most 64 KiB, as the daemon reads its
  own; a trailing newline is ignored; a TCP daemon's secret is 16 to 4096 bytes) or else
  from the environment variable `BOURSE_DAEMON_SECRET`, when it connects; a daemon that
  answers at start and refuses that secret (or asks for one when none was given) fails
  its start with `:invalid_parameters`, unless it is a restart within 5 s with the same
  address and secret (a limiter restarted by its supervisor then answers `:unavailable`). Answers never hold an API key: `busiest`
  shows fingerprints (`Bourse.Fingerprint`).

  One connection per limiter carries the requests of every calling process, pipelined
  (length-prefixed external terms after a JSON `hello`, see
  `Bourse.RateLimiter.Backend.Protocol`); each calling
  process owns its own bookings, distinct from those of every other client of the daemon.

  ## When the daemon is down or restarts

  Calls made while the connection is down, and calls in flight when it breaks, answer
  `{:error, %Bourse.Error{type: :unavailable}}` at once: nothing is admitted without the
  shared table, and nothing hangs (a call waits at most its timeout, or, handed its answer
  at that moment, until it comes). The connection is
  retried with backoff (50 ms doubling to 2 s) and calls work again as soon as it is back.
  A connection that goes silent without closing (a proxy or firewall that lost the flow)
  is found out: once a call got no answer within its timeout, a `hello` goes out, and if
  nothing is answered for another timeout (at least 1 s), new calls answer `:unavailable`
  at once, unsent, and the connection is made again once the calls written on it have
  reached their deadlines (a stopped daemon that resumes may still run those).
  If the daemon is not up when the limiter starts, the limiter starts anyway and connects
  when it can; connecting and the daemon's hello take at most the `timeout:` option, or
  1 s when that is shorter (a daemon that accepts and never answers, a stopped one, holds
  the start that long).

  A restarted daemon starts with an empty table while the exchange still counts what was
  spent before. Run it with `--assume-busy-at-start` (under a supervisor such as systemd):
  its buckets then start as if they had been empty at start, so a restart never hands out
  a fresh burst. A limiter that reconnects to a daemon that restarted without that flag
  (its in-memory table is another) logs a warning.

  The limiter's `:booking_slack_ms` goes with each of its waiting checks, so its bookings
  lapse by its own slack (the daemon's `--booking-slack-ms` is the slack of clients that
  name none). With `assume_busy_at_start: true`, each connection's hello names the
  limiter's start: a bucket new to the daemon starts as if empty then (or at the daemon's
  own start with `--assume-busy-at-start`, if later); a bucket the daemon already held is
  left as it is. Sweeps are the daemon's: the limiter's `:sweep_interval_ms` does not
  apply.
  """

  use Bourse.RateLimiter.Backend.Protocol

  alias Bourse.{Error, Native}
  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Options

  @default_timeout 5_000
  @options [:allow_remote, :timeout, :secret_file, :daemon_uid]
  # A socket address holds 108 bytes of path, the last one its NUL (sockaddr_un).
  @max_unix_path_bytes 107
  # uid_t is 32 bits; its largest value means "no user".
  @max_uid 4_294_967_294

  @typedoc "Where the daemon listens."
  @type address ::
          String.t() | {:inet.ip_address(), :inet.port_number()} | {:unix, Path.t()}

  @impl true
  def attach(previous, opts) do
    daemon = Keyword.fetch!(opts, :backend_opts)

    with {:ok, secret} <- secret(daemon[:secret_file], least_secret_bytes(daemon[:address])) do
      Connection.attach(previous, {:socket, daemon[:address]},
        timeout: daemon[:timeout],
        secret: secret,
        booking_slack_ms: opts[:booking_slack_ms],
        assume_busy_at_start: opts[:assume_busy_at_start]
      )
    end
  end

  # A TCP daemon's secret is at least the core's `min_secret_bytes`; a Unix socket's
  # daemon asks for none.
  defp least_secret_bytes({:tcp, _host, _port}), do: Native.bound(:min_secret_bytes)
  defp least_secret_bytes(_unix), do: 1

  # From the environment, as the daemon reads it: unset or empty is none.
  defp secret(nil, least) do
    case System.get_env("BOURSE_DAEMON_SECRET", "") do
      "" -> {:ok, nil}
      secret -> usable(trim_line_ends(secret), least, "BOURSE_DAEMON_SECRET")
    end
  end

  # As the daemon reads its own (`--secret-file`): a regular file of a few bytes, never a
  # FIFO or device waited on or read without end; a trailing newline is not part of it.
  defp secret(path, least) do
    max_file = Native.bound(:max_secret_file_bytes)

    with {:ok, %File.Stat{type: :regular, size: size}} when size <= max_file <- File.stat(path),
         {:ok, bytes} when byte_size(bytes) <= max_file <- read_at_most(path, max_file + 1) do
      usable(trim_line_ends(bytes), least, "the daemon secret_file #{Error.path(path)}")
    else
      {:ok, %File.Stat{type: :regular}} -> cannot_read(path, "larger than #{max_file} bytes")
      {:ok, %File.Stat{}} -> cannot_read(path, "not a regular file")
      {:ok, _more} -> cannot_read(path, "larger than #{max_file} bytes")
      {:error, reason} -> cannot_read(path, :file.format_error(reason))
    end
  end

  defp read_at_most(path, bytes) do
    case File.open(path, [:read, :binary], &IO.binread(&1, bytes)) do
      {:ok, :eof} -> {:ok, ""}
      {:ok, {:error, reason}} -> {:error, reason}
      result -> result
    end
  end

  defp trim_line_ends(bytes) do
    case :binary.last(<<0, bytes::binary>>) do
      end_of_line when end_of_line in [?\n, ?\r] ->
        trim_line_ends(binary_part(bytes, 0, byte_size(bytes) - 1))

      _other ->
        bytes
    end
  end

  # A secret of the length a daemon takes (at least `least` bytes), refused at start,
  # whether the daemon answers or not.
  defp usable(secret, least, source) do
    most = Native.bound(:max_secret_bytes)

    why =
      cond do
        secret == "" ->
          "the secret is empty"

        byte_size(secret) < least ->
          "the secret has #{byte_size(secret)} bytes, and a daemon's is at least #{least}"

        byte_size(secret) > most ->
          "the secret is longer than #{most} bytes"

        true ->
          nil
      end

    if why, do: {:error, Error.invalid("#{source}: #{why}")}, else: {:ok, secret}
  end

  defp cannot_read(path, why),
    do: {:error, Error.invalid("cannot read the daemon secret_file #{Error.path(path)}: #{why}")}

  @impl true
  def options([address]), do: options(address, [])
  def options([address, opts]), do: options(address, opts)

  def options(_args),
    do: {:error, "backend :daemon takes {:daemon, address} or {:daemon, address, opts}"}

  @doc """
  Checks a daemon address and the options of `{:daemon, address, opts}`; returns what
  `attach/2` expects in `:backend_opts`, or `{:error, message}`.
  """
  @spec options(term(), term()) :: {:ok, keyword()} | {:error, String.t()}
  def options(address, opts) do
    with :ok <- known_options(opts),
         {:ok, allow_remote} <- allow_remote(opts),
         {:ok, timeout} <- timeout(opts),
         {:ok, secret_file} <- secret_file(opts),
         {:ok, uid} <- daemon_uid(opts),
         {:ok, address} <- address(address, allow_remote, uid) do
      {:ok, [address: address, timeout: timeout] ++ secret_file}
    end
  end

  defp known_options(opts),
    do: Options.known_options(opts, "daemon option", @options, "one of #{inspect(@options)}")

  defp allow_remote(opts) do
    case Keyword.get(opts, :allow_remote, false) do
      allow when is_boolean(allow) -> {:ok, allow}
      other -> {:error, "allow_remote must be a boolean, got #{Error.describe(other)}"}
    end
  end

  # Bounded by the core's longest setting (one day), as the limiter's own are.
  defp timeout(opts) do
    max = Native.bound(:max_setting_ms)

    case Keyword.get(opts, :timeout, @default_timeout) do
      ms when is_integer(ms) and ms in 1..max ->
        {:ok, ms}

      other ->
        {:error,
         "daemon timeout must be an integer from 1 to #{max} (ms), got #{Error.describe(other)}"}
    end
  end

  defp secret_file(opts) do
    case Keyword.fetch(opts, :secret_file) do
      :error ->
        {:ok, []}

      {:ok, path} ->
        with {:ok, path} <- Options.secret_path(:secret_file, path), do: {:ok, secret_file: path}
    end
  end

  # Linux alone names the user at the other end of a Unix socket (SO_PEERCRED).
  defp daemon_uid(opts) do
    case Keyword.fetch(opts, :daemon_uid) do
      :error -> {:ok, :own}
      {:ok, uid} when uid in 0..@max_uid -> {:ok, uid}
      {:ok, other} -> {:error, "daemon_uid must be a user id, got #{Error.describe(other)}"}
    end
  end

  # This program's effective user id on Linux, where the check is made; `nil` elsewhere.
  defp own_uid({:unix, :linux}), do: uid_in_status(File.read("/proc/self/status"))
  defp own_uid(_os), do: {:ok, nil}

  @doc false
  # The effective user id in a read of /proc/self/status, or why there is none: then no
  # daemon is believed, rather than any.
  @spec uid_in_status({:ok, binary()} | {:error, term()}) ::
          {:ok, non_neg_integer()} | {:error, String.t()}
  def uid_in_status(read) do
    with {:ok, status} <- read,
         [_line, effective] <- Regex.run(~r/^Uid:\s+\d+\s+(\d+)/m, status) do
      {:ok, String.to_integer(effective)}
    else
      _ ->
        {:error,
         "cannot read this program's user id from /proc/self/status, to check the " <>
           "daemon's: give daemon_uid:"}
    end
  end

  # A Unix socket's address with the daemon's user (`:own`: this program's).
  defp address(address, allow_remote, uid) do
    with {:ok, {:unix, path}} <- address(address, allow_remote),
         {:ok, uid} <- if(uid == :own, do: own_uid(:os.type()), else: {:ok, uid}) do
      {:ok, {:unix, path, uid}}
    end
  end

  defp address({:unix, path}, _allow_remote) when is_binary(path) and path != "" do
    cond do
      String.contains?(path, <<0>>) ->
        {:error, "a Unix socket path cannot contain NUL bytes"}

      byte_size(path) > @max_unix_path_bytes ->
        {:error,
         "a Unix socket path is at most #{@max_unix_path_bytes} bytes, got #{byte_size(path)}"}

      true ->
        {:ok, {:unix, path}}
    end
  end

  defp address({:unix, path}, _allow_remote),
    do: {:error, "a Unix socket path must be a non-empty binary, got #{Error.describe(path)}"}

  defp address({ip, port}, allow_remote) when is_tuple(ip) and is_integer(port) do
    with :ok <- port_number(port), do: host(ip, port, allow_remote)
  end

  defp address(address, allow_remote) when is_binary(address) do
    with true <- String.valid?(address) and not String.match?(address, ~r/[\x00-\x20\x7f]/),
         [host, port] <- split_host_port(address),
         {port, ""} <- Integer.parse(port),
         :ok <- port_number(port) do
      case :inet.parse_strict_address(String.to_charlist(host)) do
        {:ok, ip} -> host(ip, port, allow_remote)
        {:error, _} when host == "localhost" -> {:ok, {:tcp, {127, 0, 0, 1}, port}}
        # A host name, shown in messages: nothing else (no `user:secret@` part) is one.
        {:error, _} -> host_name(host, port, address, allow_remote)
      end
    else
      {:error, _} = error -> error
      _ -> {:error, bad_address(address)}
    end
  end

  defp address(other, _allow_remote), do: {:error, bad_address(other)}

  defp host_name(host, port, address, allow_remote) do
    cond do
      not String.match?(host, ~r/\A[A-Za-z0-9]([A-Za-z0-9.-]{0,252})\z/) ->
        {:error, bad_address(address)}

      allow_remote ->
        {:ok, {:tcp, String.to_charlist(host), port}}

      true ->
        {:error, remote(address)}
    end
  end

  defp split_host_port(address) do
    case Regex.run(~r/\A(?:\[([^\]]+)\]|([^:\[\]]+)):(\d+)\z/, address) do
      [_, "", host, port] -> [host, port]
      [_, host, "", port] -> [host, port]
      _ -> :error
    end
  end

  defp host(ip, port, allow_remote) do
    cond do
      not :inet.is_ip_address(ip) -> {:error, bad_address({ip, port})}
      allow_remote or loopback?(ip) -> {:ok, {:tcp, ip, port}}
      true -> {:error, remote(:inet.ntoa(ip))}
    end
  end

  defp loopback?({127, _, _, _}), do: true
  defp loopback?({0, 0, 0, 0, 0, 0, 0, 1}), do: true
  defp loopback?(_ip), do: false

  defp port_number(port) when port in 1..65_535, do: :ok

  defp port_number(port),
    do: {:error, "daemon port must be 1..65535, got #{Error.describe(port)}"}

  defp bad_address("/" <> _ = path) do
    "daemon address must be \"IP:PORT\", {ip, port} or {:unix, path}, got #{Error.describe(path)}" <>
      " (a Unix socket's path is given as {:unix, path})"
  end

  defp bad_address(address) do
    "daemon address must be \"IP:PORT\", {ip, port} or {:unix, path}, got #{Error.describe(address)}"
  end

  defp remote(address) do
    "daemon address #{address} is not loopback: requests travel in clear; " <>
      "use {:daemon, address, allow_remote: true} on a trusted network"
  end
end
