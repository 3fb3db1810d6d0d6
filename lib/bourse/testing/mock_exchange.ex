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

  Options: `:limit` (default 10) and `:window_ms` (default 1000) for `:fixed_window`
  mode, or `:script` (a non-empty list of `t:reply/0`) for `:scripted` mode.
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

  @doc "How many 200 (`:accepted`) and 429 (`:rejected`) replies the server has sent, and replies of any status (`:served`)."
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
    limit = Keyword.get(opts, :limit, 10)
    window_ms = Keyword.get(opts, :window_ms, 1000)

    case Keyword.get(opts, :script) do
      [_ | _] = script ->
        Map.merge(stats, %{mode: :scripted, script: script})

      nil when is_integer(limit) and limit > 0 and is_integer(window_ms) and window_ms > 0 ->
        Map.merge(stats, %{mode: :fixed_window, limit: limit, window_ms: window_ms, used: %{}})

      _ ->
        raise ArgumentError,
              "expected a non-empty :script, or positive integers :limit and :window_ms"
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

  def handle_call({:serve, ip, weight}, _from, state) do
    {reply, state} = serve(state, ip, weight)
    {:reply, reply, state}
  end

  @impl GenServer
  def terminate(_reason, state), do: :inets.stop(:httpd, state.httpd)

  # The :httpd module API (`do/1` is a reserved word in Elixir, hence the unquote).
  @doc false
  def unquote(:do)(mod(config_db: config_db, parsed_header: headers, init_data: init)) do
    server = :httpd_util.lookup(config_db, :bourse_mock_exchange)
    header = fn name -> headers |> List.keyfind(name, 0, {name, nil}) |> elem(1) end
    {_port, peer} = init_data(init, :peername)
    ip = to_string(header.('x-client-ip') || peer)

    {status, reply_headers, body} =
      case parse_weight(header.('x-weight')) do
        {:ok, weight} -> GenServer.call(server, {:serve, ip, weight})
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

  defp serve(%{mode: :scripted, script: [reply | rest]} = state, _ip, _weight) do
    {status, _, _} = reply
    {reply, count(%{state | script: if(rest == [], do: [reply], else: rest)}, status)}
  end

  defp serve(%{mode: :fixed_window, limit: limit, window_ms: window_ms} = state, ip, weight) do
    now = System.os_time(:millisecond)
    window = div(now, window_ms)

    used =
      case state.used do
        %{^ip => {^window, used}} -> used
        _ -> 0
      end

    if used + weight > limit do
      retry_after = div((window + 1) * window_ms - now + 999, 1000)

      body =
        ~s({"code":-1003,"msg":"Too many requests; limit is #{limit} weight per #{window_ms} ms."})

      {{429, [{"retry-after", "#{retry_after}"} | used_headers(state, used, now)], body},
       count(state, 429)}
    else
      used = used + weight
      state = %{state | used: Map.put(state.used, ip, {window, used})}

      {{200, used_headers(state, used, now), ~s({"ok":true,"usedWeight":#{used}})},
       count(state, 200)}
    end
  end

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

  defp count(state, status) do
    state = %{state | served: state.served + 1}

    case status do
      200 -> %{state | accepted: state.accepted + 1}
      429 -> %{state | rejected: state.rejected + 1}
      _other -> state
    end
  end
end
