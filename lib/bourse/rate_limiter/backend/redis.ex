defmodule Bourse.RateLimiter.Backend.Redis do
  @moduledoc """
  `backend: {:redis, url}`: the buckets live in Redis, shared by every limiter, on any
  machine, that uses the same Redis server and key prefix.

      {Bourse.RateLimiter, name: MyApp.Limiter, backend: {:redis, "redis://10.0.0.5:6379"}}
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

  A password in the URL (`redis://:secret@host:6379`) reaches the daemon in its
  environment (`BOURSE_REDIS_PASSWORD`), never on its command line. Redis key names hold
  keyed fingerprints of credentials, never API keys (docs/PROTOCOL.md, "Redis"); set
  `BOURSE_REDIS_KEY_SECRET` in the VM's environment to key them with a secret shared by
  every limiter on that Redis.

  Options of `{:redis, url, opts}`:

    * `:prefix` – every Redis key starts with it (default `"bourse"`); limiters share
      buckets only with the same prefix;
    * `:redis_timeout_ms` – the longest wait for Redis per command (default 1000).

  The limiter's `:booking_slack_ms` and `:sweep_interval_ms` apply to its daemon; with
  `:assume_busy_at_start`, a bucket first seen within its fill time after its exchange's
  state began in Redis starts as if empty then, so a Redis that lost its data never hands
  out a fresh burst.

  ## When Redis is down

  Nothing is admitted: calls answer `{:error, %Bourse.Error{type: :unavailable}}` within
  the Redis timeout, never hang, and work again as soon as Redis answers (the daemon
  reconnects by itself). The limiter starts even while Redis is down.
  """

  use Bourse.RateLimiter.Backend.Protocol

  alias Bourse.RateLimiter.Backend.Port

  @default_prefix "bourse"
  @default_redis_timeout_ms 1_000
  @schemes ~w(redis rediss unix)

  @impl true
  def attach(previous, opts) do
    redis = Keyword.fetch!(opts, :backend_opts)
    {url, password} = split_password(redis[:url])

    redis_args = [
      "--redis",
      url,
      "--redis-prefix",
      redis[:prefix],
      "--redis-timeout-ms",
      Integer.to_string(redis[:redis_timeout_ms])
    ]

    env = if password, do: [{~c"BOURSE_REDIS_PASSWORD", String.to_charlist(password)}], else: []
    Port.run_daemon(previous, redis_args, Keyword.put(opts, :env, env))
  end

  # The password goes to the daemon in its environment, never on its command line (which
  # every local user can read in /proc).
  defp split_password(url) do
    case URI.parse(url) do
      %URI{userinfo: userinfo} = uri when is_binary(userinfo) ->
        case String.split(userinfo, ":", parts: 2) do
          [user, password] ->
            user = if user == "", do: nil, else: user
            {URI.to_string(%{uri | userinfo: user}), URI.decode_www_form(password)}

          [_user] ->
            {url, nil}
        end

      _ ->
        {url, nil}
    end
  end

  @impl true
  def options([url]), do: options(url, [])
  def options([url, opts]), do: options(url, opts)
  def options(_args), do: {:error, "backend :redis takes {:redis, url} or {:redis, url, opts}"}

  @doc """
  Checks the URL and the options of `{:redis, url, opts}`; returns what `attach/2` expects
  in `:backend_opts`, or `{:error, message}`.
  """
  @spec options(term(), term()) :: {:ok, keyword()} | {:error, String.t()}
  def options(url, opts) do
    with :ok <- known_options(opts),
         {:ok, url} <- url(url),
         {:ok, prefix} <- prefix(Keyword.get(opts, :prefix, @default_prefix)),
         {:ok, timeout} <-
           redis_timeout(Keyword.get(opts, :redis_timeout_ms, @default_redis_timeout_ms)) do
      {:ok, url: url, prefix: prefix, redis_timeout_ms: timeout}
    end
  end

  defp known_options(opts) do
    cond do
      not Keyword.keyword?(opts) ->
        {:error, "redis options must be a keyword list, got #{inspect(opts)}"}

      Keyword.keys(opts) -- [:prefix, :redis_timeout_ms] != [] ->
        {:error,
         "unknown redis options #{inspect(Keyword.keys(opts) -- [:prefix, :redis_timeout_ms])}"}

      true ->
        :ok
    end
  end

  defp url(url) when is_binary(url) do
    case URI.parse(url) do
      %URI{scheme: scheme} when scheme in @schemes ->
        if String.contains?(url, <<0>>),
          do: {:error, "a Redis URL cannot contain NUL bytes"},
          else: {:ok, url}

      _ ->
        {:error, bad_url(url)}
    end
  end

  defp url(other), do: {:error, bad_url(other)}

  defp bad_url(url) do
    "redis URL must be a string \"redis://HOST:PORT[/DB]\", \"rediss://...\" or " <>
      "\"unix:///PATH\", got #{inspect(url)}"
  end

  defp prefix(prefix) when is_binary(prefix) do
    if prefix =~ ~r/\A[A-Za-z0-9_.:-]{1,64}\z/,
      do: {:ok, prefix},
      else: {:error, bad_prefix(prefix)}
  end

  defp prefix(other), do: {:error, bad_prefix(other)}

  defp bad_prefix(prefix),
    do: "redis prefix must be 1 to 64 of A-Z a-z 0-9 _ - . :, got #{inspect(prefix)}"

  defp redis_timeout(ms) when is_integer(ms) and ms in 1..60_000, do: {:ok, ms}

  defp redis_timeout(other),
    do: {:error, "redis_timeout_ms must be an integer from 1 to 60000, got #{inspect(other)}"}
end
