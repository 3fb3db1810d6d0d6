defmodule Bourse.RateLimiter.Backend.NIF do
  @moduledoc """
  The default backend: the bucket table lives in this VM, behind a NIF.

  Local callers reach the table from their own process, so checks run in parallel on
  every scheduler. The table is a resource referenced from `:persistent_term`: it outlives
  a crash of the limiter's process, and the restarted process re-attaches to it.
  """

  @behaviour Bourse.RateLimiter.Backend

  alias Bourse.Native

  @impl true
  def attach(table, _opts) when is_reference(table), do: {:ok, table}

  def attach(_previous, opts) do
    {:ok, Native.new_table(opts[:assume_busy_at_start], opts[:booking_slack_ms])}
  end

  @impl true
  defdelegate check_one(table, owner, key, limit, cost, max_wait), to: Native
  @impl true
  defdelegate check_many(table, owner, checks, max_wait), to: Native
  @impl true
  defdelegate record(table, key, cost), to: Native
  @impl true
  defdelegate borrowed(table, key), to: Native
  @impl true
  defdelegate sync(table, key, allowance, window_left_ms), to: Native
  @impl true
  defdelegate reset(table, key), to: Native
  @impl true
  defdelegate reset_exchange(table, exchange), to: Native
  @impl true
  defdelegate reset_all(table), to: Native
  @impl true
  defdelegate pause(table, target, ms), to: Native
  @impl true
  defdelegate inspect(table, key), to: Native
  @impl true
  defdelegate stats(table), to: Native
  @impl true
  defdelegate busiest(table, count), to: Native
  @impl true
  defdelegate sweep(table), to: Native
end
