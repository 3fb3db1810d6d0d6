defmodule Demo.Concurrency do
  @moduledoc """
  Many processes of one VM sharing one bucket, and the BEAM version of the field report's
  frozen event loop: a heartbeat beside a thousand waiters (the field report:
  docs/CONTRACT.md, Sources).
  """

  alias Bourse.RateLimiter
  alias Bourse.Testing.{HTTP, MockExchange}
  alias Demo.{Client, Table}

  @limit %{capacity: 2, refill_per_sec: 7}

  @doc "Runs the experiments, prints the tables and returns summary rows and failures."
  @spec run(GenServer.name()) :: %{summary: [[String.t()]], failures: [String.t()]}
  def run(limiter) do
    IO.puts("""
    ## 6. Processes sharing one bucket of 2 + 7/s
    Each process waits for the shared bucket (wait_for_capacity), then sends; the mock
    counts 10 weight per 1-second window.
    """)

    twenty = shared(limiter, "twenty", 20, 1)
    eight = shared(limiter, "eight", 8, 5)

    Table.print(
      ["Processes", "Requests", "HTTP 429", "Wall time", "Field report"],
      [
        [
          "20 (one request each)",
          20,
          twenty.rejected,
          Table.seconds(twenty.ms),
          "all succeeded in 2.9 s, no 429"
        ],
        ["8 (5 requests each)", 40, eight.rejected, Table.seconds(eight.ms), "no 429"]
      ]
    )

    IO.puts("""

    ## 7. A heartbeat due every 10 ms beside 1,000 processes in wait_for_capacity
    The 1,000 share a bucket of 10 + 500/s, so the last waits about 2 s. Waiting sleeps
    in each caller's own process: the scheduler keeps running everything else.
    """)

    gap = heartbeat(limiter)

    Table.print(
      ["Waiters", "Largest heartbeat gap", "Field report (blocking acquire in asyncio)"],
      [[gap.waiters, "#{gap.max_gap_ms} ms", "2.81 s: the event loop froze"]]
    )

    IO.puts("")

    %{
      summary: [
        [
          "20 processes, one 2 + 7/s bucket",
          "2.9 s, 0 × 429",
          "#{Table.seconds(twenty.ms)}, #{twenty.rejected} × 429"
        ],
        ["8 processes, 40 requests, one bucket", "0 × 429", "#{eight.rejected} × 429"],
        ["heartbeat beside 1,000 waiters: largest gap", "2.81 s", "#{gap.max_gap_ms} ms"]
      ],
      failures:
        for(
          {label, %{rejected: n}} <- [{"20 processes", twenty}, {"8 processes", eight}],
          n > 0,
          do: "#{label}, one shared bucket: #{n} × 429"
        )
    }
  end

  defp shared(limiter, label, processes, each) do
    {:ok, mock} = MockExchange.start(limit: 10, window_ms: 1000)
    key = {"mock", "shared-#{label}", "ip"}
    Client.sleep_until_window_start()

    {_, ms} =
      Client.timed(fn ->
        1..processes
        |> Enum.map(fn _ ->
          Task.async(fn ->
            for _ <- 1..each do
              :ok = RateLimiter.wait_for_capacity(key, @limit, 1, limiter)
              {:ok, _status, _headers, _body} = HTTP.get(mock.url <> "/api/v3/ticker")
            end
          end)
        end)
        |> Task.await_many(60_000)
      end)

    %{rejected: rejected} = MockExchange.stats(mock)
    MockExchange.stop(mock)
    %{rejected: rejected, ms: ms}
  end

  defp heartbeat(limiter) do
    key = {"mock", "heartbeat", "ip"}
    limit = %{capacity: 10, refill_per_sec: 500}
    beat = spawn_link(fn -> beat(System.monotonic_time(:millisecond), 0) end)
    Process.sleep(50)

    1..1_000
    |> Enum.map(fn _ ->
      Task.async(fn -> RateLimiter.wait_for_capacity(key, limit, 1, limiter) end)
    end)
    |> Task.await_many(60_000)

    send(beat, {:stop, self()})
    max_gap = receive(do: ({:max_gap, ms} -> ms))
    %{waiters: 1_000, max_gap_ms: max_gap}
  end

  # Sleeps 10 ms at a time, keeping the longest time between two beats.
  defp beat(last, max_gap) do
    receive do
      {:stop, from} -> send(from, {:max_gap, max_gap})
    after
      10 ->
        now = System.monotonic_time(:millisecond)
        beat(now, max(max_gap, now - last))
    end
  end
end
