defmodule Bourse.RateLimiter.Backend.NIF do
  @moduledoc """
  The default backend: the bucket table lives in this VM, behind a NIF.

  Local callers reach the table from their own process, so checks run in parallel on
  every scheduler. The table is a resource referenced from `:persistent_term`: it outlives
  a crash of the limiter's process, and the restarted process re-attaches to it.
  """

  @behaviour Bourse.RateLimiter.Backend

  alias Bourse.Native
  alias Bourse.RateLimiter.Events

  @impl true
  def options([]), do: {:ok, []}
  def options(args), do: {:error, "backend :nif takes no arguments, got #{length(args)}"}

  @impl true
  def attach(table, _opts) when is_reference(table), do: {:ok, table}

  def attach(_previous, opts) do
    {:ok, Native.new_table(opts[:assume_busy_at_start], opts[:booking_slack_ms])}
  end

  @impl true
  def check_rate(table, owner, key, limit, cost, max_wait),
    do: table |> Native.check_rate(owner, key, limit, cost, max_wait) |> answer()

  @impl true
  def check_rates(table, owner, checks, max_wait),
    do: table |> Native.check_rates(owner, checks, max_wait) |> answer()

  @doc """
  A prepared bucket of `table` for `key` and `limit` (a resource; `nil` for a `nil`
  limit), or the error a check of them answers (`Bourse.RateLimiter.bucket/3`).
  """
  @spec prepare(reference(), term(), term()) :: reference() | nil | {:error, Bourse.Error.t()}
  def prepare(table, key, limit), do: table |> Native.prepare(key, limit) |> answer()

  @doc """
  `check_rate/6` of a bucket `prepare/3` made, on `table`; `:not_prepared` when `table` is
  no table or `bucket` no prepared bucket.
  """
  @spec check_prepared(
          reference(),
          Bourse.RateLimiter.Backend.owner(),
          reference(),
          term(),
          pos_integer() | nil
        ) ::
          Bourse.RateLimiter.Backend.check_answer() | :not_prepared | {:error, Bourse.Error.t()}
  def check_prepared(table, owner, bucket, cost, max_wait),
    do: table |> Native.check_prepared(owner, bucket, cost, max_wait) |> answer()

  @impl true
  def record_request(table, key, cost), do: table |> Native.record_request(key, cost) |> answer()
  @impl true
  def get_cost(table, key), do: table |> Native.get_cost(key) |> answer()

  @impl true
  def sync(table, key, allowance, window_left_ms),
    do: table |> Native.sync(key, allowance, window_left_ms) |> answer()

  @impl true
  def reset(table, key), do: table |> Native.reset(key) |> answer()
  @impl true
  def reset_exchange(table, exchange), do: table |> Native.reset_exchange(exchange) |> answer()
  @impl true
  defdelegate reset_all(table), to: Native
  @impl true
  def pause(table, target, ms), do: table |> Native.pause(target, ms) |> answer()
  @impl true
  def back_off(table, credential, scope),
    do: table |> Native.back_off(credential, scope) |> answer()

  @impl true
  def reset_backoff(table, credential),
    do: table |> Native.reset_backoff(credential) |> answer()

  @impl true
  def inspect(table, key), do: table |> Native.inspect(key) |> answer()
  @impl true
  defdelegate stats(table), to: Native
  @impl true
  def busiest(table, count) do
    case table |> Native.busiest(count) |> answer() do
      rows when is_list(rows) ->
        for {key, info} <- rows, do: Map.merge(info, Events.describe_key(key))

      error ->
        error
    end
  end

  @impl true
  defdelegate sweep(table), to: Native

  # The table is the VM's own: its calls are never `:unavailable`.
  @impl true
  def unbook(_table, _owner, _checks), do: :ok

  # The table is the VM's own: it goes only with the VM.
  @impl true
  def store_lost_at(_table), do: nil

  # The NIF names malformed input as `{:error, message, exchange_id | nil}`.
  defp answer({:error, message, exchange}),
    do: {:error, %Bourse.Error{type: :invalid_parameters, message: message, exchange: exchange}}

  defp answer(answer), do: answer
end
