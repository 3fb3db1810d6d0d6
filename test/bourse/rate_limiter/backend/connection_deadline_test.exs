defmodule Bourse.RateLimiter.Backend.ConnectionDeadlineTest do
  # The deadline a request carries (docs/PROTOCOL.md, "Deadlines") is the moment its caller
  # stops waiting: a caller that gave up before it could be told `:unavailable` for a
  # request the daemon still runs, and pays.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.Error
  alias Bourse.RateLimiter.Backend.Connection

  @check %{
    op: "check",
    key: %{exchange: "x", credential: nil, axis: "k"},
    limit: %{"capacity" => 1, "refill_per_sec" => 1},
    cost: 1
  }

  # Answers the hello as a daemon on this VM's monotonic clock would, then tells the test
  # the deadline of every request it reads, and answers none.
  defp silent_daemon do
    path =
      Path.join(System.tmp_dir!(), "bourse-silent-#{System.unique_integer([:positive])}.sock")

    {:ok, listener} = :gen_tcp.listen(0, [:binary, ifaddr: {:local, path}, active: false])
    on_exit(fn -> File.rm(path) end)
    test = self()

    Task.start_link(fn ->
      {:ok, socket} = :gen_tcp.accept(listener)
      {:ok, _line} = :gen_tcp.recv(socket, 0)

      hello =
        :erlang.term_to_binary(%{
          "id" => 0,
          "ok" => true,
          "protocol" => 1,
          "max_frame_bytes" => 65_536,
          "auth" => nil,
          "clock_us" => System.monotonic_time(:microsecond)
        })

      :ok = :gen_tcp.send(socket, [<<byte_size(hello)::32>>, hello])
      read_requests(socket, test)
    end)

    path
  end

  defp read_requests(socket, test) do
    {:ok, <<size::32>>} = :gen_tcp.recv(socket, 4)
    {:ok, request} = :gen_tcp.recv(socket, size)
    %{deadline_us: deadline_us, timeout_ms: timeout_ms} = :erlang.binary_to_term(request)
    send(test, {:deadline, deadline_us, timeout_ms})
    read_requests(socket, test)
  end

  for timeout <- [1, 2, 3, 7] do
    test "with a timeout of #{timeout} ms, no caller gives up before its request's deadline" do
      timeout = unquote(timeout)

      {:ok, handle} =
        Connection.attach(nil, {:socket, {:unix, silent_daemon()}}, timeout: timeout)

      early =
        for _ <- 1..40 do
          assert {:error, %Error{type: :unavailable}} = Connection.request(handle, @check)
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
