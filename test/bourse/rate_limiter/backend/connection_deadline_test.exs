defmodule Bourse.RateLimiter.Backend.ConnectionDeadlineTest do
  # The deadline a request carries (docs/PROTOCOL.md, "Deadlines") is the moment its caller
  # stops waiting: a caller that gave up before it could be told `:unavailable` for a
  # request the daemon still runs, and pays.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.{Error, FakeDaemon}
  alias Bourse.RateLimiter.Backend.Connection

  # Answers the hello as a daemon on this VM's monotonic clock would, then tells the test
  # the deadline of every request it reads, and answers none (but the connection's hellos,
  # which show it is not silent).
  defp silent_daemon do
    test = self()
    FakeDaemon.start("bourse-silent", &read_requests(&1, test))
  end

  defp read_requests(socket, test) do
    case FakeDaemon.request(socket) do
      %{op: "hello"} ->
        :ok = :gen_tcp.send(socket, FakeDaemon.hello(nil))

      %{deadline_us: deadline_us, timeout_ms: timeout_ms} ->
        send(test, {:deadline, deadline_us, timeout_ms})
    end

    read_requests(socket, test)
  end

  for timeout <- [1, 2, 3, 7] do
    test "with a timeout of #{timeout} ms, no caller gives up before its request's deadline" do
      timeout = unquote(timeout)

      {:ok, handle} =
        Connection.attach(nil, {:socket, {:unix, silent_daemon(), nil}}, timeout: timeout)

      early =
        for _ <- 1..40 do
          assert {:error, %Error{type: :unavailable}} =
                   Connection.request(handle, FakeDaemon.check())

          gave_up_us = System.monotonic_time(:microsecond)
          assert_receive {:deadline, deadline_us, ^timeout}, 5_000
          # Spread the calls over the millisecond.
          Process.sleep(:rand.uniform(3) - 1)
          if gave_up_us < deadline_us, do: deadline_us - gave_up_us
        end

      assert Enum.reject(early, &is_nil/1) == [],
             "callers gave up this many µs before their deadline: #{inspect(early)}"
    end
  end
end
