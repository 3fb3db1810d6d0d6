defmodule Bourse.FakeDaemon do
  @moduledoc """
  Something on a Unix socket that answers a client's hello as a `bourse_daemon` does (in
  the external term format, no secret asked), then does with each connection what a test
  wants: stays silent, answers wrongly, sends too much.
  """

  import ExUnit.Callbacks, only: [on_exit: 1]

  @doc """
  Listens on a new Unix socket (its name starting with `prefix`, removed when the test
  ends) and hands every connection, once its hello is answered, to `serve` in a task of its
  own. Returns the socket's path.
  """
  @spec start(String.t(), (:gen_tcp.socket() -> term())) :: Path.t()
  def start(prefix, serve) do
    path = Bourse.TempPath.new("#{prefix}", ".sock")
    {:ok, listener} = :gen_tcp.listen(0, [:binary, ifaddr: {:local, path}, active: false])
    on_exit(fn -> File.rm(path) end)
    Task.start_link(fn -> accept(listener, serve) end)
    path
  end

  defp accept(listener, serve) do
    {:ok, socket} = :gen_tcp.accept(listener)
    {:ok, _line} = :gen_tcp.recv(socket, 0)
    :ok = :gen_tcp.send(socket, hello(nil))
    Task.start_link(fn -> serve.(socket) end)
    accept(listener, serve)
  end

  @doc "The next request on `socket`, decoded; `:closed` once the client is gone."
  @spec request(:gen_tcp.socket()) :: map() | :closed
  def request(socket) do
    with {:ok, <<size::32>>} <- :gen_tcp.recv(socket, 4),
         {:ok, request} <- :gen_tcp.recv(socket, size) do
      :erlang.binary_to_term(request)
    else
      {:error, _closed} -> :closed
    end
  end

  @doc "A check request, as a connection's callers send it."
  @spec check() :: map()
  def check do
    %{
      op: "check",
      key: %{exchange: "x", credential: nil, axis: "k"},
      limit: %{"capacity" => 1, "refill_per_sec" => 1},
      cost: 1
    }
  end

  @doc "The frame of a daemon's answer to a hello, in the external term format, with `auth`."
  @spec hello(map() | nil) :: iodata()
  def hello(auth) do
    hello =
      :erlang.term_to_binary(%{
        "id" => 0,
        "ok" => true,
        "protocol" => 1,
        "max_frame_bytes" => 65_536,
        "auth" => auth,
        "clock_us" => System.monotonic_time(:microsecond)
      })

    [<<byte_size(hello)::32>>, hello]
  end
end
