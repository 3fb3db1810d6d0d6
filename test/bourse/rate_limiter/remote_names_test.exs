defmodule Bourse.RateLimiter.RemoteNamesTest do
  # Names that reach a limiter on another node: {name, node}, {:global, _} and remote
  # pids go through the limiter's process there, and only once that process is known to
  # be a limiter. The other node is a peer VM started here with this build's code.
  use ExUnit.Case, async: false

  alias Bourse.RateLimiter

  @moduletag :distributed
  @limit %{capacity: 2, refill_per_sec: 0.001}

  setup_all do
    node = Bourse.PeerNode.start_for_module()

    # A limiter and an Agent (also a :global name) on the peer. (No anonymous functions:
    # the peer does not have this module's code.)
    children = [
      {RateLimiter, name: :remote_limiter},
      %{
        id: :agent,
        start: {Agent, :start_link, [String, :to_atom, ["untouched"], [name: :agent]]}
      }
    ]

    :ok = :erpc.call(node, Bourse.PeerNode, :start_children, [children])
    agent = :erpc.call(node, Process, :whereis, [:agent])
    :yes = :global.register_name(:remote_agent, agent)
    %{node: node}
  end

  test "{name, node}, its pid and a :global name reach the limiter there", %{node: node} do
    pid = :erpc.call(node, Process, :whereis, [:remote_limiter])
    :yes = :global.register_name(:remote_limiter, pid)
    on_exit(fn -> :global.unregister_name(:remote_limiter) end)

    for {name, key} <- [
          {{:remote_limiter, node}, {"ex", "by-name"}},
          {pid, {"ex", "by-pid"}},
          {{:global, :remote_limiter}, {"ex", "global"}}
        ] do
      assert :ok = RateLimiter.check_rate(key, @limit, 2, name)
      assert {:delay, _} = RateLimiter.check_rate(key, @limit, 1, name)
      assert {:delay, _} = RateLimiter.check_rates([{key, @limit, 1}], name)
      assert RateLimiter.get_cost(key, 1, name) >= 1.99
      assert %{admitted: admitted} = RateLimiter.stats(name)
      assert admitted >= 1
      assert :ok = RateLimiter.reset(key, name)
      assert RateLimiter.get_cost(key, 1, name) == 0
    end
  end

  test "calls there do not wait in the limiter's mailbox", %{node: node} do
    pid = :erpc.call(node, Process, :whereis, [:remote_limiter])
    :ok = :erpc.call(node, :sys, :suspend, [pid])
    on_exit(fn -> :erpc.call(node, :sys, :resume, [pid]) end)

    for name <- [{:remote_limiter, node}, pid] do
      assert :ok = RateLimiter.check_rate({"ex", "suspended"}, @limit, 1, name)
      assert RateLimiter.get_cost({"ex", "suspended"}, 1, name) >= 0.99
      assert :ok = RateLimiter.reset({"ex", "suspended"}, name)
    end
  end

  test "a waiter by {name, node} claims its booking from the limiter restarted there", %{
    node: node
  } do
    key = {"ex", "restarted-while-waiting"}
    limit = %{capacity: 1, refill_per_sec: 2}
    name = {:remote_limiter, node}
    assert :ok = RateLimiter.check_rate(key, limit, 1, name)
    waiter = Task.async(fn -> RateLimiter.wait_for_capacity(key, limit, 1, name) end)
    Process.sleep(100)
    old = :erpc.call(node, Process, :whereis, [:remote_limiter])
    true = :erpc.call(node, Process, :exit, [old, :kill])

    assert Task.await(waiter, 5_000) == :ok
    assert :erpc.call(node, Process, :whereis, [:remote_limiter]) != old
    assert RateLimiter.get_cost(key, 1, name) <= 1.01
  end

  test "another process there is :invalid_parameters and is left alone", %{node: node} do
    agent = :erpc.call(node, Process, :whereis, [:agent])

    for name <- [{:agent, node}, agent, {:global, :remote_agent}] do
      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               RateLimiter.check_rate({"ex", "k"}, @limit, 1, name)

      assert message =~ "not a limiter"
      assert {:error, %Bourse.Error{type: :invalid_parameters}} = RateLimiter.stats(name)
    end

    assert :erpc.call(node, :sys, :get_state, [:agent]) == :untouched
  end

  test "nothing there, or no such node: the exits of GenServer.call/2", %{node: node} do
    key = {"ex", "k"}
    assert {:noproc, _} = catch_exit(RateLimiter.check_rate(key, @limit, 1, {:nobody, node}))

    assert {{:nodedown, :"nobody@127.0.0.1"}, _} =
             catch_exit(RateLimiter.check_rate(key, @limit, 1, {:lim, :"nobody@127.0.0.1"}))
  end
end
