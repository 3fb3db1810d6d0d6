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

  # Reads two checks, answers both admitted in one write past their callers' timeout, then
  # `after_answers.(socket)`; tells the test every request it read.
  defp late_pair_daemon(after_answers) do
    test = self()

    FakeDaemon.start("bourse-late-pair", fn socket ->
      ids = for _ <- 1..2, do: FakeDaemon.request(socket).id
      Process.sleep(2 * @timeout)

      frames =
        for id <- ids do
          frame = :erlang.term_to_binary(%{"id" => id, "ok" => true, "result" => "admitted"})
          [<<byte_size(frame)::32>>, frame]
        end

      :ok = :gen_tcp.send(socket, frames)
      send(test, {:answered, ids})
      after_answers.(socket)
    end)
  end

  defp forward_requests(socket, test) do
    with %{} = request <- FakeDaemon.request(socket) do
      send(test, {:read, request})
      forward_requests(socket, test)
    end
  end

  test "late answers read together are each asked back" do
    test = self()

    path = late_pair_daemon(&forward_requests(&1, test))

    {:ok, handle} = Connection.attach(nil, {:socket, {:unix, path, nil}}, timeout: @timeout)
    two = for _ <- 1..2, do: Task.async(fn -> Connection.request(handle, FakeDaemon.check()) end)
    assert [{:error, %Error{}}, {:error, %Error{}}] = Task.await_many(two)
    assert_receive {:answered, [a, b]}
    assert_receive {:read, %{op: "give_back", of: ^a}}, 2_000
    assert_receive {:read, %{op: "give_back", of: ^b}}, 2_000
  end

  test "late answers followed by the daemon closing: the connection goes on" do
    path = late_pair_daemon(&:gen_tcp.close/1)
    {:ok, handle} = Connection.attach(nil, {:socket, {:unix, path, nil}}, timeout: @timeout)
    two = for _ <- 1..2, do: Task.async(fn -> Connection.request(handle, FakeDaemon.check()) end)
    assert [{:error, %Error{}}, {:error, %Error{}}] = Task.await_many(two)
    assert_receive {:answered, _ids}
    Process.sleep(@timeout)
    assert Process.alive?(handle.pid)
  end

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
