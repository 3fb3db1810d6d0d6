defmodule Bourse.RateLimiter.Backend.ConnectionLateAnswersTest do
  # An answer that comes after its caller gave up (told :unavailable): what it paid is asked
  # back of the daemon, by the request's id; an answer that paid nothing is not.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.{Error, FakeDaemon}
  alias Bourse.RateLimiter.Backend.Connection

  @timeout 200

  # Answers each request with `answers`' next one, past the caller's timeout, and tells the
  # test every request it read.
  defp late_daemon(answers) do
    test = self()

    FakeDaemon.start("bourse-late", fn socket ->
      Enum.reduce_while(Stream.cycle([:next]), answers, fn :next, answers ->
        case FakeDaemon.request(socket) do
          :closed ->
            {:halt, answers}

          request ->
            send(test, {:read, request})
            answer(socket, request, answers)
        end
      end)
    end)
  end

  defp answer(socket, %{op: "check", id: id}, [answer | answers]) do
    Process.sleep(2 * @timeout)
    frame = :erlang.term_to_binary(Map.put(answer, "id", id))
    :ok = :gen_tcp.send(socket, [<<byte_size(frame)::32>>, frame])
    {:cont, answers}
  end

  defp answer(_socket, _request, answers), do: {:cont, answers}

  test "a late admitted answer is asked back by its id; a late refusal is not" do
    admitted = %{"ok" => true, "result" => "admitted"}
    refused = %{"ok" => false, "error" => %{"type" => "unavailable", "message" => "late"}}
    path = late_daemon([admitted, refused, admitted])
    {:ok, handle} = Connection.attach(nil, {:socket, {:unix, path, nil}}, timeout: @timeout)

    assert {:error, %Error{type: :unavailable}} = Connection.request(handle, FakeDaemon.check())
    assert_receive {:read, %{op: "check", id: paid}}
    assert_receive {:read, %{op: "give_back", of: ^paid}}, 2_000

    assert {:error, %Error{type: :unavailable}} = Connection.request(handle, FakeDaemon.check())
    assert_receive {:read, %{op: "check", id: unpaid}}
    Process.sleep(3 * @timeout)
    assert {:error, %Error{type: :unavailable}} = Connection.request(handle, FakeDaemon.check())
    assert_receive {:read, %{op: "check", id: next}}
    assert next != unpaid
    refute_received {:read, %{op: "give_back"}}
  end
end
