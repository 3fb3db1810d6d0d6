defmodule Demo.Profiles do
  @moduledoc """
  Exchange profiles driven against mock exchanges that count like the exchange, and the
  used-weight experiment: a bucket sized at the exchange's limit, rescued by the header.
  """

  alias Bourse.RateLimiter
  alias Bourse.RateLimiter.{Exchange, Feedback}
  alias Bourse.Testing.{HTTP, MockExchange}
  alias Demo.{Client, Table}

  # {label, profile, axis, the counter scaled to a few seconds, how it is scaled,
  #  mock options, what the field report (docs/CONTRACT.md, Sources) measured}
  defp cases do
    [
      {"Binance-like", :binance_spot, "ip", %{limit: 40, window_ms: 2_000},
       "fixed window: 6,000 a minute, scaled to 40 per 2 s", [limit: 40, window_ms: 2_000],
       "6,000 weight a minute per IP, fixed windows"},
      {"Bybit-like", :bybit_v5, "ip", %{limit: 30, window_ms: 2_000},
       "any 5 s per IP: 600, scaled to 30 in any 2 s",
       [mode: :rolling_window, limit: 30, window_ms: 2_000], "600 per 5 seconds per IP"},
      {"Kraken-like", :kraken_spot, "private", %{max: 20, decay_per_sec: 10},
       "decaying per API key: max 20, decay 1/s (pro), decay ×10; ledger calls +2",
       [
         mode: :decaying,
         max: 20,
         decay_per_sec: 10,
         client: :api_key,
         reject: :kraken,
         costs: %{"/0/private/Ledgers" => 2}
       ], "a counter per API key, +2 for ledger calls, decaying by tier"}
    ]
  end

  @doc "Runs the experiments, prints the tables and returns summary rows and failures."
  @spec run(GenServer.name()) :: %{summary: [[String.t()]], failures: [String.t()]}
  def run(limiter) do
    IO.puts("""
    ## 8. Exchange profiles against mocks that count like the exchange
    Four clients share the bucket of the profile (Bourse.RateLimiter.Exchange.buckets/2,
    share 0.8) and send 60 requests as fast as it allows; then the same with a bucket
    sized to the limit itself. Counters scaled to a few seconds; every third Kraken call
    is a ledger call.
    """)

    rows =
      cases()
      |> Task.async_stream(&profile_run(&1, limiter), timeout: 120_000)
      |> Enum.map(fn {:ok, row} -> row end)

    Table.print(
      [
        "Mock",
        "Counter",
        "Profile bucket",
        "HTTP 429 (profile)",
        "HTTP 429 (sized to the limit)",
        "Wall time",
        "Field report"
      ],
      Enum.map(rows, & &1.cells)
    )

    IO.puts("""

    ## 9. Used weight: a bucket sized at the exchange's limit
    The mock counts 10 weight per 1-second window and reports it in X-Used-Weight; the
    bucket is %{requests: 10, period: 1000} (B = 20 per window). 40 requests from a window
    boundary, each reply passed to observe_response/6 (a 429 is waited out and retried).
    Without the exchange's limit, header sync allows B - used; with it (10), min(B, 10) - used.
    """)

    without = used_weight(limiter, nil)
    with_limit = used_weight(limiter, 10)

    Table.print(
      ["Header sync", "HTTP 429", "Wall time", "Field report"],
      [
        [
          "bounded by the bucket only",
          without.rejected,
          Table.seconds(without.ms),
          "a bucket sized to the limit: up to 9 × 429 per 40 requests"
        ],
        [
          "bounded by the exchange's limit too",
          with_limit.rejected,
          Table.seconds(with_limit.ms),
          "0 (the header, with its limit)"
        ]
      ]
    )

    IO.puts("")

    %{
      summary:
        Enum.map(rows, fn row ->
          [
            "#{row.label} counter through its profile",
            "correctly sized: 0 × 429",
            "#{row.profile} × 429 (sized to the limit: #{row.naive})"
          ]
        end) ++
          [
            [
              "used weight, bucket sized at the limit: without / with L",
              "up to 9 / 0 × 429",
              "#{without.rejected} / #{with_limit.rejected} × 429"
            ]
          ],
      failures:
        for(%{profile: n, label: label} <- rows, n > 0, do: "#{label} profile: #{n} × 429") ++
          if(with_limit.rejected > 0,
            do: ["used weight with the exchange's limit: #{with_limit.rejected} × 429"],
            else: []
          )
    }
  end

  defp profile_run({label, name, axis, scaled, how, mock_opts, seed}, limiter) do
    {:ok, profile} = Exchange.profile(name)
    counters = for c <- profile.counters, c.axis == axis, do: Map.merge(c, scaled)
    {:ok, %{^axis => bucket}} = Exchange.buckets(%{profile | counters: counters}, share: 0.8)

    naive =
      case scaled do
        %{limit: l, window_ms: w} -> %{capacity: l, refill_per_sec: l / (w / 1000)}
        %{max: max, decay_per_sec: decay} -> %{capacity: max, refill_per_sec: decay}
      end

    {profile_rejected, ms} =
      Client.timed(fn -> drive(label, "profile", bucket, mock_opts, limiter) end)

    naive_rejected = drive(label, "naive", naive, mock_opts, limiter)

    %{
      label: label,
      profile: profile_rejected,
      naive: naive_rejected,
      cells: [
        label,
        how,
        "#{Table.number(bucket.capacity)} + #{Table.number(bucket.refill_per_sec)}/s",
        profile_rejected,
        naive_rejected,
        Table.seconds(ms),
        seed
      ]
    }
  end

  # Four clients, 15 requests each, through one bucket; returns the mock's refusals.
  defp drive(label, run, bucket, mock_opts, limiter) do
    {:ok, mock} = MockExchange.start(mock_opts)
    key = {"mock", "#{label}-#{run}", "profile"}
    Client.sleep_until_window_start()

    1..4
    |> Enum.map(fn client ->
      Task.async(fn ->
        for i <- 1..15 do
          {path, cost} =
            if label == "Kraken-like" and rem(i + client, 3) == 0,
              do: {"/0/private/Ledgers", 2},
              else: {"/api/v3/ticker", 1}

          :ok = RateLimiter.wait_for_capacity(key, bucket, cost, limiter)

          {:ok, _status, _headers, _body} =
            HTTP.get(mock.url <> path, [{"x-api-key", key |> elem(1)}])
        end
      end)
    end)
    |> Task.await_many(120_000)

    %{rejected: rejected} = MockExchange.stats(mock)
    MockExchange.stop(mock)
    rejected
  end

  defp used_weight(limiter, exchange_limit) do
    exchange = "mock-used-weight-#{exchange_limit || "none"}"
    Application.put_env(:bourse, :header_axes, %{"x-used-weight" => {"ip", 1_000}})
    :ok = Feedback.put_header_limits(exchange, %{"x-used-weight" => exchange_limit})
    {:ok, mock} = MockExchange.start(limit: 10, window_ms: 1000)
    key = {exchange, :public, "ip"}
    limit = %{requests: 10, period: 1000}
    Client.sleep_until_window_start()

    {_, ms} =
      Client.timed(fn ->
        for _ <- 1..40, do: used_weight_call(mock, exchange, key, limit, limiter)
      end)

    Application.delete_env(:bourse, :header_axes)
    %{rejected: rejected} = MockExchange.stats(mock)
    MockExchange.stop(mock)
    %{rejected: rejected, ms: ms}
  end

  defp used_weight_call(mock, exchange, key, limit, limiter) do
    :ok = RateLimiter.wait_for_capacity(key, limit, 1, limiter)
    {:ok, status, headers, body} = HTTP.get(mock.url <> "/api/v3/ticker")

    case RateLimiter.observe_response(exchange, :public, status, headers, limiter, body: body) do
      :ok -> :ok
      {:error, %{stop: false}} -> used_weight_call(mock, exchange, key, limit, limiter)
    end
  end
end
