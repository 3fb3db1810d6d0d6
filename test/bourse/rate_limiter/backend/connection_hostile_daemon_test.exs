defmodule Bourse.RateLimiter.Backend.ConnectionHostileDaemonTest do
  # A connection to something on the daemon's Unix socket that is no bourse_daemon once the
  # hello is done: what it sends must not make the VM buffer without bound.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.{Error, FakeDaemon}
  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.PortStream

  @largest 64 * 1024 * 1024

  # Answers the hello as a daemon does, then, to the first request, a frame header of
  # `size` bytes followed by `chunks` MiB of filler.
  defp fake_daemon(size, chunks) do
    FakeDaemon.start("bourse-fake", fn socket ->
      %{} = FakeDaemon.request(socket)
      filler = :binary.copy(<<0>>, 1024 * 1024)
      :gen_tcp.send(socket, <<size::32>>)
      Enum.reduce_while(1..chunks, :ok, fn _, :ok -> {:cont, :gen_tcp.send(socket, filler)} end)
      Process.sleep(:infinity)
    end)
  end

  test "an answer announced as 4 GiB breaks the stream at once instead of being buffered" do
    path = fake_daemon(0xFFFFFFFF, 256)
    {:ok, handle} = Connection.attach(nil, {:socket, {:unix, path, nil}}, timeout: 10_000)

    assert {:error, %Error{type: :unavailable, message: message}} =
             Connection.request(handle, FakeDaemon.check())

    assert message =~ "an answer of 4294967295 bytes"
    # What it holds, not what it dropped and has not collected yet: the data that arrived
    # before the socket closed is handled (a call comes after it), then garbage collected
    # (101 MB of dropped chunks were still counted once, on a loaded machine).
    _state = :sys.get_state(handle.pid)
    :erlang.garbage_collect(handle.pid)
    {:binary, held} = Process.info(handle.pid, :binary)
    assert Enum.sum(for {_, size, _} <- held, do: size) < 64 * 1024 * 1024
  end

  # 16 MiB in 8 KiB reads took 24 s when each read joined what came before (the frame was
  # copied at every read), about 50 ms once it is joined when whole.
  test "a large answer in many reads is joined once, not at every read" do
    size = 16 * 1024 * 1024
    chunk = :binary.copy(<<7>>, 8192)
    {[], partial} = PortStream.answers(PortStream.no_partial(), <<size::32>>)
    started = System.monotonic_time(:millisecond)

    partial =
      Enum.reduce(2..div(size, 8192), partial, fn _, partial ->
        {[], partial} = PortStream.answers(partial, chunk)
        partial
      end)

    assert {[frame], <<>>} = PortStream.answers(partial, chunk)
    elapsed = System.monotonic_time(:millisecond) - started
    assert frame == :binary.copy(chunk, div(size, 8192))
    assert elapsed < 5_000, "#{elapsed} ms"
  end

  test "the answers before a header past the bound are kept, what follows it is not" do
    data = <<3::32, "abc", 0xFFFFFFFF::32, 0, 0>>

    assert {:error, ["abc"], "the daemon announced an answer of 4294967295 bytes" <> _} =
             PortStream.answers(PortStream.no_partial(), data)

    # 64 MiB: the largest answer read, waited for.
    assert {["abc"], partial} =
             PortStream.answers(PortStream.no_partial(), <<3::32, "abc", @largest::32>>)

    assert {[], _partial} = PortStream.answers(partial, "more")
  end
end
