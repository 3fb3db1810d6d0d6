defmodule Bourse.RateLimiter.Backend.Connection.SocketStream do
  @moduledoc false
  # A connection to a `bourse_daemon` server on TCP or a Unix socket: a JSON line asks for
  # the external term format, then every frame both ways (the hello's answer, the proof of
  # the shared secret over TCP, requests, answers) is a 4-byte big-endian length and a term,
  # framed as on a port (`PortStream`). Reconnected after a backoff; the limiter may start
  # while the daemon is not up yet.

  @behaviour Bourse.RateLimiter.Backend.Connection.Transport

  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.PortStream

  @handshake_timeout 5_000

  @impl true
  def open({:socket, address}, settings) do
    with {:ok, socket} <- connect(address, settings.timeout),
         {:ok, hello} <- handshake(socket, settings.secret) do
      {:ok, socket, hello}
    end
  end

  defp connect({:tcp, host, port}, timeout) do
    opts = [nodelay: true] ++ socket_opts(timeout)
    tagged(:gen_tcp.connect(host, port, opts, @handshake_timeout), "cannot connect")
  end

  defp connect({:unix, path}, timeout) do
    opts = socket_opts(timeout)
    tagged(:gen_tcp.connect({:local, path}, 0, opts, @handshake_timeout), "cannot connect")
  end

  # Callers write their requests themselves: a write the socket cannot take at once waits
  # in the VM's queue for the socket (past 1 MiB of them, writers are told it is busy); one
  # left there for longer than the callers' timeout closes the socket. Raw bytes: the frames
  # are written and read by `PortStream`'s framing.
  defp socket_opts(timeout) do
    [:binary, packet: :raw, active: false, buffer: 64 * 1024] ++
      [high_watermark: 1024 * 1024, low_watermark: 512 * 1024] ++
      [send_timeout: timeout, send_timeout_close: true]
  end

  defp handshake(socket, secret) do
    with :ok <- tagged(:gen_tcp.send(socket, [Connection.hello_request(), ?\n]), "cannot send"),
         {:ok, frame} <- recv_frame(socket, "no hello"),
         {:ok, hello} <- Connection.hello(frame),
         :ok <- prove(socket, hello, secret),
         :ok <- :inet.setopts(socket, active: true) do
      {:ok, hello}
    else
      error ->
        :gen_tcp.close(socket)
        error
    end
  end

  # A daemon reached over TCP asks for proof of the shared secret: the HMAC-SHA256 of the
  # nonce in its hello. The secret itself is never sent.
  defp prove(_socket, %{"auth" => nil}, _secret), do: :ok

  defp prove(_socket, %{"auth" => %{}}, nil) do
    {:error,
     "the daemon asks for its shared secret: set BOURSE_DAEMON_SECRET or the backend's " <>
       "secret_file: option"}
  end

  defp prove(socket, %{"auth" => %{"scheme" => "hmac-sha256", "nonce" => nonce}}, secret) do
    proof = :crypto.mac(:hmac, :sha256, secret, nonce) |> Base.encode16(case: :lower)
    request = Connection.encode(0, %{op: "auth", proof: proof})

    with :ok <-
           tagged(:gen_tcp.send(socket, [<<byte_size(request)::32>>, request]), "cannot send"),
         {:ok, frame} <- recv_frame(socket, "no answer to auth") do
      case Connection.decode(frame) do
        {:ok, %{"ok" => true}} ->
          :ok

        _ ->
          {:error, "the daemon refused the proof of the shared secret (is it the same secret?)"}
      end
    end
  end

  defp prove(_socket, %{"auth" => _}, _secret),
    do: {:error, "the daemon asks for a proof this client does not know"}

  defp prove(_socket, _hello, _secret), do: :ok

  defp tagged({:error, reason}, what), do: {:error, "#{what}: #{:inet.format_error(reason)}"}
  defp tagged(ok, _what), do: ok

  # One length-prefixed frame of the handshake, read exactly (what follows it stays in the
  # socket for the connection); a daemon that refuses the connection (at
  # its --max-connections) or does not know the codec answers a JSON line instead.
  defp recv_frame(socket, what) do
    with {:ok, header} <- recv(socket, 4, what) do
      case header do
        <<?{, _::binary>> -> json_line(socket, what, header)
        <<size::32>> when size > 1024 * 1024 -> {:error, "#{what}: a frame of #{size} bytes"}
        <<0::32>> -> {:ok, ""}
        <<size::32>> -> recv(socket, size, what)
      end
    end
  end

  defp json_line(socket, what, line) do
    cond do
      String.contains?(line, "\n") or byte_size(line) > 1024 ->
        {:error, "the daemon answered in JSON: #{String.slice(line, 0, 300)}"}

      true ->
        with {:ok, more} <- recv(socket, 0, what), do: json_line(socket, what, line <> more)
    end
  end

  defp recv(socket, size, what), do: tagged(:gen_tcp.recv(socket, size, @handshake_timeout), what)

  # Each write goes whole into the socket's queue, so writers never interleave; one that
  # finds the queue full is not queued (`:busy`).
  @impl true
  def write(socket, iodata) do
    if :erlang.port_command(socket, iodata, [:nosuspend]) do
      receive do
        {:inet_reply, ^socket, status} -> status
      end
    else
      :busy
    end
  rescue
    ArgumentError -> {:error, :closed}
  end

  # The connection's own writes: the socket's answer comes as a message (`received/2`).
  @impl true
  def write_nowait(socket, iodata) do
    if :erlang.port_command(socket, iodata, [:nosuspend]), do: :ok, else: :busy
  rescue
    ArgumentError -> {:error, :closed}
  end

  @impl true
  def close(socket), do: :gen_tcp.close(socket)

  @impl true
  def received({:tcp, socket, data}, socket), do: {:data, data}
  def received({:tcp_closed, socket}, socket), do: {:down, "the daemon closed the connection"}

  def received({:tcp_error, socket, reason}, socket),
    do: {:down, "connection error #{inspect(reason)}"}

  def received({:inet_reply, socket, {:error, reason}}, socket),
    do: {:down, "cannot write: #{inspect(reason)}"}

  def received(_message, _socket), do: :other

  @impl true
  defdelegate no_partial, to: PortStream

  @impl true
  defdelegate answers(partial, data), to: PortStream

  @impl true
  def reopen, do: :after_backoff

  @impl true
  def start_without_it?, do: true

  @impl true
  def describe({:socket, {:unix, path}}), do: "bourse_daemon at unix:#{path}"

  def describe({:socket, {:tcp, host, port}}) when is_tuple(host),
    do: "bourse_daemon at #{:inet.ntoa(host)}:#{port}"

  def describe({:socket, {:tcp, host, port}}), do: "bourse_daemon at #{host}:#{port}"
end
