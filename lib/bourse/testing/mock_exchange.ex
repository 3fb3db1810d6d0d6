defmodule Bourse.Testing.MockExchange do
  @moduledoc """
  A mock exchange HTTP server on 127.0.0.1, for tests and the demo (OTP `:httpd`).

  ## `:fixed_window` mode (default)

  Counts like Binance's per-IP weight counter: each client IP may spend `:limit` weight
  (default 10) per fixed window of `:window_ms` (default 1000), windows aligned to whole
  multiples of `:window_ms` of the wall clock (as Binance restarts each minute).

    * A request spends the weight in its `x-weight` header (default 1).
    * The client IP is the peer address, or the `x-client-ip` header, so that tests on
      one machine can act as several IPs.
    * Above the limit the answer is 429 with `Retry-After` (whole seconds until the window
      ends, rounded up) and the request is not counted.
    * Every reply carries the IP's used weight in `x-used-weight` and
      `x-mbx-used-weight-1m`, and the generic `x-ratelimit-limit`,
      `x-ratelimit-remaining` and `x-ratelimit-reset` (seconds until the window ends, in
      ms precision: `"0.250"`); bodies are small JSON.

  ## `:rolling_window` mode

  `start(mode: :rolling_window, limit: 20, window_ms: 1000)`: like Bybit's per-IP limit
  ("600 requests within a 5-second window"), each client may spend `:limit` weight in
  any `:window_ms`; above it, 429 with `Retry-After` (whole seconds until enough of the
  window has passed). No usage headers.

  ## `:decaying` mode

  `start(mode: :decaying, max: 15, decay_per_sec: 0.33, client: :api_key,
  reject: :kraken, costs: %{"/0/private/Ledgers" => 2})`: like Kraken's REST call
  counter, each client has a counter that each request raises by its weight and that
  decays by `:decay_per_sec`; a request that would take it above `:max` is refused and
  not counted. No usage headers.

  ## Options of every counting mode

    * `:client` – `:ip` (default: the peer address, or the `x-client-ip` header) or
      `:api_key` (the `x-api-key` header, else the IP);
    * `:costs` – `%{path => weight}`: the weight of requests to that path (Kraken's
      ledger calls cost 2), else the `x-weight` header (default 1);
    * `:reject` – how a refusal looks: `:status_429` (default; Binance's `-1003` body)
      or `:kraken` (HTTP 200 with `{"error":["EAPI:Rate limit exceeded"]}`, as Kraken
      answers). Both count as `:rejected` in `stats/1`.

  ## `:scripted` mode

  `start(script: [{status, headers, body}, ...])` answers every request with the next
  reply of the list, then repeats the last one. `headers` are `{name, value}` binaries
  (`content-type` defaults to `application/json`).

  ## Example

      {:ok, mock} = MockExchange.start(limit: 10, window_ms: 1000)
      {:ok, 200, headers, _body} = Bourse.Testing.HTTP.get(mock.url <> "/api/v3/ping")
      {"x-used-weight", "1"} = List.keyfind(headers, "x-used-weight", 0)
      %{accepted: 1, rejected: 0} = MockExchange.stats(mock)
      :ok = MockExchange.stop(mock)

  The server is linked to the process that starts it and stops when that process exits.
  """

  use GenServer
  require Record

  Record.defrecordp(:mod, Record.extract(:mod, from_lib: "inets/include/httpd.hrl"))
  Record.defrecordp(:init_data, Record.extract(:init_data, from_lib: "inets/include/httpd.hrl"))

  @enforce_keys [:pid, :port, :url]
  defstruct @enforce_keys

  @type reply :: {100..599, [{String.t(), String.t()}], iodata()}
  @type t :: %__MODULE__{pid: pid(), port: :inet.port_number(), url: String.t()}

  @doc """
  Starts a mock exchange on an ephemeral port of 127.0.0.1, linked to the caller.

  Options: `:mode` (`:fixed_window`, the default, `:rolling_window` or `:decaying`)
  with `:limit` (default 10) and `:window_ms` (default 1000), or `:max` and
  `:decay_per_sec`, and `:client`, `:costs` and `:reject`; or `:script` (a non-empty
  list of `t:reply/0`) for `:scripted` mode.
  """
  @spec start(keyword()) :: {:ok, t()}
  def start(opts \\ []) do
    {:ok, pid} = GenServer.start_link(__MODULE__, initial_state(opts))
    port = GenServer.call(pid, :port)
    {:ok, %__MODULE__{pid: pid, port: port, url: "http://127.0.0.1:#{port}"}}
  end

  @doc "Stops the server."
  @spec stop(t()) :: :ok
  def stop(%__MODULE__{pid: pid}), do: GenServer.stop(pid)

  @doc """
  How many replies the server has sent: `:accepted` (200s that were not refusals),
  `:rejected` (refusals: 429s, or the body signal of `reject: :kraken`) and `:served`
  (every reply to a request with a readable `x-weight`, whatever its status).
  """
  @spec stats(t()) :: %{
          accepted: non_neg_integer(),
          rejected: non_neg_integer(),
          served: non_neg_integer()
        }
  def stats(%__MODULE__{pid: pid}), do: GenServer.call(pid, :stats)

  @doc "Sets the counters of `stats/1` back to zero."
  @spec reset_stats(t()) :: :ok
  def reset_stats(%__MODULE__{pid: pid}), do: GenServer.call(pid, :reset_stats)

  defp initial_state(opts) do
    stats = %{accepted: 0, rejected: 0, served: 0}

    case Keyword.get(opts, :script) do
      [_ | _] = script -> Map.merge(stats, %{mode: :scripted, script: script})
      nil -> Map.merge(stats, counting_state(opts))
      _ -> raise ArgumentError, "expected :script to be a non-empty list of replies"
    end
  end

  defp counting_state(opts) do
    common = %{
      client: Keyword.get(opts, :client, :ip),
      costs: Keyword.get(opts, :costs, %{}),
      reject: Keyword.get(opts, :reject, :status_429),
      used: %{}
    }

    unless common.client in [:ip, :api_key] and common.reject in [:status_429, :kraken] and
             is_map(common.costs),
           do:
             raise(
               ArgumentError,
               "expected :client :ip or :api_key, :reject :status_429 or :kraken, and a :costs map"
             )

    case Keyword.get(opts, :mode, :fixed_window) do
      mode when mode in [:fixed_window, :rolling_window] ->
        limit = Keyword.get(opts, :limit, 10)
        window_ms = Keyword.get(opts, :window_ms, 1000)

        unless is_integer(limit) and limit > 0 and is_integer(window_ms) and window_ms > 0,
          do: raise(ArgumentError, "expected positive integers :limit and :window_ms")

        Map.merge(common, %{mode: mode, limit: limit, window_ms: window_ms})

      :decaying ->
        max = Keyword.get(opts, :max, 15)
        decay = Keyword.get(opts, :decay_per_sec, 0.33)

        unless is_number(max) and max > 0 and is_number(decay) and decay > 0,
          do: raise(ArgumentError, "expected positive numbers :max and :decay_per_sec")

        Map.merge(common, %{mode: :decaying, max: max, decay_per_sec: decay})

      other ->
        raise ArgumentError, "unknown mode #{inspect(other)}"
    end
  end

  @impl GenServer
  def init(state) do
    # Trapping exits runs terminate/2, which stops httpd, when the caller exits.
    Process.flag(:trap_exit, true)
    {:ok, _} = Application.ensure_all_started(:inets)
    dir = String.to_charlist(System.tmp_dir!())

    config = [
      port: 0,
      bind_address: {127, 0, 0, 1},
      ipfamily: :inet,
      server_name: ~c"bourse-mock-exchange",
      server_root: dir,
      document_root: dir,
      modules: [__MODULE__],
      bourse_mock_exchange: self()
    ]

    {:ok, httpd} = :inets.start(:httpd, config)
    {:ok, Map.merge(state, %{httpd: httpd, port: :httpd.info(httpd)[:port]})}
  end

  @impl GenServer
  def handle_call(:port, _from, state), do: {:reply, state.port, state}

  def handle_call(:stats, _from, state),
    do: {:reply, Map.take(state, [:accepted, :rejected, :served]), state}

  def handle_call(:reset_stats, _from, state),
    do: {:reply, :ok, %{state | accepted: 0, rejected: 0, served: 0}}

  def handle_call({:serve, request}, _from, state) do
    {reply, outcome, state} = serve(state, request)
    {:reply, reply, count(state, outcome)}
  end

  @impl GenServer
  def terminate(_reason, state), do: :inets.stop(:httpd, state.httpd)

  # The :httpd module API (`do/1` is a reserved word in Elixir, hence the unquote).
  @doc false
  def unquote(:do)(
        mod(config_db: config_db, parsed_header: headers, init_data: init, request_uri: uri)
      ) do
    server = :httpd_util.lookup(config_db, :bourse_mock_exchange)
    header = fn name -> headers |> List.keyfind(name, 0, {name, nil}) |> elem(1) end
    {_port, peer} = init_data(init, :peername)
    ip = to_string(header.(~c"x-client-ip") || peer)
    path = uri |> to_string() |> String.split("?", parts: 2) |> hd()

    request = %{
      ip: ip,
      api_key: if(key = header.(~c"x-api-key"), do: to_string(key), else: ip),
      path: path
    }

    {status, reply_headers, body} =
      case parse_weight(header.(~c"x-weight")) do
        {:ok, weight} -> GenServer.call(server, {:serve, Map.put(request, :weight, weight)})
        :error -> {400, [], ~s({"code":-1100,"msg":"x-weight must be an integer >= 0"})}
      end

    {content_type, reply_headers} = pop_header(reply_headers, "content-type", "application/json")

    head =
      [code: status, content_type: content_type, content_length: ~c"#{IO.iodata_length(body)}"] ++
        for {name, value} <- reply_headers,
            do: {String.to_charlist(String.downcase(name)), String.to_charlist(value)}

    {:proceed, [response: {:response, head, body}]}
  end

  defp parse_weight(nil), do: {:ok, 1}

  defp parse_weight(text) do
    case Integer.parse(to_string(text)) do
      {weight, ""} when weight >= 0 -> {:ok, weight}
      _ -> :error
    end
  end

  defp pop_header(headers, name, default) do
    case Enum.split_with(headers, fn {key, _} -> String.downcase(key) == name end) do
      {[{_, value} | _], rest} -> {String.to_charlist(value), rest}
      {[], rest} -> {String.to_charlist(default), rest}
    end
  end

  defp serve(%{mode: :scripted, script: [reply | rest]} = state, _request) do
    {status, _, _} = reply
    outcome = %{200 => :accepted, 429 => :rejected}[status]
    {reply, outcome, %{state | script: if(rest == [], do: [reply], else: rest)}}
  end

  defp serve(state, request) do
    client = if state.client == :api_key, do: request.api_key, else: request.ip
    weight = Map.get(state.costs, request.path, request.weight)
    now = System.os_time(:millisecond)

    case spend(state, Map.get(state.used, client), weight, now) do
      {:ok, used, headers, total} ->
        state = %{state | used: Map.put(state.used, client, used)}
        {{200, headers, ~s({"ok":true,"usedWeight":#{total}})}, :accepted, state}

      {:refused, retry_after_ms, headers} ->
        {refusal(state.reject, retry_after_ms, headers), :rejected, state}
    end
  end

  # What a client has spent: `{window, used}` (fixed), `[{time, weight}]` (rolling, newest
  # first) or `{level, time}` (decaying).
  defp spend(
         %{mode: :fixed_window, limit: limit, window_ms: window_ms} = state,
         used,
         weight,
         now
       ) do
    window = div(now, window_ms)

    used =
      case used do
        {^window, used} -> used
        _ -> 0
      end

    if used + weight > limit,
      do: {:refused, (window + 1) * window_ms - now, used_headers(state, used, now)},
      else: {:ok, {window, used + weight}, used_headers(state, used + weight, now), used + weight}
  end

  defp spend(%{mode: :rolling_window, limit: limit, window_ms: window_ms}, used, weight, now) do
    recent = Enum.take_while(used || [], fn {time, _} -> time > now - window_ms end)
    spent = recent |> Enum.map(&elem(&1, 1)) |> Enum.sum()

    if spent + weight > limit do
      # Until enough of the window has passed for this weight.
      {_, wait} =
        recent
        |> Enum.reverse()
        |> Enum.reduce_while({spent, 0}, fn {time, w}, {left, _} ->
          if left + weight - w <= limit,
            do: {:halt, {left - w, time + window_ms - now}},
            else: {:cont, {left - w, time + window_ms - now}}
        end)

      {:refused, wait, []}
    else
      {:ok, [{now, weight} | recent], [], spent + weight}
    end
  end

  defp spend(%{mode: :decaying, max: max, decay_per_sec: decay}, used, weight, now) do
    level =
      case used do
        {level, time} -> max(level - decay * (now - time) / 1000, 0)
        nil -> 0
      end

    if level + weight > max,
      do: {:refused, ceil((level + weight - max) / decay * 1000), []},
      else: {:ok, {level + weight, now}, [], round(level + weight)}
  end

  defp refusal(:status_429, retry_after_ms, headers) do
    body = ~s({"code":-1003,"msg":"Too many requests; rate limit exceeded."})
    {429, [{"retry-after", "#{div(retry_after_ms + 999, 1000)}"} | headers], body}
  end

  defp refusal(:kraken, _retry_after_ms, _headers),
    do: {200, [], ~s({"error":["EAPI:Rate limit exceeded"],"result":{}})}

  defp used_headers(%{limit: limit, window_ms: window_ms}, used, now) do
    left_ms = window_ms - rem(now, window_ms)

    [
      {"x-used-weight", "#{used}"},
      {"x-mbx-used-weight-1m", "#{used}"},
      {"x-ratelimit-limit", "#{limit}"},
      {"x-ratelimit-remaining", "#{limit - used}"},
      {"x-ratelimit-reset", :erlang.float_to_binary(left_ms / 1000, decimals: 3)}
    ]
  end

  defp count(state, outcome) do
    state = %{state | served: state.served + 1}

    case outcome do
      :accepted -> %{state | accepted: state.accepted + 1}
      :rejected -> %{state | rejected: state.rejected + 1}
      nil -> state
    end
  end
end
