defmodule Bourse.RateLimiter.Backend.ConnectionReadersTest do
  # On a socket, a caller alone in flight reads its own answer, and the connection reads
  # when callers are many: one reader at a time, every answer to its caller, and the count
  # of requests in flight back to zero once all are answered, so the next caller alone
  # reads its answer again.
  use ExUnit.Case, async: true

  import Bourse.BackendCase
  import Bourse.ContractCase, only: [eventually: 1, now_ms: 0]

  alias Bourse.{FakeDaemon, RateLimiter}
  alias Bourse.RateLimiter.Backend.Connection
  alias Bourse.RateLimiter.Backend.Connection.PortStream

  @moduletag :capture_log

  @wide %{capacity: 1.0e9, refill_per_sec: 1.0e9}
  # The counters' slots (SocketStream): who reads, who writes.
  @reader 2
  @writer 3
  # Admits 3 checks, then says how long to wait: an answer routed to the wrong caller shows.
  @three %{capacity: 3, refill_per_sec: 0.001}
  # A limiter whose periodic sweep (a request to the daemon) does not come within a test.
  @unswept [sweep_interval_ms: 3_600_000]

  # The stream's counters (SocketStream): requests in flight, and who reads.
  defp counters(name) do
    [{:stream, {_socket, counters, _select, _port}, _, _, _, _}] =
      :ets.lookup(handle(name).table, :stream)

    counters
  end

  defp in_flight_and_reader(name) do
    counters = counters(name)
    {:atomics.get(counters, 1), :atomics.get(counters, 2)}
  end

  # A caller that sets `slot` of the stream's counters as a caller does before it writes
  # or reads alone (SocketStream.solo/5: its row, then the slot set to its id, or to what
  # `value` makes of it), killed there; returns once the connection's sweep dropped its row.
  defp killed_holding(name, slot, value \\ & &1) do
    counters = counters(name)
    table = handle(name).table
    id = System.unique_integer([:positive])

    holder =
      spawn(fn ->
        :ets.insert(table, {{:solo, id}, self()})
        :ok = :atomics.compare_exchange(counters, slot, 0, value.(id))
        Process.sleep(:infinity)
      end)

    eventually(fn -> :atomics.get(counters, slot) == value.(id) end)
    Process.exit(holder, :kill)
    eventually(fn -> :ets.lookup(table, {:solo, id}) == [] end)
    {table, id}
  end

  defp four_callers(name) do
    1..4
    |> Enum.map(fn i ->
      Task.async(fn -> RateLimiter.check_rate({"ex", "k#{i}"}, @wide, 1, name) end)
    end)
    |> Task.await_many(10_000)
  end

  defp unix_daemon(timeout \\ 1_000, limiter_opts \\ []) do
    path = Bourse.TempPath.new("readers", ".sock")
    daemon = start_daemon(["--socket", path])

    name =
      start_limiter({:daemon, {:unix, daemon.unix}, timeout: timeout}, "limiter", limiter_opts)

    # Connected: a short timeout may run out on a loaded machine before the stream is up.
    eventually(fn -> RateLimiter.check_rate({"ex", "warm"}, @wide, 1, name) == :ok end)
    name
  end

  # The messages the connection process receives while `fun` runs.
  defp received_by_connection(name, fun) do
    pid = handle(name).pid
    :erlang.trace(pid, true, [:receive])
    fun.()
    :erlang.trace(pid, false, [:receive])
    collect_traces(pid, [])
  end

  defp collect_traces(pid, messages) do
    receive do
      {:trace, ^pid, :receive, message} -> collect_traces(pid, [message | messages])
    after
      100 -> Enum.reverse(messages)
    end
  end

  test "a caller alone writes its request and reads its answer; the connection sees neither" do
    name = unix_daemon()

    messages =
      received_by_connection(name, fn ->
        for i <- 1..50, do: assert(:ok = RateLimiter.check_rate({"ex", "k#{i}"}, @wide, 1, name))
      end)

    assert for({:write, _stream, _id, _frame} = message <- messages, do: message) == []
    assert in_flight_and_reader(name) == {0, 0}
  end

  @tag timeout: 60_000
  test "callers alone and together, some killed as they wait: every answer is its own, and the next caller alone reads its own again" do
    name = unix_daemon()
    stop_at = now_ms() + 1_500

    # Bursts and pauses, so that callers find themselves alone as often as in a crowd.
    callers =
      for i <- 1..24 do
        Task.async(fn ->
          key = {"ex", "own-#{i}"}
          first = for _ <- 1..3, do: RateLimiter.check_rate(key, @three, 1, name)
          {first, later(key, name, stop_at, [])}
        end)
      end

    victims =
      for i <- 1..40 do
        spawn(fn ->
          Process.sleep(:rand.uniform(1_000))
          for _ <- 1..1_000, do: RateLimiter.check_rate({"ex", "victim-#{i}"}, @wide, 1, name)
        end)
      end

    for victim <- victims do
      Process.sleep(:rand.uniform(30))
      Process.exit(victim, :kill)
    end

    callers |> Task.await_many(30_000) |> assert_own_answers()

    # The answers of the victims' last requests are read by someone, then no one reads;
    # unless a victim was killed between counting its request and writing it (rare: it
    # must be preempted right there), which leaves one answer expected for good
    # (SocketStream's comment), the connection reading, and callers going through it.
    settled =
      eventually(fn ->
        state = in_flight_and_reader(name)
        state in [{0, 0}, {1, -1}] && state
      end)

    # No route left, and the rows of victims killed as they wrote or read alone swept: the
    # table holds the stream alone, as a caller alone finds it.
    eventually(fn -> :ets.info(handle(name).table, :size) == 1 end)

    # Its own request: the limiter's own (a keepalive, its sweep) may go through the
    # connection then, and a caller that comes just after the connection wrote finds a
    # crowd and hands its request over; the next caller alone writes its own.
    assert settled == {1, -1} or
             eventually(fn -> written_by_itself?(name, "after-#{System.unique_integer()}") end)
  end

  defp written_by_itself?(name, axis) do
    messages =
      received_by_connection(name, fn ->
        assert :ok = RateLimiter.check_rate({"ex", axis}, @wide, 1, name)
      end)

    Process.sleep(5)

    not Enum.any?(messages, fn
      {:write, _stream, _id, frame} -> :binary.match(IO.iodata_to_binary(frame), axis) != :nomatch
      _other -> false
    end)
  end

  test "a caller killed once it wrote alone, before it left the reading: its answer is read at the next sweep, and callers alone read their own again" do
    # The limiter's periodic sweep, a request, would read the answer too.
    name = unix_daemon(200, @unswept)
    [{:stream, stream, _, _, _, _}] = :ets.lookup(handle(name).table, :stream)
    {socket, counters, _select, _port} = stream

    payload = Connection.encode(System.unique_integer([:positive]), %{op: "hello"})
    :atomics.add(counters, 1, 1)
    :ok = :socket.send(socket, PortStream.frame(payload, byte_size(payload)))

    eventually(fn -> in_flight_and_reader(name) == {0, 0} end)

    # The hello's answer had no caller: the connection asks it back, a request of its own
    # that a caller may meet in flight and hand its request over; the next one alone
    # writes its own.
    assert eventually(fn -> written_by_itself?(name, "after-#{System.unique_integer()}") end)
  end

  test "a caller killed while it reads the socket: the connection reads instead, also once its row was swept" do
    # Routes and rows of dead callers are swept every second (the timeout, which the
    # connection, scheduled late on a loaded machine, has to take over and answer in).
    name = unix_daemon(1_000)
    {table, id} = killed_holding(name, @reader)

    # Left to the dead caller, they would time out.
    assert four_callers(name) == [:ok, :ok, :ok, :ok]
    eventually(fn -> in_flight_and_reader(name) == {0, 0} end)
    assert :ets.lookup(table, {:solo, id}) == []
  end

  test "a caller killed while it holds the write: its frame went whole or not at all, and the connection writes instead, also once its row was swept" do
    name = unix_daemon(1_000)
    counters = counters(name)
    killed_holding(name, @writer, & &1)

    # Left to the dead caller, they would time out.
    assert four_callers(name) == [:ok, :ok, :ok, :ok]
    # The same stream.
    assert counters(name) == counters
  end

  test "a caller killed as it hands the rest of a frame the socket took in part: the stream, which holds a part of it, is reopened" do
    name = unix_daemon(1_000)
    counters = counters(name)
    killed_holding(name, @writer, &(-&1))

    assert {:error, %Bourse.Error{type: :unavailable, message: message}} =
             RateLimiter.check_rate({"ex", "k"}, @wide, 1, name)

    assert message =~ "writer_killed"
    eventually(fn -> RateLimiter.check_rate({"ex", "k"}, @wide, 1, name) == :ok end)
    assert counters(name) != counters
  end

  @tag timeout: 60_000
  test "a caller alive as it hands over the rest of its frame: the connection writes it, the stream stays" do
    name = unix_daemon()
    counters = counters(name)

    for round <- 1..200 do
      assert handing_over(name, round) == {:answered, true}
      assert counters(name) == counters, "round #{round}: the stream was reopened"
    end
  end

  # A caller whose frame the socket took in part, as `SocketStream.solo_write/6` hands the
  # rest over (here the whole frame, so that the daemon reads a request): its write marked
  # as handed over, the rest sent to the connection, then its row dropped; meanwhile other
  # callers' frames keep the connection waiting for the write.
  defp handing_over(name, round) do
    %{table: table, pid: connection} = handle(name)
    counters = counters(name)
    [{:stream, stream, _, _, _, _}] = :ets.lookup(table, :stream)
    id = System.unique_integer([:positive])
    payload = Connection.encode(id, %{op: "hello"})
    frame = PortStream.frame(payload, byte_size(payload))
    reply_to = :erlang.alias([:reply])
    :ets.insert(table, {id, {reply_to, now_ms() + 1_000}})
    :ets.insert(table, {{:solo, id}, self()})
    eventually(fn -> :atomics.compare_exchange(counters, @writer, 0, id) == :ok end)
    :atomics.add(counters, 1, 1)
    :atomics.put(counters, @writer, -id)

    others =
      for i <- 1..2,
          do:
            Task.async(fn -> RateLimiter.check_rate({"ex", "o#{round}-#{i}"}, @wide, 1, name) end)

    Process.sleep(1)
    send(connection, {:unsent, stream, frame})
    :ets.delete(table, {:solo, id})
    if :atomics.get(counters, 1) > 0, do: send(connection, {:read, stream})
    assert Task.await_many(others) == [:ok, :ok]

    receive do
      {^reply_to, answer} -> {:answered, Map.has_key?(Connection.answer(answer, id), "protocol")}
    after
      1_000 -> :ets.delete(table, id) && :no_answer
    end
  end

  defp later(key, name, stop_at, answers) do
    if now_ms() >= stop_at do
      answers
    else
      if :rand.uniform(4) == 1, do: Process.sleep(:rand.uniform(3))
      later(key, name, stop_at, [RateLimiter.check_rate(key, @three, 1, name) | answers])
    end
  end

  test "a daemon that answers a request twice: the stream is reopened, and later calls are answered" do
    path = fake_daemon(_answer_twice = 2)
    # Only the test's own requests: the third is the one that finds the stream broken.
    name = start_limiter({:daemon, {:unix, path}, timeout: 300}, "limiter", @unswept)

    assert {:error, %Bourse.Error{message: message}} =
             eventually(fn ->
               case RateLimiter.check_rate({"ex", "k"}, @wide, 1, name) do
                 {:error, %Bourse.Error{message: message}} = refused ->
                   message =~ "more than it was asked for" and refused

                 _answered ->
                   false
               end
             end)

    assert message =~ "the daemon sent 1 answer(s) more than it was asked for"
    eventually(fn -> RateLimiter.check_rate({"ex", "k"}, @wide, 1, name) == :ok end)
    for i <- 1..20, do: assert(:ok = RateLimiter.check_rate({"ex", "k#{i}"}, @wide, 1, name))
  end

  # Every request admitted, the `twice`-th one (of all connections) answered twice.
  defp fake_daemon(twice) do
    requests = :counters.new(1, [:atomics])
    FakeDaemon.start("twice", &answer(&1, requests, twice))
  end

  defp answer(socket, requests, twice) do
    with %{id: id} <- FakeDaemon.request(socket) do
      admitted = :erlang.term_to_binary(%{"id" => id, "ok" => true, "result" => "admitted"})
      frame = [<<byte_size(admitted)::32>>, admitted]
      :counters.add(requests, 1, 1)
      n = :counters.get(requests, 1)
      :gen_tcp.send(socket, if(n == twice, do: [frame, frame], else: frame))
      answer(socket, requests, twice)
    end
  end
end
