defmodule Bourse.ContractTests.PreparedBuckets do
  @moduledoc false
  # docs/CONTRACT.md §3, "Prepared buckets": `bucket/3` validates a key and its limit once;
  # `check_rate/2` and `check_rates` take the bucket in place of them, with the same answers.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "prepared buckets" do
        test "a bucket is validated once, with the errors of a check of its key and limit",
             %{name: name} do
          bad = [
            {{"ex", :not_a_credential}, @still},
            {{:ex, "k"}, @still},
            {"not a key", @still},
            {{"ex", "k"}, %{capacity: -1, refill_per_sec: 1}},
            {{"ex", "k"}, %{requests: 10, period: 0}},
            {{"ex", "k"}, %{capacity: 1}},
            {{"ex", "k"}, :no_limit}
          ]

          for {key, limit} <- bad do
            assert {:error, %Bourse.Error{} = prepared} =
                     Bourse.RateLimiter.bucket(key, limit, name)

            assert {:error, %Bourse.Error{} = checked} = check_rate(key, limit, 1, name)
            assert prepared == checked, "#{inspect(key)}, #{inspect(limit)}"
            assert prepared.type == :invalid_parameters
          end

          assert get_cost({"ex", "k"}, 1, name) == 0
        end

        test "checking a bucket is checking its key and limit", %{name: name} do
          limit = %{@still | capacity: 3}
          {:ok, bucket} = Bourse.RateLimiter.bucket({"ex", "k", "order"}, limit, name)
          assert :ok = check_rate(bucket)
          assert :ok = check_rate(bucket, 1.5)
          assert_about(get_cost({"ex", "k", "order"}, 1, name), 2.5, 0.01)

          # The same bucket, by key and limit or prepared: both see what the other paid.
          assert :ok = check_rate({"ex", "k", "order"}, limit, 0.5, name)
          assert_delay(check_rate(bucket, 1), 990_000..@one_token_ms)
          assert_delay(check_rate({"ex", "k", "order"}, limit, 1, name), 990_000..@one_token_ms)
          assert_about(get_cost({"ex", "k", "order"}, 1, name), 3, 0.01)

          # Costs are checked on every call, with the errors of the unprepared call.
          for cost <- [-1, :one, 1.0e13, 10 ** 400, "1"] do
            assert {:error, %Bourse.Error{type: :invalid_parameters} = prepared} =
                     check_rate(bucket, cost)

            assert {:error, ^prepared} = check_rate({"ex", "k", "order"}, limit, cost, name)
            assert prepared.exchange == "ex"
          end

          # `{exchange_id, credential_key}` is axis "request", prepared too.
          {:ok, short} = Bourse.RateLimiter.bucket({"ex", "s"}, limit, name)
          assert :ok = check_rate(short, 2)
          assert_about(get_cost({"ex", "s", "request"}, 1, name), 2, 0.01)
        end

        test "a bucket with a nil limit validates its costs and records nothing",
             %{name: name} do
          {:ok, bucket} = Bourse.RateLimiter.bucket({"ex", "n"}, nil, name)
          assert :ok = check_rate(bucket, 10 ** 6)
          assert get_cost({"ex", "n"}, 1, name) == 0
          assert_invalid(check_rate(bucket, -1))
          assert :ok = check_rates([{bucket, 5}], name)
          assert_invalid(check_rates([{bucket, -1}], name))
        end

        test "check_rates takes buckets beside keys and limits: coalesced, all or nothing",
             %{name: name} do
          {:ok, a} = Bourse.RateLimiter.bucket({"ex", "a"}, @still, name)
          {:ok, b} = Bourse.RateLimiter.bucket({"ex", "b"}, %{@still | capacity: 1}, name)

          assert :ok = check_rates([{a, 2}, {{"ex", "a"}, @still, 3}, {b, 1}], name)
          assert_about(get_cost({"ex", "a"}, 1, name), 5, 0.01)
          assert_about(get_cost({"ex", "b"}, 1, name), 1, 0.01)

          # `b` cannot pay: nothing is paid on `a`.
          assert_delay(check_rates([{a, 1}, {b, 1}], name), 990_000..@one_token_ms)
          assert_delay(check_rates([{b, 1}], name), 990_000..@one_token_ms)
          assert_about(get_cost({"ex", "a"}, 1, name), 5, 0.01)

          # A bucket and a check of its key under another definition conflict.
          assert {:error, %Bourse.Error{type: :invalid_parameters, exchange: "ex"} = error} =
                   check_rates(
                     [{a, 1}, {{"ex", "a"}, %{capacity: 5, refill_per_sec: 1}, 1}],
                     name
                   )

          assert error.message =~ "conflicting bucket definitions"
          assert_invalid(check_rates([{a, 1}, {b, -1}], name))
          assert_about(get_cost({"ex", "a"}, 1, name), 5, 0.01)

          # A waiter's buckets book, and the same caller claims them.
          assert {:delay, ms} = check_rates([{a, 1}, {b, 1}], name, max_wait_ms: @one_token_ms)
          assert ms in 990_000..@one_token_ms
        end

        test "check_rate/1 takes a bucket alone: anything else is :invalid_parameters, described" do
          for {other, got} <- [
                {{"binance", "SECRET-KEY", "request"}, "a tuple of 3 elements"},
                {"SECRET-KEY", "a binary of 10 bytes"},
                {%{capacity: 1}, "a map of 1 key"},
                {nil, "nil"}
              ] do
            assert {:error, %Bourse.Error{type: :invalid_parameters, message: message} = error} =
                     check_rate(other)

            assert message == "check_rate/1 takes a bucket made by bucket/3, got #{got}"
            assert error.exchange == if(is_tuple(other), do: "binance")
          end
        end

        test "a bucket whose reference is not the one bucket/3 made is checked as its key and limit",
             %{name: name} do
          {:ok, bucket} =
            Bourse.RateLimiter.bucket({"ex", "forged"}, %{@still | capacity: 2}, name)

          forged = %{bucket | prepared: make_ref()}
          assert :ok = check_rate(forged, 2)
          assert {:delay, _} = check_rate(bucket, 1)
        end

        test "a bucket whose route was rewritten is checked as its key and limit by its name",
             %{name: name} do
          {:ok, bucket} =
            Bourse.RateLimiter.bucket({"ex", "rerouted"}, %{@still | capacity: 4}, name)

          live = spawn(fn -> Process.sleep(:infinity) end)

          for route <- [
                {Bourse.RateLimiter.Backend.NIF, make_ref(), nil, live},
                {Bourse.RateLimiter.Backend.NIF, :no_table, nil, live},
                {Bourse.RateLimiter.Backend.NIF, make_ref(), nil, :no_pid},
                :no_route
              ] do
            forged = %{bucket | route: route}
            assert :ok = check_rate(forged, 1)
            assert :ok = Bourse.RateLimiter.check_rates([{forged, 0}], name)
          end

          assert {:delay, _} = check_rate(bucket, 1)
          Process.exit(live, :kill)
        end

        test "a bucket whose route names another limiter's table is checked by its own name",
             %{name: name, backend: backend} do
          other = :"bucket_other_#{System.unique_integer([:positive])}"
          start_supervised!({Bourse.RateLimiter, name: other, backend: backend}, id: other)
          limit = %{@still | capacity: 1}
          {:ok, bucket} = Bourse.RateLimiter.bucket({"ex", "own"}, limit, name)
          {:ok, elsewhere} = Bourse.RateLimiter.bucket({"ex", "own"}, limit, other)

          # Charged to `name` (limiters sharing a daemon or Redis share the bucket anyway).
          assert :ok = check_rate(%{bucket | route: elsewhere.route}, 1)
          assert {:delay, _} = check_rate(bucket, 1)
        end

        test "a bucket of a :global name charges the limiter the name reaches now",
             %{backend: backend} do
          [one, two] =
            for _ <- 1..2 do
              global = {:global, {:bucket_global, System.unique_integer([:positive])}}
              start_supervised!({Bourse.RateLimiter, name: global, backend: backend}, id: global)
              global
            end

          on_exit(fn -> :global.unregister_name(elem(one, 1)) end)
          limit = %{@still | capacity: 1}
          key = {"ex", "global-#{System.unique_integer([:positive])}"}
          {:ok, bucket} = Bourse.RateLimiter.bucket(key, limit, one)
          :yes = :global.re_register_name(elem(one, 1), :global.whereis_name(elem(two, 1)))

          assert :ok = check_rate(bucket, 1)
          # The name's limiter now is `two`: the bucket's check was charged there.
          assert {:delay, _} = check_rate(key, limit, 1, two)
        end

        test "a bucket never shows its credential", %{name: name} do
          {:ok, bucket} = Bourse.RateLimiter.bucket({"ex", "SECRET-API-KEY", "ip"}, @still, name)

          refute inspect(bucket) =~ "SECRET"
          assert inspect(bucket) =~ Bourse.Fingerprint.of("SECRET-API-KEY")
        end

        test "a bucket of a stopped limiter answers like its name", %{backend: backend} do
          name = :"bucket_stopped_#{System.unique_integer([:positive])}"
          children = [{Bourse.RateLimiter, name: name, backend: backend}]
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          {:ok, bucket} = Bourse.RateLimiter.bucket({"ex", "k"}, %{@still | capacity: 2}, name)
          assert :ok = check_rate(bucket, 2)
          Supervisor.stop(supervisor)

          assert {:noproc, _} = catch_exit(check_rate(bucket, 1))
          assert {:noproc, _} = catch_exit(Bourse.RateLimiter.bucket({"ex", "k"}, @still, name))

          # Started again under the name: the bucket is checked there, its spent tokens kept.
          {:ok, supervisor} = Supervisor.start_link(children, strategy: :one_for_one)
          assert {:delay, _} = check_rate(bucket, 1)
          Supervisor.stop(supervisor)
        end
      end
    end
  end
end
