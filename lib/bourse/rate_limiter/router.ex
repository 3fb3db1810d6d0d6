defmodule Bourse.RateLimiter.Router do
  @moduledoc """
  Where a call to a limiter name goes.

  A running limiter publishes its backend, its bucket table's handle, its event sink and
  its pid in `:persistent_term` under its name, and that name under its pid
  (`publish/2`); a caller of a local name reads that entry and reaches the table from its
  own process, without the limiter's mailbox. Every other name (`{:global, _}`,
  `{:via, _, _}`, `{name, node}`, a pid) is resolved to a process: one of this node
  that published an entry is reached the same way; one of another node is asked there
  (`run/4`). A pid or name of any other process is refused with `:invalid_parameters` and
  that process is left alone.

  A limiter whose process has ended (stopped or crashed) answers like one never started
  (the call exits with `:noproc`), also while its entry is still published: the entry
  stays a few seconds for a restarted limiter to take its table over (docs/CONTRACT.md,
  P6), then it is withdrawn (`withdraw_when_down/3`).
  """

  alias Bourse.Error

  @typedoc "What a local limiter publishes: `{backend, handle, events, server_pid}`."
  @type entry :: {module(), term(), Bourse.RateLimiter.Events.t(), pid()}

  @typedoc """
  A resolved name: the entry of a local limiter, a limiter process to call, or why the
  name reaches no limiter (`:noproc`, `{:exit, reason}` for a node that cannot be asked,
  `{:invalid, message}`).
  """
  @type route ::
          entry() | {:remote, pid()} | :noproc | {:exit, term()} | {:invalid, String.t()}

  @remote_timeout 5_000
  @remote_poll 1_000

  ## Publishing (by the limiter process)

  @doc "The entry published under the name `name`, whoever published it, or `nil`."
  @spec published(GenServer.name()) :: entry() | nil
  def published(name), do: :persistent_term.get(slot(name), nil)

  @doc """
  Publishes `entry` under `name` (rewritten only when it changed). Callers read it for
  local names; for every name, a restarted limiter finds its predecessor's table there.
  """
  @spec publish(GenServer.name(), entry()) :: :ok
  def publish(name, {_backend, _handle, _events, owner} = entry) do
    if published(name) !== entry, do: :persistent_term.put(slot(name), entry)
    :persistent_term.put(pid_slot(owner), name)
    :ok
  end

  @doc """
  Withdraws the entry `owner` published under `name` once `owner` has been down for
  `grace_ms`, unless a successor has published its own by then. Returns at once.
  """
  @spec withdraw_when_down(GenServer.name(), pid(), non_neg_integer()) :: :ok
  def withdraw_when_down(name, owner, grace_ms) do
    spawn(fn ->
      ref = Process.monitor(owner)

      receive do
        {:DOWN, ^ref, :process, _pid, _reason} -> :persistent_term.erase(pid_slot(owner))
      end

      Process.sleep(grace_ms)

      case published(name) do
        {_backend, _handle, _events, ^owner} -> :persistent_term.erase(slot(name))
        _successor_or_none -> false
      end
    end)

    :ok
  end

  defp slot(name), do: {Bourse.RateLimiter, name}

  # The name a running limiter published its entry under, by its pid.
  defp pid_slot(pid), do: {Bourse.RateLimiter, :pid, pid}

  ## Routing (by callers)

  @doc "Resolves `name` (any `GenServer.name()` or a pid) to a `t:route/0`."
  @spec route(term()) :: route()
  def route(name) when is_atom(name) and name != nil do
    case :persistent_term.get({Bourse.RateLimiter, name}, nil) do
      {_backend, _handle, _events, owner} = entry ->
        if :erlang.is_process_alive(owner), do: entry, else: registered(name)

      nil ->
        registered(name)
    end
  end

  def route({:global, global} = name), do: name |> whereis(fn -> :global.whereis_name(global) end)

  def route({:via, module, via} = name) when is_atom(module),
    do: whereis(name, fn -> module.whereis_name(via) end)

  def route({local, node} = name) when is_atom(local) and is_atom(node) and local != nil do
    cond do
      node == node() -> route(local)
      node == nil -> invalid(name)
      true -> ask(node, {local, node}, local)
    end
  end

  def route(pid) when is_pid(pid) and node(pid) == node(), do: local(pid)
  def route(pid) when is_pid(pid), do: ask(node(pid), pid, pid)
  def route(name), do: invalid(name)

  # A local name without a published entry: a limiter still starting (it answers through
  # its process once started), another process or a port (refused) or nothing.
  defp registered(name) do
    case Process.whereis(name) do
      nil -> :noproc
      pid when is_pid(pid) -> limiter(pid, name)
      _port -> {:invalid, "not a limiter: #{describe(name)} is a port"}
    end
  end

  defp whereis(name, lookup) do
    case lookup.() do
      pid when is_pid(pid) and node(pid) == node() -> local(pid, name)
      pid when is_pid(pid) -> ask(node(pid), pid, name)
      _ -> :noproc
    end
  rescue
    # `{:via, NotAModule, _}`, a registry that is not running, or one that does not know
    # the name's shape: named by the exception's module alone (its message may show the
    # name's terms).
    exception -> invalid(name, " (looking it up raised #{inspect(exception.__struct__)})")
  end

  # A process of this node: a running limiter's published entry, so that its caller
  # reaches the table itself, as for a local name; else what `limiter/2` finds.
  defp local(pid, name \\ nil) do
    with published_as when published_as != nil <- :persistent_term.get(pid_slot(pid), nil),
         {_backend, _handle, _events, ^pid} = entry <- published(published_as),
         true <- :erlang.is_process_alive(pid) do
      entry
    else
      _ -> limiter(pid, name)
    end
  end

  defp limiter(pid, name) do
    cond do
      :proc_lib.translate_initial_call(pid) == {Bourse.RateLimiter.Server, :init, 1} ->
        {:remote, pid}

      Process.alive?(pid) ->
        {:invalid, "not a limiter: #{describe(name || pid)} is another process"}

      true ->
        :noproc
    end
  end

  # A name or pid on another node is resolved there, where its process can be looked at.
  defp ask(node, server, name) do
    case :erpc.call(node, __MODULE__, :route, [server], @remote_timeout) do
      {:remote, pid} -> {:remote, pid}
      {_backend, _handle, _events, pid} -> {:remote, pid}
      :noproc -> :noproc
      {:invalid, _} -> invalid(name)
    end
  catch
    # The node is down or unreachable (as `GenServer.call/2` exits), or runs no `:bourse`.
    :error, {:erpc, :noconnection} -> {:exit, {:nodedown, node}}
    :error, {:erpc, reason} -> {:exit, reason}
    :error, {:exception, :undef, _} -> invalid(name)
  end

  defp invalid(name, why \\ ""), do: {:invalid, "not a limiter name: #{describe(name)}#{why}"}

  @doc """
  Runs the call `fun` of `Bourse.RateLimiter` with `args` for the limiter process `pid` (a
  `{:remote, pid}` route), which the caller named `name` (as its exits name it). On another
  node it runs in a process of that node, which reaches the limiter's table as a local
  caller does: calls do not queue in the limiter's mailbox, and each is bounded by its
  backend's own timeout. A limiter of this node still starting (its entry not yet
  published) is called.
  """
  @spec run(pid(), atom(), list(), term()) :: term()
  def run(pid, fun, args, name)

  def run(pid, :stats, [], _name) when node(pid) == node(), do: GenServer.call(pid, :stats)

  def run(pid, fun, args, name) when node(pid) == node() do
    GenServer.call(pid, {:run, fun, args})
  catch
    # Without the request, whose arguments hold the caller's key.
    :exit, {reason, {GenServer, :call, _request}} -> exit_as_call(reason, name)
  end

  def run(pid, fun, args, name) do
    node = node(pid)
    request = :erpc.send_request(node, Bourse.RateLimiter, :run_here, [pid, fun, args])
    await(request, node, name)
  catch
    :error, {:erpc, :noconnection} -> exit_as_call({:nodedown, node(pid)}, name)
    :error, {:erpc, reason} -> exit_as_call(reason, name)
    # As raised there, without the stack, whose arguments would show the caller's key.
    :exit, {:exception, reason} -> exit(reason)
    :error, {:exception, reason, _stack} -> :erlang.error(reason)
  end

  # The answer of a call run on `node`, however long it rightly takes there (a waiter's
  # budget, the backend's timeout), as long as `node` runs: while it is awaited, `node` is
  # asked every second to answer, and a node that does not within `@remote_timeout`
  # (stopped, or cut off before distribution notices, which takes a minute) ends the
  # wait as a `GenServer.call/2` timeout does.
  defp await(request, node, name) do
    case :erpc.wait_response(request, @remote_poll) do
      {:response, result} ->
        result

      :no_response ->
        if responsive?(node) do
          await(request, node, name)
        else
          abandon(request)
          exit_as_call(:timeout, name)
        end
    end
  end

  defp responsive?(node) do
    :erpc.call(node, :erlang, :node, [], @remote_timeout) == node
  catch
    :error, {:erpc, _reason} -> false
  end

  # A reply that comes after this is dropped, not left in the caller's mailbox.
  defp abandon(request) do
    :erpc.receive_response(request, 0)
  catch
    _kind, _reason -> :ok
  end

  @doc """
  Exits as `GenServer.call/2` does for a name that reaches no running limiter (`reason`
  `:noproc`, or why its node could not be asked).
  """
  @spec exit_as_call(term(), term()) :: no_return()
  def exit_as_call(reason, name), do: exit({reason, {Bourse.RateLimiter, :call, [name]}})

  @doc "The `:invalid_parameters` error of a route refused as `{:invalid, message}`."
  @spec error(String.t()) :: {:error, Error.t()}
  def error(message), do: {:error, Error.invalid(message)}

  # Names are shown, but a binary (an API key, perhaps) or a large term only by its shape.
  defp describe(name) when is_atom(name), do: inspect(name)
  defp describe({:global, _}), do: "{:global, term}"

  defp describe({:via, module, _}) when is_atom(module),
    do: "{:via, #{inspect(module)}, term}"

  defp describe({local, node}) when is_atom(local) and is_atom(node),
    do: inspect({local, node})

  defp describe(pid) when is_pid(pid), do: inspect(pid)
  defp describe(other), do: Error.describe(other)
end
