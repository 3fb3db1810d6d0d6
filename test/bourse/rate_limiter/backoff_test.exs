defmodule Bourse.RateLimiter.BackoffTest do
  # The table is one per VM: these tests fill it, so they run alone.
  use ExUnit.Case, async: false

  alias Bourse.RateLimiter.Backoff

  defp key(i), do: {__MODULE__, "digest-#{i}"}

  test "the :bourse application supervises the table's owner: killed, it is started again" do
    assert {Bourse.Application, []} = Application.spec(:bourse, :mod)
    owner = Process.whereis(Backoff)
    assert is_pid(owner), "no owner before the first limited reply"
    assert [{Backoff, ^owner, :worker, _}] = Supervisor.which_children(Bourse.Supervisor)

    ref = Process.monitor(owner)
    Process.exit(owner, :kill)
    assert_receive {:DOWN, ^ref, :process, ^owner, :killed}

    Bourse.ContractCase.eventually(fn ->
      match?(
        [{Backoff, pid, :worker, _}] when is_pid(pid) and pid != owner,
        Supervisor.which_children(Bourse.Supervisor)
      )
    end)

    # Counting starts again from zero, in the new owner's table.
    key = key(:restarted)
    assert Backoff.bump(key) == 0
    assert Backoff.bump(key) == 1
    assert :ok = Backoff.clear(key)
  end

  test "concurrent limited replies each count once; clear forgets" do
    key = key(:concurrent)

    1..5_000
    |> Task.async_stream(fn _ -> Backoff.bump(key) end, max_concurrency: 500)
    |> Enum.map(fn {:ok, before} -> before end)
    |> Enum.sort()
    |> then(&assert(&1 == Enum.to_list(0..4_999)))

    assert Backoff.count(key) == 5_000
    assert :ok = Backoff.clear(key)
    assert Backoff.count(key) == 0
  end

  test "at most 10,000 entries: a new credential is not counted when the table is full" do
    keys = for i <- 1..10_000, do: key(i)
    on_exit(fn -> Enum.each(keys ++ [key(:late)], &Backoff.clear/1) end)
    Enum.each(keys, &Backoff.bump/1)

    # Entries of other tests may be there too: the table is full either way.
    assert Backoff.bump(key(:late)) == 0
    assert Backoff.count(key(:late)) == 0
    # Known credentials still count.
    assert Backoff.bump(key(1)) == 1

    Backoff.clear(key(2))
    assert Backoff.bump(key(:late)) == 0
    assert Backoff.count(key(:late)) == 1
  end
end
