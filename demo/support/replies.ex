defmodule Demo.Replies do
  @moduledoc """
  The field report's scripted replies (docs/CONTRACT.md, Sources), each played by a
  scripted mock exchange to the adapter loop (`Bourse.Testing.AdapterLoop`:
  wait_for_capacity, GET, observe_response, retry or return), all at once, one exchange id
  each.
  """

  alias Bourse.Error
  alias Bourse.Testing.{AdapterLoop, MockExchange}
  alias Demo.{Client, Table}

  @limit %{capacity: 2, refill_per_sec: 7}
  @data ~s({"symbol":"BTCUSDT"})
  @past "Wed, 21 Oct 2015 07:28:00 -0000"

  defp limited(retry_after), do: {429, [{"retry-after", retry_after}], ~s({"code":-1003})}
  defp ok, do: {200, [], @data}

  # {id, label, script, field report}
  defp cases do
    [
      {:infinite, "429 with Retry-After: 1e400, then 200", [limited("1e400"), ok()],
       "infinity rejected; 1-second backoff; data after 1.0 s"},
      {:tiny, "429 with Retry-After: 1e-400, then 200", [limited("1e-400"), ok()],
       "1-second floor"},
      {:negative, "429 with Retry-After: -5, then 200", [limited("-5"), ok()], "1-second floor"},
      {:past, "429 with Retry-After: a past date, then 200", [limited(@past), ok()],
       "1-second floor"},
      {:ban, "429 with Retry-After: 86400", [limited("86400"), ok()], "stop at once"},
      {:four, "429 four times, Retry-After: 1", [limited("1")], "stop after 3.0 s"},
      {:four_bare, "429 four times, no Retry-After", [{429, [], ~s({"code":-1003})}],
       "stop after 7.0 s (1 + 2 + 4)"},
      {:unauthorized, "401 with an error body",
       [{401, [], ~s({"code":-2015,"msg":"Invalid API-key"})}, ok()],
       "stop, no KeyError, no retry"},
      {:teapot, "418 with Retry-After: 120",
       [{418, [{"retry-after", "120"}], ~s({"code":-1003})}, ok()], "stop, no retry"},
      {:unavailable, "503", [{503, [], "Service Unavailable"}, ok()], "stop, no retry"},
      {:html, "HTML with 200",
       [{200, [{"content-type", "text/html"}], "<html>maintenance</html>"}, ok()],
       "stop, no retry"}
    ]
  end

  @doc "Plays every reply, prints the table and returns the summary rows."
  @spec run(GenServer.name()) :: %{summary: [[String.t()]], failures: [String.t()]}
  def run(limiter) do
    IO.puts("""
    ## 5. Scripted replies through the adapter loop
    Bucket 2 + 7/s; a 429 without stop is retried, at most 4 tries in all. All at once,
    one exchange id each.
    """)

    played =
      cases()
      |> Task.async_stream(&play(&1, limiter), timeout: 60_000, max_concurrency: 16)
      |> Map.new(fn {:ok, {id, row}} -> {id, row} end)

    played = Map.put(played, :refused, refused(limiter))

    rows =
      Enum.map(
        [
          :infinite,
          :tiny,
          :negative,
          :past,
          :ban,
          :four,
          :four_bare,
          :unauthorized,
          :teapot,
          :unavailable,
          :html,
          :refused
        ],
        &played[&1]
      )

    Table.print(["Reply", "The loop", "Requests", "Wall time", "Field report"], rows)
    IO.puts("")
    time = fn id -> Enum.at(played[id], 3) end

    %{
      summary: [
        [
          "429, Retry-After: 1e400, then 200",
          "data after 1.0 s",
          "data after #{time.(:infinite)}"
        ],
        [
          "429, Retry-After: 1e-400 / -5 / a past date",
          "1-second floor",
          "data after #{time.(:tiny)} / #{time.(:negative)} / #{time.(:past)}"
        ],
        ["429, Retry-After: 86400", "stop at once", "stop after #{time.(:ban)}"],
        [
          "429 ×4, Retry-After: 1 / none",
          "stop after 3.0 s / 7.0 s",
          "stop after #{time.(:four)} / #{time.(:four_bare)}"
        ],
        [
          "401, 418, 503, HTML with 200",
          "stop, no retry",
          "stop, #{Enum.sum(for id <- [:unauthorized, :teapot, :unavailable, :html], do: Enum.at(played[id], 2)) - 4} retries"
        ],
        ["connection refused", "URLError reaches the caller", Enum.at(played[:refused], 1)]
      ],
      failures: []
    }
  end

  defp play({id, label, script, seed}, limiter) do
    {:ok, mock} = MockExchange.start(script: script)

    {answer, ms} =
      Client.timed(fn ->
        AdapterLoop.get(mock.url <> "/api/v3/ticker", "mock-#{id}", "k", @limit, limiter: limiter)
      end)

    %{served: served} = MockExchange.stats(mock)
    MockExchange.stop(mock)
    {id, [label, outcome(answer), served, Table.seconds(ms), seed]}
  end

  defp refused(limiter) do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :ok = :gen_tcp.close(socket)

    {answer, ms} =
      Client.timed(fn ->
        AdapterLoop.get("http://127.0.0.1:#{port}/", "mock-refused", "k", @limit, limiter: limiter)
      end)

    ["connection refused", outcome(answer), 0, Table.seconds(ms), "URLError reaches the caller"]
  end

  defp outcome({:ok, _body}), do: "data"

  defp outcome({:error, %Error{stop: true, retry_after: ms, http_status: status}}),
    do: "stop (HTTP #{status}, asked #{div(ms, 1000)} s)"

  defp outcome({:error, %Error{http_status: status, retry_after: ms}}),
    do: "gave up after 4 tries (HTTP #{status}, next wait #{div(ms, 1000)} s)"

  defp outcome({:error, {:http, status, _body}}), do: "stop: HTTP #{status} to the caller"
  defp outcome({:error, {:not_json, status}}), do: "stop: HTTP #{status}, not JSON"
  defp outcome({:error, {:failed_connect, _}}), do: "error to the caller: failed_connect"
  defp outcome({:error, other}), do: "error to the caller: #{inspect(other, limit: 3)}"
end
