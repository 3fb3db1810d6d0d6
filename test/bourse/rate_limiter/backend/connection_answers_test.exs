defmodule Bourse.RateLimiter.Backend.ConnectionAnswersTest do
  # What a caller makes of the daemon's answers and what it puts in its requests, on a real
  # `bourse_daemon --stdio`.
  use ExUnit.Case, async: true

  alias Bourse.RateLimiter.Backend
  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.PortStream

  @settings %{assume_busy: false, busy_start: nil, env: [], secret: nil, timeout: 5_000}
  @limit %{"capacity" => 1, "refill_per_sec" => 0.001}

  setup do
    {:ok, stream, _hello} =
      PortStream.open({:port, Backend.Port.executable(), ["--stdio"]}, @settings)

    on_exit(fn -> PortStream.close(stream) end)
    %{port: elem(stream, 0)}
  end

  defp frame(socket, id, request) do
    payload = Connection.encode(id, request)
    :ok = :socket.send(socket, PortStream.frame(payload, byte_size(payload)))
    answer(socket, PortStream.no_partial())
  end

  defp answer(socket, partial) do
    {:ok, data} = :socket.recv(socket, 0, [], 5_000)

    case PortStream.answers(partial, data) do
      {[frame], <<>>} -> frame
      {[], partial} -> answer(socket, partial)
    end
  end

  defp check(key),
    do: %{op: "check", key: %{exchange: "x", credential: nil, axis: key}, limit: @limit, cost: 1}

  test "an admitted check is known by its bytes, whatever the size of its id", %{port: port} do
    # Ids that the daemon writes as a small integer, an integer and a big.
    for {id, n} <- Enum.with_index([7, 70_000, 2 ** 40]) do
      frame = frame(port, id, check("admitted-#{n}"))
      assert {:ok, %{"id" => ^id, "result" => "admitted"}} = Connection.decode(frame)
      # Not decoded: no id in it (a decoded answer has one).
      assert Connection.answer(frame, id) == %{"ok" => true, "result" => "admitted"}
    end
  end

  test "any other answer is decoded, with its id", %{port: port} do
    assert %{"ok" => true, "result" => "admitted"} =
             Connection.answer(frame(port, 1, check("other")), 1)

    assert %{"id" => 2, "ok" => true, "result" => "delay", "ms" => ms} =
             Connection.answer(frame(port, 2, check("other")), 2)

    assert ms > 0

    assert %{"id" => 3, "ok" => false, "error" => %{"type" => "invalid_parameters"}} =
             Connection.answer(frame(port, 3, %{check("other") | cost: -1}), 3)

    assert %{"id" => 4, "ok" => true} =
             Connection.answer(frame(port, 4, %{op: "get_cost", key: check("x").key}), 4)
  end

  test "answers split anywhere across reads come out whole, in order" do
    frames = for n <- [0, 1, 3, 300, 70_000], do: :binary.copy(<<n, n + 1>>, div(n, 2) + 1)
    stream = IO.iodata_to_binary(for f <- frames, do: PortStream.frame(f, byte_size(f)))

    for cut <- [0, 1, 2, 3, 4, 5, 6, 9, 11, 12, 13, 100, 400, 70_000, byte_size(stream)] do
      <<first::binary-size(cut), second::binary>> = stream
      {before, partial} = PortStream.answers(PortStream.no_partial(), first)
      {later, rest} = PortStream.answers(partial, second)
      assert before ++ later == frames, "cut at #{cut}"
      assert rest == <<>>
    end

    # Byte by byte.
    {answers, rest} =
      for <<byte <- stream>>, reduce: {[], PortStream.no_partial()} do
        {answers, partial} ->
          {more, partial} = PortStream.answers(partial, <<byte>>)
          {answers ++ more, partial}
      end

    assert {answers, rest} == {frames, <<>>}
  end

  test "each handle's owner in the calling process carries that handle's prefix" do
    handle = fn prefix ->
      %Connection{
        pid: self(),
        table: nil,
        pauses: nil,
        owner_prefix: prefix,
        timeout: 1,
        config: ""
      }
    end

    me = List.to_string(:erlang.pid_to_list(self()))
    assert Connection.owner(handle.("a-"), self()) == "a-" <> me
    assert Connection.owner(handle.("b-"), self()) == "b-" <> me
    assert Connection.owner(handle.("a-"), self()) == "a-" <> me

    other = spawn(fn -> :ok end)

    assert Connection.owner(handle.("a-"), other) ==
             "a-" <> List.to_string(:erlang.pid_to_list(other))
  end
end
