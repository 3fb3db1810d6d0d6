defmodule Bourse.Loopback do
  @moduledoc """
  Servers the tests start on this machine (`redis-server`, Redis Cluster nodes, the
  dependent app's daemon): a free loopback port for them, and waiting until they answer.
  """

  import ExUnit.Assertions

  @doc "A TCP port free on 127.0.0.1 now."
  @spec free_port() :: :inet.port_number()
  def free_port do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :gen_tcp.close(socket)
    port
  end

  @doc """
  Polls `probe` every `every_ms` until it returns true; fails the test, naming `what`,
  after `timeout_ms`.
  """
  @spec wait_until((() -> boolean()), String.t(), pos_integer(), pos_integer()) :: :ok
  def wait_until(probe, what, timeout_ms, every_ms \\ 20) do
    deadline = System.monotonic_time(:millisecond) + timeout_ms
    poll(probe, what, deadline, every_ms)
  end

  defp poll(probe, what, deadline, every_ms) do
    cond do
      probe.() ->
        :ok

      System.monotonic_time(:millisecond) > deadline ->
        flunk("never happened: #{what}")

      true ->
        Process.sleep(every_ms)
        poll(probe, what, deadline, every_ms)
    end
  end
end
