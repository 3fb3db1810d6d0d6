defmodule Bourse.AnswerHold do
  @moduledoc """
  A relay to a server's loopback port that holds the server's answers while told to: the
  server runs what it is sent, and its answers come late, as when it is stopped between
  running a call and writing the answer.
  """

  defstruct [:port, :held, :acceptor]

  @type t :: %__MODULE__{port: :inet.port_number(), held: :atomics.atomics_ref(), acceptor: pid()}

  @doc "Starts a relay to `server_port`, linked to the caller."
  @spec start(:inet.port_number()) :: t()
  def start(server_port) do
    {:ok, listener} =
      :gen_tcp.listen(0, [:binary, ip: {127, 0, 0, 1}, active: false, reuseaddr: true])

    {:ok, port} = :inet.port(listener)
    held = :atomics.new(1, [])
    acceptor = spawn_link(fn -> accept(listener, server_port, held) end)
    :ok = :gen_tcp.controlling_process(listener, acceptor)
    %__MODULE__{port: port, held: held, acceptor: acceptor}
  end

  @doc "Holds the server's answers (`true`), or passes them on again, held ones first."
  @spec hold(t(), boolean()) :: :ok
  def hold(%__MODULE__{held: held}, on?), do: :atomics.put(held, 1, if(on?, do: 1, else: 0))

  defp accept(listener, server_port, held) do
    {:ok, client} = :gen_tcp.accept(listener)
    {:ok, server} = :gen_tcp.connect(~c"127.0.0.1", server_port, [:binary, active: false])
    requests = spawn(fn -> pass_on(client, server, nil) end)
    answers = spawn(fn -> pass_on(server, client, held) end)
    :ok = :gen_tcp.controlling_process(client, requests)
    :ok = :gen_tcp.controlling_process(server, answers)
    accept(listener, server_port, held)
  end

  defp pass_on(from, to, held) do
    with {:ok, bytes} <- :gen_tcp.recv(from, 0),
         :ok <- wait_while_held(held),
         :ok <- :gen_tcp.send(to, bytes) do
      pass_on(from, to, held)
    else
      {:error, _} -> :gen_tcp.close(to)
    end
  end

  defp wait_while_held(nil), do: :ok

  defp wait_while_held(held) do
    if :atomics.get(held, 1) == 1 do
      Process.sleep(5)
      wait_while_held(held)
    else
      :ok
    end
  end
end
