defmodule Bourse.RateLimiter.BackoffTest do
  # The table is one per VM: these tests fill it, so they run alone.
  use ExUnit.Case, async: false

  alias Bourse.RateLimiter.Backoff

  defp key(i), do: {__MODULE__, "digest-#{i}"}

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
