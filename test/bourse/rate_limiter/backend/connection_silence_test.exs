defmodule Bourse.RateLimiter.Backend.ConnectionSilenceTest do
  # A caller without an answer makes the connection send a hello; a connection whose hello
  # goes unanswered for a while is made again (docs/PROTOCOL.md, "Deadlines"). One that
  # answers its hellos is not silent, however many checks it leaves unanswered.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.{Error, FakeDaemon}
  alias Bourse.RateLimiter.Backend.Connection

  # Tells the test of every connection, answers each hello 30 ms late and no check.
  defp slow_daemon do
    test = self()

    FakeDaemon.start("bourse-slow-hello", fn socket ->
      send(test, :connected)
      answer_hellos_late(socket)
    end)
  end

  defp answer_hellos_late(socket) do
    case FakeDaemon.request(socket) do
      %{op: "hello"} ->
        Process.sleep(30)
        :gen_tcp.send(socket, FakeDaemon.hello(nil))
        answer_hellos_late(socket)

      %{op: "check"} ->
        answer_hellos_late(socket)

      :closed ->
        :ok
    end
  end

  test "a connection that answers its hellos is kept while checks go unanswered" do
    {:ok, handle} = Connection.attach(nil, {:socket, {:unix, slow_daemon(), nil}}, timeout: 5)
    assert_receive :connected, 5_000
    until = System.monotonic_time(:millisecond) + 2_500

    Stream.repeatedly(fn -> Connection.request(handle, FakeDaemon.check()) end)
    |> Stream.take_while(fn answer ->
      assert {:error, %Error{type: :unavailable}} = answer
      System.monotonic_time(:millisecond) < until
    end)
    |> Stream.run()

    refute_received :connected
  end
end
