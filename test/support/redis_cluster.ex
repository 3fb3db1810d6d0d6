defmodule Bourse.RedisCluster do
  @moduledoc """
  Runs a Redis Cluster on loopback for tests: six `redis-server` processes (three masters,
  three replicas, no persistence) in a temporary directory, joined with
  `redis-cli --cluster create`.

      cluster = Bourse.RedisCluster.start()
      cluster.urls    #=> ["redis://127.0.0.1:40123", ...]
      Bourse.RedisCluster.stop(cluster)

  The servers outlive the process that started them, so a cluster can be started in
  `setup_all` and stopped in `on_exit`. `unavailable/0` says why no cluster can be made
  here (`nil` when one can); tests skip with that reason only.
  """

  import ExUnit.Assertions
  import Bourse.Loopback, only: [free_port: 0]

  alias Bourse.Loopback

  @enforce_keys [:dir, :nodes, :urls]
  defstruct @enforce_keys

  @type t :: %__MODULE__{
          dir: Path.t(),
          nodes: %{:inet.port_number() => pos_integer()},
          urls: [String.t()]
        }

  @doc "Why no cluster can be created on this machine, or `nil`."
  @spec unavailable() :: String.t() | nil
  def unavailable do
    cond do
      System.find_executable("redis-server") == nil ->
        "no redis-server (make deps installs it)"

      System.find_executable("redis-cli") == nil ->
        "no redis-cli (make deps installs it)"

      not (cli(["--cluster", "help"]) |> elem(0) |> String.contains?("create")) ->
        "this redis-cli cannot create a cluster (Redis >= 5 needed)"

      true ->
        nil
    end
  end

  @doc """
  Starts the cluster and waits until every slot is served and every replica is in sync.
  `node_timeout_ms` (default 2000) is the `cluster-node-timeout`: how long a master may
  be silent before its replica takes over.
  """
  @spec start(keyword()) :: t()
  def start(opts \\ []) do
    node_timeout = Keyword.get(opts, :node_timeout_ms, 2_000)
    dir = Bourse.TempPath.new("bourse-cluster")
    File.mkdir_p!(dir)
    nodes = for _ <- 1..6, into: %{}, do: start_node(dir, node_timeout)
    ports = Map.keys(nodes)

    {output, status} =
      cli(
        ["--cluster", "create"] ++
          Enum.map(ports, &"127.0.0.1:#{&1}") ++ ["--cluster-replicas", "1", "--cluster-yes"]
      )

    assert status == 0, "redis-cli --cluster create failed: #{output}"
    cluster = %__MODULE__{dir: dir, nodes: nodes, urls: Enum.map(ports, &url/1)}
    wait_healthy(cluster)
    cluster
  end

  @doc "Stops every node without saving and removes the directory."
  @spec stop(t()) :: :ok
  def stop(cluster) do
    for {port, os_pid} <- cluster.nodes do
      redis(port, ["SHUTDOWN", "NOSAVE"])
      System.cmd("kill", ["-KILL", Integer.to_string(os_pid)], stderr_to_stdout: true)
    end

    File.rm_rf!(cluster.dir)
    :ok
  end

  @doc "Kills the node on `port` (SIGKILL, as a crash)."
  @spec kill(t(), :inet.port_number()) :: :ok
  def kill(cluster, port) do
    {_, 0} = System.cmd("kill", ["-KILL", Integer.to_string(Map.fetch!(cluster.nodes, port))])
    wait_until(fn -> not ping(port) end, "node #{port} is gone")
  end

  @doc "The slot of `key`."
  @spec key_slot(t(), binary()) :: non_neg_integer()
  def key_slot(cluster, key) do
    cluster |> any_live() |> redis(["CLUSTER", "KEYSLOT", key]) |> String.to_integer()
  end

  @doc "The port of the master serving `slot` now."
  @spec master_of_slot(t(), non_neg_integer()) :: :inet.port_number()
  def master_of_slot(cluster, slot) do
    %{port: port} =
      cluster
      |> topology()
      |> Enum.find(&(&1.master and not &1.failed and Enum.any?(&1.slots, fn r -> slot in r end)))

    port
  end

  @doc "Waits until every live node sees all slots served and every live replica is in sync."
  @spec wait_healthy(t()) :: :ok
  def wait_healthy(cluster), do: wait_until(fn -> healthy?(cluster) end, "the cluster is healthy")

  @doc "The nodes as a live node's `CLUSTER NODES` lists them."
  @spec topology(t()) :: [map()]
  def topology(cluster) do
    cluster |> any_live() |> redis(["CLUSTER", "NODES"]) |> parse_nodes()
  end

  defp healthy?(cluster) do
    live = Enum.filter(Map.keys(cluster.nodes), &ping/1)
    nodes = topology(cluster)

    served =
      for n <- nodes,
          n.master and not n.failed,
          r <- n.slots,
          reduce: 0,
          do: (s -> s + Range.size(r))

    Enum.all?(live, &(redis(&1, ["CLUSTER", "INFO"]) =~ "cluster_state:ok")) and served == 16_384 and
      Enum.all?(
        for(n <- nodes, not n.master and not n.failed and n.port in live, do: n.port),
        &in_sync?/1
      )
  end

  defp in_sync?(port) do
    info = info(port)

    with "up" <- info["master_link_status"],
         master when is_binary(master) <- info["master_port"] do
      info(String.to_integer(master))["master_repl_offset"] == info["slave_repl_offset"]
    else
      _ -> false
    end
  end

  defp info(port) do
    for line <- String.split(redis(port, ["INFO", "replication"]), ["\r\n", "\n"]),
        [name, value] <- [String.split(line, ":", parts: 2)],
        into: %{},
        do: {name, value}
  end

  defp parse_nodes(text) do
    for line <- String.split(text, "\n", trim: true),
        [id, address, flags, master | rest] = String.split(line),
        length(rest) >= 4 do
      [_, port] = Regex.run(~r/:(\d+)@/, address)
      flags = String.split(flags, ",")

      %{
        id: id,
        port: String.to_integer(port),
        master: "master" in flags,
        master_id: if(master == "-", do: nil, else: master),
        failed: "fail" in flags,
        slots:
          for slot <- Enum.drop(rest, 4), not String.starts_with?(slot, "[") do
            case String.split(slot, "-") do
              [a, b] -> String.to_integer(a)..String.to_integer(b)
              [a] -> String.to_integer(a)..String.to_integer(a)
            end
          end
      }
    end
  end

  defp any_live(cluster) do
    Enum.find(Map.keys(cluster.nodes), &ping/1) || flunk("no cluster node answers")
  end

  # A node on a port found free. Another process can take that port (or the bus port)
  # before the node binds it: the node then exits, and is started again on other ports.
  # Only the node's own process answering counts (INFO's process_id).
  defp start_node(dir, node_timeout, attempts \\ 10) do
    port = free_port()
    {server, os_pid} = spawn_node(dir, port, node_timeout)

    if wait_serving(server, port, os_pid) do
      {port, os_pid}
    else
      System.cmd("kill", ["-KILL", Integer.to_string(os_pid)], stderr_to_stdout: true)
      assert attempts > 1, "no redis-server node could bind a free port"
      start_node(dir, node_timeout, attempts - 1)
    end
  end

  defp spawn_node(dir, port, node_timeout) do
    node_dir = Path.join(dir, "#{port}")
    File.mkdir_p!(node_dir)

    server =
      Port.open({:spawn_executable, System.find_executable("redis-server")}, [
        :binary,
        :exit_status,
        args:
          ~w(--port #{port} --bind 127.0.0.1 --cluster-enabled yes) ++
            ~w(--cluster-port #{free_port()} --cluster-config-file nodes.conf) ++
            ~w(--cluster-node-timeout #{node_timeout} --cluster-replica-validity-factor 0) ++
            ["--save", "", "--appendonly", "no", "--dir", node_dir]
      ])

    {:os_pid, os_pid} = Port.info(server, :os_pid)
    {server, os_pid}
  end

  # Whether the node's own process answers on `port` before it exits (within 60 s).
  defp wait_serving(server, port, os_pid, waited_ms \\ 0) do
    receive do
      {^server, {:exit_status, _}} -> false
    after
      0 ->
        cond do
          redis(port, ["INFO", "server"]) =~ "process_id:#{os_pid}\r\n" ->
            true

          waited_ms >= 60_000 ->
            flunk("node #{port} never answered")

          true ->
            Process.sleep(50)
            wait_serving(server, port, os_pid, waited_ms + 50)
        end
    end
  end

  defp url(port), do: "redis://127.0.0.1:#{port}"

  defp ping(port), do: redis(port, ["PING"]) == "PONG"

  # One command through redis-cli; its output without the trailing newline ("" on failure).
  defp redis(port, args) do
    {output, _} = cli(["-h", "127.0.0.1", "-p", "#{port}"] ++ args)
    String.trim_trailing(output, "\n")
  end

  defp cli(args), do: System.cmd("redis-cli", args, stderr_to_stdout: true)

  defp wait_until(probe, what), do: Loopback.wait_until(probe, what, 60_000, 50)
end
