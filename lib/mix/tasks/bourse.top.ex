defmodule Mix.Tasks.Bourse.Top do
  @shortdoc "Prints the busiest buckets of a running limiter"

  @moduledoc """
  Prints the busiest buckets of a running limiter (`Bourse.RateLimiter.busiest/2`): the
  keys with the most tokens borrowed, or holding bookings, busiest first.

      mix bourse.top --node app@host --cookie-file PATH [--name MyApp.Limiter] [--count 20]

  Options:

    * `--name` – the limiter's registered name (default `Bourse.RateLimiter`): a module
      name such as `MyApp.Limiter`, or an atom written `:my_limiter`;
    * `--count` – how many rows (default 20, at most 10000);
    * `--node` – the node the limiter runs on, queried through `:rpc`; this VM is started
      as a hidden distributed node if it is not one yet;
    * `--cookie-file` – a file holding that node's cookie (a release's `releases/COOKIE`,
      say; default: this VM's cookie, from `~/.erlang.cookie`);
    * `--cookie` – the cookie itself, for a try on one's own machine: a command line is
      shown to every local user (`ps`), and the cookie lets its holder run any code on
      the node.

  Without `--node` the local VM is queried, which is what a running application wants:

      iex> Mix.Tasks.Bourse.Top.run(["--name", "MyApp.Limiter"])

  or, where Mix is not available (a release's remote console):

      Bourse.RateLimiter.busiest(20, MyApp.Limiter) |> Mix.Tasks.Bourse.Top.table() |> IO.puts()

  Credentials are shown as fingerprints (`Bourse.Fingerprint`), never as API keys.
  `NEXT READY MS` is the time until the key's earliest booking is ready, `PAUSE MS` what is
  left of a pause covering it (after a 429, for instance).
  """

  use Mix.Task

  @switches [name: :string, count: :integer, node: :string, cookie: :string, cookie_file: :string]
  @columns [
    {"EXCHANGE", :left},
    {"CREDENTIAL", :left},
    {"AXIS", :left},
    {"CAPACITY", :right},
    {"REFILL/S", :right},
    {"TOKENS", :right},
    {"BORROWED", :right},
    {"BOOKINGS", :right},
    {"NEXT READY MS", :right},
    {"PAUSE MS", :right}
  ]

  @impl true
  def run(args) when args in [["--help"], ["-h"]], do: Mix.shell().info(@moduledoc)

  def run(args) do
    opts =
      case OptionParser.parse(args, strict: @switches) do
        {opts, [], []} -> opts
        _ -> Mix.raise("usage: " <> usage())
      end

    name = limiter_name(Keyword.get(opts, :name, "Bourse.RateLimiter"))
    count = Keyword.get(opts, :count, 20)

    case busiest(opts[:node], cookie(opts), count, name) do
      {:ok, []} -> Mix.shell().info("no busy buckets in #{inspect(name)}")
      {:ok, rows} -> Mix.shell().info(table(rows))
      {:error, message} -> Mix.raise(message)
    end
  end

  defp cookie(opts) do
    case {opts[:cookie], opts[:cookie_file]} do
      {cookie, nil} ->
        cookie

      {nil, path} ->
        case File.read(path) do
          {:ok, text} ->
            String.trim(text)

          {:error, reason} ->
            Mix.raise("cannot read --cookie-file #{path}: #{:file.format_error(reason)}")
        end

      _both ->
        Mix.raise("give --cookie or --cookie-file, not both")
    end
  end

  @doc """
  Formats rows of `Bourse.RateLimiter.busiest/2` as a text table, one line per row under
  a header line.
  """
  @spec table([map()]) :: String.t()
  def table(rows) do
    lines = [Enum.map(@columns, &elem(&1, 0)) | Enum.map(rows, &cells/1)]

    widths =
      lines
      |> Enum.zip_with(fn column -> column |> Enum.map(&String.length/1) |> Enum.max() end)

    Enum.map_join(lines, "\n", fn line ->
      [line, widths, @columns]
      |> Enum.zip_with(fn [cell, width, {_, align}] -> pad(cell, width, align) end)
      |> Enum.join("  ")
      |> String.trim_trailing()
    end)
  end

  defp cells(row) do
    limit = row[:limit] || %{}

    [
      row.exchange,
      credential(row.credential),
      row.axis,
      number(limit[:capacity]),
      number(limit[:refill_per_sec]),
      number(row.tokens),
      number(row.borrowed),
      number(row.bookings),
      number(row.next_ready_ms),
      number(row.pause_ms)
    ]
  end

  defp credential(:public), do: ":public"
  defp credential(fingerprint), do: fingerprint

  defp number(nil), do: "-"
  defp number(n) when is_integer(n), do: Integer.to_string(n)

  defp number(x) when is_float(x) do
    if x == Float.round(x) and abs(x) < 1.0e15,
      do: x |> trunc() |> Integer.to_string(),
      else: :erlang.float_to_binary(x, decimals: 2)
  end

  defp pad(cell, width, :left), do: String.pad_trailing(cell, width)
  defp pad(cell, width, :right), do: String.pad_leading(cell, width)

  defp busiest(nil, _cookie, count, name) do
    rows(Bourse.RateLimiter.busiest(count, name))
  catch
    :exit, {:noproc, _} ->
      {:error, "no limiter named #{inspect(name)} runs in this VM; give --node to query another"}
  end

  defp busiest(node, cookie, count, name) do
    with :ok <- full_name(node),
         node = String.to_atom(node),
         :ok <- connect(node, cookie) do
      case :rpc.call(node, Bourse.RateLimiter, :busiest, [count, name], 15_000) do
        {:badrpc, {:EXIT, {:noproc, _}}} ->
          {:error, "no limiter named #{inspect(name)} runs on #{node}"}

        {:badrpc, reason} ->
          {:error, "cannot query #{node}: #{inspect(reason)}"}

        answer ->
          rows(answer)
      end
    end
  end

  # A node name without a host cannot be connected to (Erlang logs why first).
  defp full_name(node) do
    case String.split(node, "@") do
      [name, host] when name != "" and host != "" -> :ok
      _ -> {:error, "--node must be name@host (as the node names itself), got #{inspect(node)}"}
    end
  end

  defp rows({:error, error}), do: {:error, Exception.message(error)}
  defp rows(rows), do: {:ok, rows}

  defp connect(node, cookie) do
    with :ok <- start_distribution(node) do
      if cookie, do: Node.set_cookie(node, String.to_atom(cookie))

      if Node.connect(node) == true,
        do: :ok,
        else: {:error, "cannot connect to #{node} (is it running, and is the cookie right?)"}
    end
  end

  defp start_distribution(node) do
    if Node.alive?() do
      :ok
    else
      # epmd may not run yet on a machine without other distributed nodes.
      if epmd = System.find_executable("epmd"), do: System.cmd(epmd, ["-daemon"])

      case :net_kernel.start(self_name(node), %{name_domain: name_domain(node), hidden: true}) do
        {:ok, _} -> :ok
        {:error, reason} -> {:error, "cannot start distribution: #{inspect(reason)}"}
      end
    end
  end

  # A node on this host is reached as it names itself; elsewhere Erlang names this one.
  defp self_name(node) do
    id = "bourse_top_#{System.unique_integer([:positive])}"

    case node |> Atom.to_string() |> String.split("@") do
      [_, host] when host in ["127.0.0.1", "localhost"] -> :"#{id}@#{host}"
      _ -> String.to_atom(id)
    end
  end

  defp name_domain(node) do
    case node |> Atom.to_string() |> String.split("@") do
      [_, host] -> if String.contains?(host, "."), do: :longnames, else: :shortnames
      _ -> :shortnames
    end
  end

  defp limiter_name(":" <> atom), do: String.to_atom(atom)

  defp limiter_name(name) do
    if name =~ ~r/\A[A-Z]/, do: Module.concat([name]), else: String.to_atom(name)
  end

  defp usage,
    do:
      "mix bourse.top [--name NAME] [--count N] [--node NODE [--cookie-file PATH | --cookie COOKIE]]"
end
