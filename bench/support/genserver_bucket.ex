defmodule Bench.GenServerBucket do
  @moduledoc """
  The reference architecture: token buckets whose state lives in one GenServer, one
  `GenServer.call/2` per check (the design of the published interface, docs/CONTRACT.md). Every check is serialised
  through the server's mailbox.
  """
  use GenServer
  use Bench.Loop

  @native_per_second System.convert_time_unit(1, :second, :native)

  @doc "Starts a server holding no buckets."
  @spec start_link() :: GenServer.on_start()
  def start_link, do: GenServer.start_link(__MODULE__, %{})

  @doc "One check of cost 1: `:ok` (paid) or `{:delay, ms}`."
  @spec check(GenServer.server(), term()) :: :ok | {:delay, pos_integer()}
  def check(server, key), do: GenServer.call(server, {:check, key, Bench.Loop.limit(), 1})

  @impl true
  def init(buckets), do: {:ok, buckets}

  @impl true
  def handle_call(
        {:check, key, %{capacity: capacity, refill_per_sec: refill}, cost},
        _from,
        buckets
      ) do
    now = System.monotonic_time()
    {tokens, last} = Map.get(buckets, key, {capacity, now})
    tokens = min(capacity, tokens + (now - last) * refill / @native_per_second)

    if tokens >= cost do
      {:reply, :ok, Map.put(buckets, key, {tokens - cost, now})}
    else
      delay = max(1, ceil((cost - tokens) / refill * 1000))
      {:reply, {:delay, delay}, Map.put(buckets, key, {tokens, now})}
    end
  end
end
