defmodule Bourse.RateLimiter.Backoff do
  @moduledoc """
  The count of consecutive limited replies without a usable wait, per limiter, exchange
  and credential, from which `Bourse.RateLimiter.Feedback` backs off 1 s, 2 s, 4 s, ...

  It is kept in this VM, beside the buckets rather than in them: in a public ETS table
  owned by a small process of its own, which the `:bourse` application's supervisor
  starts with the application and restarts should it die. Reading and clearing it
  costs no call to the bucket table (a 2xx costs no round trip to a daemon or Redis),
  and it never shows as a bucket in `Bourse.RateLimiter.busiest/2` or `mix bourse.top`.

    * An entry lapses 10 minutes after the last limited reply that counted into it, so
      the table holds only credentials limited lately.
    * The table holds at most 10,000 entries; when full, lapsed entries are dropped,
      and if it is still full a new credential is not counted (its backoff stays at
      1 s).
    * Each VM counts for itself: programs sharing a limiter daemon or Redis share the
      pauses, not the count. Should the owning process be killed, its supervisor starts
      it again and the counts start again from zero; while the application is not
      started nothing is counted (every backoff stays at 1 s).
  """

  use GenServer

  @table __MODULE__
  @lapse_ms 600_000
  @max_entries 10_000

  @typedoc "Whose count: `{limiter name, a digest of the exchange id and credential}`."
  @type key :: {GenServer.name(), binary()}

  @doc "Starts the owner of the table (the `:bourse` application does)."
  @spec start_link(term()) :: GenServer.on_start()
  def start_link(_opts), do: GenServer.start_link(__MODULE__, [], name: __MODULE__)

  @doc "The count for `key` (0 when none, or lapsed)."
  @spec count(key()) :: non_neg_integer()
  def count(key) do
    now = System.monotonic_time(:millisecond)

    case :ets.lookup(@table, key) do
      [{^key, count, lapses_at}] when lapses_at > now -> count
      _ -> 0
    end
  rescue
    ArgumentError -> 0
  end

  @doc "Adds one to `key`'s count, atomically; returns the count before."
  @spec bump(key()) :: non_neg_integer()
  def bump(key) do
    now = System.monotonic_time(:millisecond)

    # A lapsed entry counts from zero again (deleted only if no one updated it since).
    known? =
      case :ets.lookup(@table, key) do
        [{^key, _count, lapses_at} = entry] when lapses_at <= now ->
          :ets.delete_object(@table, entry)
          false

        [_live] ->
          true

        [] ->
          false
      end

    if known? or room?(@table, now) do
      count = :ets.update_counter(@table, key, {2, 1}, {key, 0, 0})
      :ets.update_element(@table, key, {3, now + @lapse_ms})
      count - 1
    else
      0
    end
  rescue
    # No table: the owner is being restarted, or the application is not started.
    ArgumentError -> 0
  end

  @doc "Forgets `key`'s count."
  @spec clear(key()) :: :ok
  def clear(key) do
    case :ets.whereis(@table) do
      :undefined ->
        :ok

      table ->
        :ets.delete(table, key)
        :ok
    end
  end

  # Room for one more entry, after dropping the lapsed ones if the table is full.
  defp room?(table, now) do
    if :ets.info(table, :size) < @max_entries do
      true
    else
      :ets.select_delete(table, [{{:_, :_, :"$1"}, [{:"=<", :"$1", now}], [true]}])
      :ets.info(table, :size) < @max_entries
    end
  end

  @impl true
  def init([]) do
    :ets.new(@table, [
      :named_table,
      :public,
      :set,
      read_concurrency: true,
      write_concurrency: true
    ])

    {:ok, nil}
  end
end
