defmodule Bourse.PeerNode do
  @moduledoc """
  A second BEAM node for tests of names that reach another node: a peer VM on
  127.0.0.1 with this build's code paths, this VM made a distributed node for it.

      {peer, node} = Bourse.PeerNode.start()
      :erpc.call(node, Bourse.PeerNode, :start_children, [[{Bourse.RateLimiter, name: :lim}]])
  """

  import ExUnit.Assertions

  @doc "Makes this VM a node (epmd started if need be) and starts a peer; `{peer, node}`."
  @spec start() :: {pid(), node()}
  def start do
    unless Node.alive?(),
      do: distribute(:"bourse_test_#{System.pid()}_#{System.unique_integer([:positive])}")

    {:ok, peer, node} =
      :peer.start(%{
        name: :"bourse_peer_#{System.pid()}_#{System.unique_integer([:positive])}",
        host: ~c"127.0.0.1",
        longnames: true,
        args: Enum.flat_map(:code.get_path(), &[~c"-pa", &1])
      })

    {peer, node}
  end

  @doc """
  `start/0` from a test module's `setup_all`: the peer is stopped, and this VM is a node no
  more, once the module's tests ended. Returns the peer's node.
  """
  @spec start_for_module() :: node()
  def start_for_module do
    {peer, node} = start()

    ExUnit.Callbacks.on_exit(fn ->
      :peer.stop(peer)
      :net_kernel.stop()
    end)

    node
  end

  @doc """
  Makes this VM the node `name@127.0.0.1`, starting epmd if need be. `epmd -daemon`
  returns before the new epmd listens, so it is asked until it answers: registering with it
  sooner fails (`econnrefused`).
  """
  @spec distribute(atom()) :: :ok
  def distribute(name) do
    epmd = System.find_executable("epmd") || flunk("epmd not found")
    System.cmd(epmd, ["-daemon"])

    Bourse.Loopback.wait_until(
      fn -> elem(System.cmd(epmd, ["-names"], stderr_to_stdout: true), 1) == 0 end,
      "epmd answers",
      10_000
    )

    {:ok, _} = :net_kernel.start(:"#{name}@127.0.0.1", %{name_domain: :longnames})
    :ok
  end

  @doc """
  Starts `children` under a supervisor of their own on this node, owned by no caller (so
  that it outlives an `:erpc` call); returns `:ok` once they run.
  """
  @spec start_children([Supervisor.child_spec() | {module(), term()}]) :: :ok
  def start_children(children) do
    caller = self()

    spawn(fn ->
      send(caller, {:started, Supervisor.start_link(children, strategy: :one_for_one)})
      Process.sleep(:infinity)
    end)

    receive do
      {:started, {:ok, _supervisor}} -> :ok
      {:started, other} -> flunk("the children did not start: #{inspect(other)}")
    after
      10_000 -> flunk("the children did not start in 10 s")
    end
  end
end
