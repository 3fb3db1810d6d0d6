defmodule Bourse.RateLimiter.Options do
  @moduledoc """
  The options of `Bourse.RateLimiter.start_link/1` and of the calls that take a budget,
  checked before anything starts or is paid. Every refusal is an `:invalid_parameters`
  `Bourse.Error` naming the option; a bad value is described by its type and size
  (`Bourse.Error.describe/1`), never printed whole.

  The `:backend` option names a backend (`:nif`, `:port`, `:daemon`, `:redis`), alone or
  as the first element of a tuple; the backend module checks the rest of it
  (`c:Bourse.RateLimiter.Backend.options/1`).
  """

  alias Bourse.{Error, Native}
  alias Bourse.RateLimiter.Backend

  @backends %{nif: Backend.NIF, port: Backend.Port, daemon: Backend.Daemon, redis: Backend.Redis}
  @start_options [
    :name,
    :backend,
    :assume_busy_at_start,
    :booking_slack_ms,
    :sweep_interval_ms,
    :on_event
  ]

  @typedoc "A limiter's configuration, as `Bourse.RateLimiter.Server` starts with it."
  @type config :: %{
          name: GenServer.name(),
          backend: module(),
          backend_opts: keyword(),
          assume_busy_at_start: boolean(),
          booking_slack_ms: non_neg_integer(),
          sweep_interval_ms: pos_integer(),
          on_event: Bourse.RateLimiter.Events.callback() | nil
        }

  @doc "Checks the options of `Bourse.RateLimiter.start_link/1`."
  @spec start(term()) :: {:ok, config()} | {:error, Error.t()}
  def start(opts) do
    with :ok <- keyword(opts, "start_link/1 options", @start_options),
         {:ok, name} <- name(Keyword.get(opts, :name, Bourse.RateLimiter)),
         {:ok, backend, backend_opts} <- backend(Keyword.get(opts, :backend, :nif)),
         {:ok, busy} <- boolean(opts, :assume_busy_at_start, false),
         {:ok, slack} <-
           integer(opts, :booking_slack_ms, Bourse.Defaults.booking_slack_ms(), 0),
         {:ok, sweep} <- integer(opts, :sweep_interval_ms, 1000, 1),
         {:ok, on_event} <- on_event(Keyword.get(opts, :on_event)) do
      {:ok,
       %{
         name: name,
         backend: backend,
         backend_opts: backend_opts,
         assume_busy_at_start: busy,
         booking_slack_ms: slack,
         sweep_interval_ms: sweep,
         on_event: on_event
       }}
    else
      {:error, message} -> {:error, Error.invalid(message)}
    end
  end

  @doc """
  The budget of a waiter from a call's options: `{:ok, ms}`, or `{:ok, default}` when
  `opts` has no `:max_wait_ms` (`nil` for `check_rates/3`: a probe). A budget, given or
  from the application env, is a positive integer of at most the core's `MAX_MS`,
  4_294_967_295: what `Process.sleep/1` accepts, so that a waiter can always sleep its
  delay.
  """
  @spec max_wait(term(), pos_integer() | nil) :: {:ok, pos_integer() | nil} | {:error, Error.t()}
  # A probe without options: the common case, answered at once.
  def max_wait([], nil), do: {:ok, nil}

  def max_wait(opts, default) do
    with :ok <- keyword(opts, "options", [:max_wait_ms]),
         {:ok, ms} <- budget(Keyword.fetch(opts, :max_wait_ms), default) do
      {:ok, ms}
    else
      {:error, message} -> {:error, Error.invalid(message)}
    end
  end

  defp budget(:error, nil), do: {:ok, nil}
  defp budget(:error, default), do: budget(default, "config :bourse, rate_limit_max_wait_ms")
  defp budget({:ok, ms}, _default), do: budget(ms, "max_wait_ms")

  defp budget(ms, what) when is_integer(ms) and ms >= 1 do
    if ms <= Native.bound(:max_ms), do: {:ok, ms}, else: budget_error(what, ms)
  end

  defp budget(other, what), do: budget_error(what, other)

  defp budget_error(what, other) do
    {:error,
     "#{what} must be an integer from 1 to #{Native.bound(:max_ms)}, " <>
       "got #{Error.describe(other)}"}
  end

  # A keyword list of `known` options, each given once; `what` names them ("options").
  defp keyword(opts, what, known) do
    case Keyword.keyword?(opts) && bad_option(opts, known) do
      :ok -> :ok
      {:unknown, key} -> {:error, "unknown #{what} #{unknown(key)}; expected #{names(known)}"}
      {:repeated, key} -> {:error, "#{what} #{inspect(key)} given more than once"}
      false -> {:error, "#{what} must be a keyword list, got #{Error.describe(opts)}"}
    end
  end

  defp names(options), do: Enum.map_join(options, ", ", &inspect/1)

  # An unknown option: named when it reads as an option's name (a misspelt one, say: lower
  # case letters and `_`, as every option's), else by its size: any atom may be passed, a
  # credential made one too (a hex key has digits).
  defp unknown(key) do
    name = Atom.to_string(key)

    if byte_size(name) <= 32 and name =~ ~r/\A[a-z_]+\z/,
      do: inspect(key),
      else: "an atom of #{byte_size(name)} bytes"
  end

  @doc false
  # Whether start options (any term, refused or not) may hold a password: a `:backend`,
  # in a list or a map, other than `:nif`, `:port`, a daemon or a Redis backend whose URLs
  # (binaries) have neither a user part nor a query and whose options are its own
  # (`Bourse.RateLimiter.Backend.Redis`).
  @spec may_hold_password?(term()) :: boolean()
  def may_hold_password?(opts) when is_map(opts),
    do: not plain_backend?(Map.get(opts, :backend, :nif))

  def may_hold_password?([{:backend, backend} | rest]),
    do: not plain_backend?(backend) or may_hold_password?(rest)

  def may_hold_password?([_ | rest]), do: may_hold_password?(rest)
  def may_hold_password?(_), do: false

  defp plain_backend?(backend) when is_atom(backend), do: true
  defp plain_backend?(backend) when is_tuple(backend) and elem(backend, 0) == :daemon, do: true
  defp plain_backend?({:redis, urls}), do: plain_urls?(urls)

  defp plain_backend?({:redis, urls, opts}) do
    plain_urls?(urls) and Keyword.keyword?(opts) and
      Enum.all?(Keyword.keys(opts), &(&1 in Bourse.RateLimiter.Backend.Redis.option_names()))
  end

  defp plain_backend?(_), do: false

  defp plain_urls?(url) when is_binary(url), do: not (url =~ ~r/[@?]/)
  defp plain_urls?([url | seeds]), do: plain_urls?(url) and plain_urls?(seeds)
  defp plain_urls?([]), do: true
  defp plain_urls?(_), do: false

  @doc false
  # `:ok` for a keyword list of `known` options, each given once; else the error about its
  # first unknown option, or its first repeated one. `what` names one option ("daemon
  # option"), `expected` the options it takes.
  @spec known_options(term(), String.t(), [atom()], String.t()) :: :ok | {:error, String.t()}
  def known_options(opts, what, known, expected) do
    case Keyword.keyword?(opts) && bad_option(opts, known) do
      :ok -> :ok
      {:unknown, key} -> {:error, "unknown #{what} #{unknown(key)}; expected #{expected}"}
      {:repeated, key} -> {:error, "#{what} #{inspect(key)} given more than once"}
      false -> {:error, "#{what}s must be a keyword list, got #{Error.describe(opts)}"}
    end
  end

  @doc false
  # The path of a secret's file given as option `name` (`:secret_file`, `:password_file`),
  # made absolute (a daemon's working directory need not stay the VM's), of at most the
  # core's `max_secret_path_bytes`.
  @spec secret_path(atom(), term()) :: {:ok, binary()} | {:error, String.t()}
  def secret_path(name, path) when is_binary(path) and path != "" do
    max = Native.bound(:max_secret_path_bytes)

    if byte_size(path) <= max,
      do: {:ok, Path.expand(path)},
      else:
        {:error, "#{name} must be a path of at most #{max} bytes, got #{Error.describe(path)}"}
  end

  def secret_path(name, other),
    do: {:error, "#{name} must be a path, got #{Error.describe(other)}"}

  # The first unknown key of keyword list `opts`, else its first repeated one: a message
  # names one, whatever the list holds.
  defp bad_option(opts, known) do
    keys = Keyword.keys(opts)

    case {Enum.reject(keys, &(&1 in known)), keys -- Enum.uniq(keys)} do
      {[unknown | _], _repeated} -> {:unknown, unknown}
      {[], [repeated | _]} -> {:repeated, repeated}
      {[], []} -> :ok
    end
  end

  # `:undefined` is what OTP's registries answer for a name that is not registered.
  defp name(name) when is_atom(name) and name not in [nil, :undefined], do: {:ok, name}
  defp name({:global, _} = name), do: {:ok, name}
  # gen_server asks a `:via` module for the name in the caller before it starts the
  # process, which registers it: a module that cannot do both is refused here, not raised
  # in the caller or its linked process.
  defp name({:via, module, via} = name) when is_atom(module) do
    if Code.ensure_loaded?(module) and function_exported?(module, :register_name, 2) do
      module.whereis_name(via)
      {:ok, name}
    else
      via_error(module)
    end
  catch
    _kind, _reason -> via_error(module)
  end

  defp name(other) do
    {:error,
     "name must be an atom, {:global, term} or {:via, module, term}, got #{Error.describe(other)}"}
  end

  defp via_error(module) do
    {:error,
     "name {:via, #{inspect(module)}, term}: #{inspect(module)} cannot register and look up that name"}
  end

  defp backend(backend) do
    {kind, args} =
      case backend do
        kind when is_atom(kind) ->
          {kind, []}

        tuple when is_tuple(tuple) and tuple_size(tuple) in 2..3 ->
          {elem(tuple, 0), tl(Tuple.to_list(tuple))}

        other ->
          {other, []}
      end

    case @backends do
      %{^kind => module} ->
        with {:ok, backend_opts} <- module.options(args), do: {:ok, module, backend_opts}

      _ ->
        {:error,
         "unknown backend #{Error.describe(backend)}; expected :nif, :port, {:daemon, address}, " <>
           "{:daemon, address, opts}, {:redis, url} or {:redis, url, opts}"}
    end
  end

  # A refused `Bourse.RateLimiter.Telemetry.logger/1`, answered as it was given.
  defp on_event({:error, %Error{message: message}}), do: {:error, message}

  defp on_event(on_event) do
    if is_nil(on_event) or Bourse.RateLimiter.Events.callback?(on_event),
      do: {:ok, on_event},
      else:
        {:error,
         "on_event must be a 3-arity function or {module, function, extra_args}, " <>
           "got #{Error.describe(on_event)}"}
  end

  defp boolean(opts, key, default) do
    case Keyword.get(opts, key, default) do
      value when is_boolean(value) -> {:ok, value}
      other -> {:error, "#{key} must be a boolean, got #{Error.describe(other)}"}
    end
  end

  # Bounded by the core's longest setting (one day), as `bourse_daemon` is.
  # `default` may come from the application env: an error names where the value was set.
  defp integer(opts, key, default, min) do
    max = Native.bound(:max_setting_ms)
    what = if Keyword.has_key?(opts, key), do: "#{key}", else: "config :bourse, #{key}"

    case Keyword.get(opts, key, default) do
      value when is_integer(value) and value in min..max ->
        {:ok, value}

      other ->
        {:error, "#{what} must be an integer from #{min} to #{max}, got #{Error.describe(other)}"}
    end
  end
end
