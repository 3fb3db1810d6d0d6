defmodule Bourse.ContractTests.Concurrency do
  @moduledoc false
  # P1 and P4 under many concurrent callers.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "concurrency" do
        @describetag timeout: 60_000

        @tag skip: Bourse.ContractTests.skip(@contract_skip, :concurrency)
        test "48 processes on one key: admitted within C + r * elapsed, and most of it (P1)",
             %{name: name} do
          limit = %{capacity: 20, refill_per_sec: 200}
          key = {"ex", "k"}
          started = System.monotonic_time(:microsecond)
          deadline = now_ms() + 1_000

          admitted =
            for(
              _ <- 1..48,
              do: Task.async(fn -> hammer(key, limit, name, fn -> now_ms() >= deadline end) end)
            )
            |> Task.await_many(30_000)
            |> Enum.sum()

          elapsed = (System.monotonic_time(:microsecond) - started) / 1.0e6
          assert admitted <= 20 + 200 * elapsed, "#{admitted} admitted in #{elapsed} s"
          assert admitted >= 0.8 * 200 * elapsed, "only #{admitted} admitted in #{elapsed} s"
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
