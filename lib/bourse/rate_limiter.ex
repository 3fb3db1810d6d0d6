defmodule Bourse.RateLimiter do
  @moduledoc """
  Per-credential, weighted token-bucket rate limiter for exchange API requests.

  Each `{exchange_id, credential_key, bucket_axis}` key holds a bucket of `capacity`
  tokens refilling at `refill_per_sec`. A request of cost `c` is admitted when the bucket
  holds `c`; otherwise the answer is how long to wait. Costs above the capacity are
  limited, not exempt: they wait until that much has accrued, then leave the bucket empty.

  ## Keys

    * `exchange_id` – a binary such as `"binance"`;
    * `credential_key` – the API key (a binary), or `:public` for the shared pool of
      unauthenticated requests;
    * `bucket_axis` – the counter the exchange keeps (`"request"`, `"ip"`, `"uid"`,
      `"order_weight"`, ...). `{exchange_id, credential_key}` means axis `"request"`.

  ## Limits

    * `%{capacity: c, refill_per_sec: r}`;
    * `%{requests: n, period: ms}` – the same as `%{capacity: n, refill_per_sec: n / (ms / 1000)}`;
    * `%{requests: n}` – a period of one second;
    * `nil` – no limit: validated, then `:ok` without recording anything.

  See `Bourse.RateLimiter.Limits` to size buckets from an exchange's published limits.

  ## Probes and waiters

  `check_rate/4` and `check_rates/3` without `:max_wait_ms` are *probes*: a delay pays
  nothing and reserves nothing. `wait_for_capacity/5` and `check_rates/3` with
  `:max_wait_ms` are *waiters*: a delay within the budget *books* the cost at once, so
  later callers queue behind it and cheap traffic cannot starve a heavy call. The same
  process coming back with the same checks at the ready time is admitted against its
  booking without a second charge. A booking not claimed within `:booking_slack_ms` of its
  ready time lapses; its cost stays paid.

  ## Usage

      children = [{Bourse.RateLimiter, name: MyApp.Limiter}]
      Supervisor.start_link(children, strategy: :one_for_one)

      key = {"okx", api_key, "request"}

      case Bourse.RateLimiter.check_rate(key, %{capacity: 1, refill_per_sec: 9.09}, 1, MyApp.Limiter) do
        :ok -> make_request()
        {:delay, ms} -> Process.sleep(ms) && make_request()
      end

  Local callers reach the bucket table from their own process (no mailbox on the hot
  path). `{:global, _}`, `{:via, _, _}` and `{name, node}` names on other nodes go through
  the limiter process.

  ## Errors

  Malformed input (keys, limits, costs, options, names) is answered with
  `{:error, %Bourse.Error{type: :invalid_parameters, message: ...}}` naming what is wrong;
  nothing is paid and nothing crashes.
  """

  use GenServer

  alias Bourse.Error
  alias Bourse.RateLimiter.{Backend, Feedback}

  @default __MODULE__

  @typedoc "Rate limiter key: `{exchange_id, api_key | :public, bucket_axis}`."
  @type key ::
          {String.t(), String.t() | :public, String.t()} | {String.t(), String.t() | :public}

  @typedoc "Token-bucket configuration."
  @type rate_limit ::
          %{capacity: number(), refill_per_sec: number()}
          | %{requests: number(), period: pos_integer()}
          | %{requests: number()}

  @typedoc "A single bucket check: `{key, rate_limit, cost}`."
  @type bucket_check :: {key(), rate_limit() | nil, number()}

  @typedoc "What `pause/3` holds: a full key, `{exchange_id, credential_key}` or an exchange id."
  @type pause_target :: key() | String.t()

  @type error :: {:error, Error.t()}

  @backends %{nif: Backend.NIF, port: Backend.Port, daemon: Backend.Daemon, redis: Backend.Redis}

  ## Checks

  @doc """
  Checks if a request of `cost` can be made now.

  Returns `:ok` (paid) or `{:delay, ms}`: nothing paid; come back in `ms` milliseconds.
  """
  @spec check_rate(key(), rate_limit() | nil, number(), GenServer.name()) ::
          :ok | {:delay, pos_integer()} | error()
  def check_rate(key, limit, cost \\ 1, name \\ @default) do
    name |> run(:check_one, [self(), key, limit, cost, nil]) |> answer()
  end

  @doc """
  Checks several buckets at once: all of them pay, or none does.

  Repeated checks of one key are charged once at their combined cost; two checks of one
  key with different definitions are `:invalid_parameters`. Returns `:ok`, or
  `{:delay, ms}` for the longest wait.

  With `max_wait_ms: budget` the caller is a waiter: a delay within the budget is booked
  (see the moduledoc) and the caller must come back after `ms`; a longer delay books
  nothing.
  """
  @spec check_rates([bucket_check()], GenServer.name() | keyword(), keyword()) ::
          :ok | {:delay, pos_integer()} | error()
  def check_rates(checks, name_or_opts \\ @default, opts \\ [])

  def check_rates(checks, opts, []) when is_list(opts), do: check_rates(checks, @default, opts)

  def check_rates(checks, name, opts) do
    with {:ok, max_wait} <- max_wait_option(opts, nil) do
      name |> run(:check_many, [self(), checks, max_wait]) |> answer()
    end
  end

  @doc """
  Blocks the caller until the request is admitted, then returns `:ok`.

  The cost is booked at once (first come, first served); the caller sleeps in its own
  process, then claims the booking. When the wait would exceed `:max_wait_ms` (default
  `Bourse.Defaults.rate_limit_max_wait_ms/0`) it returns at once, paying nothing:
  `{:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: ms}}`.
  """
  @spec wait_for_capacity(
          key(),
          rate_limit() | nil,
          number(),
          GenServer.name() | keyword(),
          keyword()
        ) ::
          :ok | error()
  def wait_for_capacity(key, limit, cost \\ 1, name_or_opts \\ @default, opts \\ [])

  def wait_for_capacity(key, limit, cost, opts, []) when is_list(opts),
    do: wait_for_capacity(key, limit, cost, @default, opts)

  def wait_for_capacity(key, limit, cost, name, opts) do
    with {:ok, max_wait} <- max_wait_option(opts, Bourse.Defaults.rate_limit_max_wait_ms()) do
      await(name, [self(), key, limit, cost, max_wait])
    end
  end

  defp await(name, args) do
    case run(name, :check_one, args) do
      {wait, ms} when wait in [:booked, :delay] ->
        Process.sleep(ms)
        await(name, args)

      {:over_budget, ms} ->
        [_owner, key | _] = args

        {:error,
         Error.rate_limited(ms,
           exchange: exchange_of(key),
           message: "waiting would take #{ms} ms, more than max_wait_ms allows"
         )}

      other ->
        answer(other)
    end
  end

  ## Bookkeeping

  @doc """
  Tokens currently borrowed from the bucket: `capacity - tokens` after refill, larger
  than the capacity while in debt, `0` for an unknown key. `period` is ignored.
  """
  @spec get_cost(key(), term(), GenServer.name()) :: number() | error()
  def get_cost(key, _period, name \\ @default) do
    name |> run(:borrowed, [key]) |> answer()
  end

  @doc """
  Debits `cost` without checking: usage spent elsewhere. The bucket may go into debt; on
  a key without a definition yet, the debt waits for the key's first check.
  """
  @spec record_request(key(), number(), GenServer.name()) :: :ok | error()
  def record_request(key, cost \\ 1, name \\ @default) do
    name |> run(:record, [key, cost]) |> answer()
  end

  @doc "Forgets a key: it is as new, and its bookings are dropped."
  @spec reset(key(), GenServer.name()) :: :ok | error()
  def reset(key, name \\ @default), do: name |> run(:reset, [key]) |> answer()

  @doc "Forgets every key of one exchange; other exchanges are untouched."
  @spec reset_exchange(String.t(), GenServer.name()) :: :ok | error()
  def reset_exchange(exchange_id, name \\ @default),
    do: name |> run(:reset_exchange, [exchange_id]) |> answer()

  @doc "Forgets every key."
  @spec reset_all(GenServer.name()) :: :ok | error()
  def reset_all(name \\ @default), do: name |> run(:reset_all, []) |> answer()

  @doc """
  Holds every bucket of `target` for `ms` milliseconds, for every caller at once: probes
  answer the remaining pause, waiters book behind it. `target` is a full key,
  `{exchange_id, credential_key}` (every axis of that credential) or an exchange id.
  Overlapping pauses keep the later end.
  """
  @spec pause(pause_target(), non_neg_integer(), GenServer.name()) :: :ok | error()
  def pause(target, ms, name \\ @default), do: name |> run(:pause, [target, ms]) |> answer()

  ## Exchange feedback

  @doc """
  The one call an adapter makes after every response from `exchange_id` made with
  `credential_key`. `headers` are `{name, value}` pairs or a map of name to value or list
  of values; names are case-insensitive; names and values may be binaries or charlists
  (as `:httpc` returns them).

  Used-weight headers (Binance `x-mbx-used-weight-1m`, Bybit `x-bapi-limit*`, generic
  `x-ratelimit-*`, ...) bring the bucket of the matching axis in line with what the
  exchange counted. After a 429 (or a 418, an IP ban) every bucket of the credential (of
  the whole exchange, for a 418) is paused for every caller, for `Retry-After` or an
  exponential backoff, and the answer is
  `{:error, %Bourse.Error{type: :rate_limit_exceeded, http_status: status, retry_after: ms}}`,
  with `stop: true` when retrying is pointless. Otherwise `:ok`. The header-to-axis table
  and the rules are in `Bourse.RateLimiter.Feedback`.
  """
  @spec observe_response(
          String.t(),
          String.t() | :public,
          100..599,
          [{String.t() | charlist(), String.t() | charlist()}] | map(),
          GenServer.name()
        ) :: :ok | error()
  def observe_response(exchange_id, credential_key, status, headers, name \\ @default),
    do: Feedback.observe_response(exchange_id, credential_key, status, headers, name)

  @doc """
  Brings `key`'s bucket in line with an exchange that allows only `allowance` more cost
  until its window ends in `window_left_ms`: the tokens are lowered so that they plus the
  refill until then fit the allowance; they are never raised. A key without a definition
  is left alone. Returns the tokens taken. `observe_response/5` calls it for the headers
  it knows; call it directly for others.
  """
  @spec sync(key(), number(), non_neg_integer(), GenServer.name()) :: number() | error()
  def sync(key, allowance, window_left_ms, name \\ @default),
    do: name |> run(:sync, [key, allowance, window_left_ms]) |> answer()

  @doc """
  A snapshot of `key`: `%{limit: %{capacity: c, refill_per_sec: r} | nil, tokens: t, ...}`
  (see `Bourse.RateLimiter.Backend`), or `nil` when the limiter holds nothing for it.
  """
  @spec inspect_key(key(), GenServer.name()) :: map() | nil | error()
  def inspect_key(key, name \\ @default), do: name |> run(:inspect, [key]) |> answer()

  ## Supervision

  @doc """
  A child specification; the child id is the limiter's name.
  """
  @spec child_spec(keyword()) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{id: Keyword.get(opts, :name, @default), start: {__MODULE__, :start_link, [opts]}}
  end

  @doc """
  Starts a limiter.

  Options:

    * `:name` – a `GenServer.name()`, default `Bourse.RateLimiter`;
    * `:backend` – where the buckets live:
      * `:nif` (default) – in this VM, behind a NIF;
      * `:port` – in a `bourse_daemon` process run as an Erlang port
        (`Bourse.RateLimiter.Backend.Port`);
      * `{:daemon, address}` or `{:daemon, address, opts}` – in a `bourse_daemon` server
        shared with other OS processes and programs, at `"127.0.0.1:PORT"` or
        `{:unix, path}` (`Bourse.RateLimiter.Backend.Daemon`);
      * `{:redis, url}` or `{:redis, url, opts}` – in Redis, shared by limiters on every
        machine using that server (`Bourse.RateLimiter.Backend.Redis`);
    * `:assume_busy_at_start` – buckets first seen within their fill time after start
      begin as if they had been empty at start (default `false`);
    * `:booking_slack_ms` – how long a booking may be claimed after its ready time
      (default `Bourse.Defaults.booking_slack_ms/0`);
    * `:sweep_interval_ms` – how often full idle buckets are dropped (default 1000).

  The bucket table outlives a crash of the limiter's process: the restarted process,
  started with the same name, re-attaches to it, so spent tokens stay spent.
  """
  @spec start_link(keyword()) :: GenServer.on_start() | error()
  def start_link(opts \\ []) do
    with {:ok, config} <- config(opts) do
      GenServer.start_link(__MODULE__, config, name: config.name)
    end
  end

  @impl true
  def init(config) do
    slot = {__MODULE__, config.name}

    previous =
      case :persistent_term.get(slot, nil) do
        {backend, handle} when backend == config.backend -> handle
        _ -> nil
      end

    case config.backend.attach(previous, Map.to_list(config)) do
      {:ok, handle} ->
        if handle !== previous, do: :persistent_term.put(slot, {config.backend, handle})
        schedule_sweep(config)
        {:ok, Map.put(config, :handle, handle)}

      {:error, reason} ->
        {:stop, reason}
    end
  end

  @impl true
  def handle_call({:run, fun, args}, _from, state) do
    {:reply, apply(state.backend, fun, [state.handle | args]), state}
  end

  @impl true
  def handle_info(:sweep, state) do
    state.backend.sweep(state.handle)
    schedule_sweep(state)
    {:noreply, state}
  end

  defp schedule_sweep(config), do: Process.send_after(self(), :sweep, config.sweep_interval_ms)

  defp config(opts) do
    with true <- Keyword.keyword?(opts) || {:error, "options must be a keyword list"},
         {:ok, name} <- name_option(Keyword.get(opts, :name, @default)),
         {:ok, backend, backend_opts} <- backend_option(Keyword.get(opts, :backend, :nif)),
         {:ok, busy} <- boolean_option(opts, :assume_busy_at_start, false),
         {:ok, slack} <-
           integer_option(opts, :booking_slack_ms, Bourse.Defaults.booking_slack_ms(), 0),
         {:ok, sweep} <- integer_option(opts, :sweep_interval_ms, 1000, 1) do
      {:ok,
       %{
         name: name,
         backend: backend,
         backend_opts: backend_opts,
         assume_busy_at_start: busy,
         booking_slack_ms: slack,
         sweep_interval_ms: sweep
       }}
    else
      {:error, message} -> {:error, Error.invalid(message)}
    end
  end

  defp name_option(name) when is_atom(name) and not is_nil(name), do: {:ok, name}
  defp name_option({:global, _} = name), do: {:ok, name}
  defp name_option({:via, module, _} = name) when is_atom(module), do: {:ok, name}

  defp name_option(other),
    do:
      {:error,
       "name must be an atom, {:global, term} or {:via, module, term}, got #{inspect(other)}"}

  defp backend_option({:daemon, address}), do: backend_option({:daemon, address, []})

  defp backend_option({:daemon, address, opts}) do
    with {:ok, daemon_opts} <- @backends.daemon.options(address, opts),
         do: {:ok, @backends.daemon, daemon_opts}
  end

  defp backend_option({:redis, url}), do: backend_option({:redis, url, []})

  defp backend_option({:redis, url, opts}) do
    with {:ok, redis_opts} <- @backends.redis.options(url, opts),
         do: {:ok, @backends.redis, redis_opts}
  end

  defp backend_option(backend) do
    case @backends do
      %{^backend => module} when backend not in [:daemon, :redis] ->
        {:ok, module, []}

      _ ->
        {:error,
         "unknown backend #{inspect(backend)}; expected :nif, :port, {:daemon, address}, " <>
           "{:daemon, address, opts}, {:redis, url} or {:redis, url, opts}"}
    end
  end

  defp boolean_option(opts, key, default) do
    case Keyword.get(opts, key, default) do
      value when is_boolean(value) -> {:ok, value}
      other -> {:error, "#{key} must be a boolean, got #{inspect(other)}"}
    end
  end

  defp integer_option(opts, key, default, min) do
    case Keyword.get(opts, key, default) do
      value when is_integer(value) and value >= min -> {:ok, value}
      other -> {:error, "#{key} must be an integer >= #{min}, got #{inspect(other)}"}
    end
  end

  defp max_wait_option(opts, default) do
    cond do
      not Keyword.keyword?(opts) ->
        {:error, Error.invalid("options must be a keyword list, got #{inspect(opts)}")}

      Keyword.keys(opts) -- [:max_wait_ms] != [] ->
        {:error,
         Error.invalid("unknown options #{inspect(Keyword.keys(opts) -- [:max_wait_ms])}")}

      true ->
        case Keyword.get(opts, :max_wait_ms, default) do
          # nil (a probe) only where the default is nil: check_rates without a budget.
          ms when (is_integer(ms) and ms > 0) or (is_nil(ms) and is_nil(default)) ->
            {:ok, ms}

          other ->
            {:error,
             Error.invalid("max_wait_ms must be a positive integer, got #{inspect(other)}")}
        end
    end
  end

  ## Routing: local names reach the table directly; other names go through the process.

  defp run(name, fun, args) do
    case route(name) do
      {:local, backend, handle} -> apply(backend, fun, [handle | args])
      {:remote, server} -> GenServer.call(server, {:run, fun, args})
      :invalid -> {:error, Error.invalid("not a limiter name: #{inspect(name)}")}
    end
  end

  defp route(name) when is_atom(name) and not is_nil(name) do
    case :persistent_term.get({__MODULE__, name}, nil) do
      {backend, handle} -> {:local, backend, handle}
      nil -> exit({:noproc, {__MODULE__, :run, [name]}})
    end
  end

  defp route({:global, _} = name), do: {:remote, name}
  defp route({:via, module, _} = name) when is_atom(module), do: {:remote, name}

  defp route({name, node} = server) when is_atom(name) and is_atom(node) do
    if node == node(), do: route(name), else: {:remote, server}
  end

  defp route(pid) when is_pid(pid), do: {:remote, pid}
  defp route(_), do: :invalid

  defp answer({:error, message}) when is_binary(message), do: {:error, Error.invalid(message)}
  defp answer({wait, ms}) when wait in [:booked, :over_budget], do: {:delay, ms}
  defp answer(answer), do: answer

  defp exchange_of(key) when is_tuple(key) and tuple_size(key) in [2, 3], do: elem(key, 0)
  defp exchange_of(_), do: nil
end
