defmodule Bourse.RateLimiter.Telemetry do
  @moduledoc """
  A quick look at a limiter's events (`Bourse.RateLimiter.Events`) in the log.

  `:bourse` does not depend on `:telemetry`. An application that has it (as a dependency
  of its own, or through Phoenix, Ecto, ...) gets every event through `:telemetry` when
  the limiter starts; `attach_default_logger/1` logs them all:

      :ok = Bourse.RateLimiter.Telemetry.attach_default_logger(level: :info)

  Without `:telemetry`, give the limiter a logging `:on_event` callback instead:

      {Bourse.RateLimiter, name: MyApp.Limiter, on_event: Bourse.RateLimiter.Telemetry.logger()}

  Either way, each event is one line, its name then its measurements and metadata
  (credentials are fingerprints, never API keys):

      [bourse] refused delay_ms=118 limiter=MyApp.Limiter exchange="binance" credential="key:1a2b3c4d" axis="ip" cost=4 max_wait_ms=nil reason=:delay

  For metrics, attach handlers of your own to `events/0`.
  """

  require Logger

  alias Bourse.Error
  alias Bourse.RateLimiter.Options

  @levels [:emergency, :alert, :critical, :error, :warning, :notice, :info, :debug]
  @handler_id "bourse-rate-limiter-default-logger"
  @names [:refused, :booked, :admitted_after_wait, :lapsed, :paused, :rate_limited]
  # Metadata written first, in this order; the rest follows sorted.
  @leading [:limiter, :exchange, :credential, :axis, :cost]

  @doc "The names of every event a limiter emits, `[:bourse, :rate_limiter, name]`."
  @spec events() :: [[atom()]]
  def events, do: for(name <- @names, do: [:bourse, :rate_limiter, name])

  @doc """
  Attaches a `:telemetry` handler that logs every event of `events/0` at `:level`
  (default `:info`). Returns `:ok`, `{:error, :already_exists}` when attached already,
  `{:error, :telemetry_not_loaded}` when the `:telemetry` application is not available
  (use `logger/1` as the limiter's `:on_event` then), or `{:error, %Bourse.Error{}}` for an
  unknown option or level.
  """
  @spec attach_default_logger(keyword()) ::
          :ok | {:error, :already_exists | :telemetry_not_loaded | Error.t()}
  def attach_default_logger(opts \\ []) do
    with {:ok, level} <- level(opts) do
      if Code.ensure_loaded?(:telemetry) do
        config = %{level: level}
        handler = &__MODULE__.handle_event/4
        apply(:telemetry, :attach_many, [@handler_id, events(), handler, config])
      else
        {:error, :telemetry_not_loaded}
      end
    end
  end

  @doc "Detaches the handler of `attach_default_logger/1`."
  @spec detach_default_logger() :: :ok | {:error, :not_found | :telemetry_not_loaded}
  def detach_default_logger do
    if Code.ensure_loaded?(:telemetry),
      do: apply(:telemetry, :detach, [@handler_id]),
      else: {:error, :telemetry_not_loaded}
  end

  @doc """
  An `:on_event` callback for `Bourse.RateLimiter.start_link/1` that logs every event at
  `:level` (default `:info`), without `:telemetry`. An unknown option or level gives
  `{:error, %Bourse.Error{}}`, which `Bourse.RateLimiter.start_link/1` answers as given.
  """
  @spec logger(keyword()) :: {module(), atom(), [Logger.level()]} | {:error, Error.t()}
  def logger(opts \\ []) do
    with {:ok, level} <- level(opts), do: {__MODULE__, :log, [level]}
  end

  defp level(opts) do
    with :ok <- known_options(opts) do
      level = Keyword.get(opts, :level, :info)

      if level in @levels,
        do: {:ok, level},
        else:
          {:error,
           Error.invalid("level must be one of #{inspect(@levels)}, got #{Error.describe(level)}")}
    end
  end

  defp known_options(opts) do
    with {:error, message} <- Options.known_options(opts, "option", [:level], "[:level]"),
         do: {:error, Error.invalid(message)}
  end

  @doc false
  # The `:telemetry` handler.
  def handle_event(event, measurements, metadata, %{level: level}),
    do: log(event, measurements, metadata, level)

  @doc false
  # The `:on_event` callback of `logger/1`.
  def log([:bourse, :rate_limiter, name], measurements, metadata, level) do
    Logger.log(level, fn -> line(name, measurements, metadata) end)
  end

  defp line(name, measurements, metadata) do
    {leading, rest} = Map.split(Map.delete(metadata, :checks), @leading)
    leading = for field <- @leading, Map.has_key?(leading, field), do: {field, leading[field]}

    fields = Enum.sort(measurements) ++ leading ++ Enum.sort(rest) ++ checks(metadata[:checks])

    ["[bourse] ", Atom.to_string(name) | for({k, v} <- fields, do: [?\s, field(k, v)])]
  end

  defp field(key, value), do: [Atom.to_string(key), ?=, inspect(value, limit: 10)]

  defp checks(nil), do: []
  defp checks(checks), do: [checks: length(checks)]
end
