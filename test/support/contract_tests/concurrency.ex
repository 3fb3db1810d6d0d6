defmodule Bourse.ContractTests.Concurrency do
  @moduledoc false
  # P1 and P4 under many concurrent callers.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "concurrency" do
        @describetag timeout: 60_000

        # The bucket holds half a second of refill: a loaded machine that runs none of the
        # callers for a while loses no token unless that lasts longer. "Most of it" counts
        # the refill from the first caller's start to the deadline; each caller goes on
        # until a check it asked after the deadline is refused, so answers slow to come
        # (a loaded backend) leave no token of that time unasked for.
        @tag skip: Bourse.ContractTests.skip(@contract_skip, :concurrency)
        test "48 processes on one key: admitted within C + r * elapsed, and most of it (P1)",
             %{name: name} do
          limit = %{capacity: 100, refill_per_sec: 200}
          key = {"ex", "k"}
          started = System.monotonic_time(:microsecond)
          deadline = now_ms() + 1_000

          callers =
            for(
              _ <- 1..48,
              do:
                Task.async(fn ->
                  first = System.monotonic_time(:microsecond)
                  {first, hammer_until_refused(key, limit, name, deadline)}
                end)
            )
            |> Task.await_many(30_000)

          elapsed = (System.monotonic_time(:microsecond) - started) / 1.0e6
          admitted = callers |> Enum.map(&elem(&1, 1)) |> Enum.sum()
          first = callers |> Enum.map(&elem(&1, 0)) |> Enum.min()
          asked = max(deadline * 1000 - first, 0) / 1.0e6
          assert admitted <= 100 + 200 * elapsed, "#{admitted} admitted in #{elapsed} s"

          assert admitted >= 100 + 0.8 * 200 * asked,
                 "only #{admitted} admitted in #{asked} s of asking"
        end

        @tag skip: Bourse.ContractTests.skip(@contract_skip, :concurrency)
        test "concurrent multi-bucket checks pay on all their buckets or none (P4)",
             %{name: name} do
          shared = {"ex", "shared"}
          shared_limit = %{@still | capacity: 30}

          counts =
            for i <- 1..16 do
              Task.async(fn ->
                own = {"ex", "own-#{i}"}

                admitted =
                  Enum.count(1..50, fn _ ->
                    check_rates([{shared, shared_limit, 1}, {own, @still, 0.25}], name) == :ok
                  end)

                {own, admitted}
              end)
            end
            |> Task.await_many(30_000)

          total = counts |> Enum.map(&elem(&1, 1)) |> Enum.sum()
          assert total == 30
          assert_about(get_cost(shared, 1, name), 30, 0.01)

          for {own, admitted} <- counts do
            assert_about(get_cost(own, 1, name), admitted * 0.25, 0.01)
          end
        end
      end
    end
  end
end
