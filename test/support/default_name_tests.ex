defmodule Bourse.DefaultNameContractTests do
  @moduledoc """
  The arities of `Bourse.RateLimiter` that use the default name (`Bourse.RateLimiter`),
  and the application environment, for one backend per test module:

      defmodule Bourse.RateLimiter.DefaultNameNIFTest do
        use Bourse.DefaultNameContractTests, backend: :nif
      end

  Not async: there is one default name per VM, and the application env is global. The
  default limiter's bucket table outlives each test's limiter (it is kept per name), so
  `setup` clears it with `reset_all/0`.
  """

  defmacro __using__(opts) do
    backend = Keyword.fetch!(opts, :backend)
    extra_opts = Keyword.get(opts, :extra_opts, [])

    quote location: :keep do
      use ExUnit.Case, async: false

      import Bourse.ContractCase

      alias Bourse.RateLimiter

      @backend unquote(backend)
      @extra_opts unquote(extra_opts)
      @still %{capacity: 10, refill_per_sec: 0.001}

      setup do
        pid = start_supervised!({RateLimiter, [backend: @backend] ++ @extra_opts})
        assert Process.whereis(RateLimiter) == pid
        assert :ok = RateLimiter.reset_all()
        :ok
      end

      test "child_spec([]) is the default limiter" do
        assert %{id: RateLimiter} = RateLimiter.child_spec([])
        assert %{id: RateLimiter} = RateLimiter.child_spec(backend: @backend)
      end

      test "check_rate/2 and check_rate/3" do
        assert :ok = RateLimiter.check_rate({"ex", "k"}, @still)
        assert :ok = RateLimiter.check_rate({"ex", "k"}, @still, 2)
        assert_about(RateLimiter.get_cost({"ex", "k"}, 1), 3, 0.01)
        assert :ok = RateLimiter.check_rate({"ex", "k"}, nil)
        assert_invalid(RateLimiter.check_rate({"ex"}, @still))
        assert_invalid(RateLimiter.check_rate({"ex", "k"}, @still, -1))

        # A limiter's name where the cost goes.
        assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
                 RateLimiter.check_rate({"ex", "k"}, @still, MyApp.Limiter)

        assert message =~ "cost must be a finite number"
        assert message =~ "name a limiter as the fourth"
      end

      test "check_rates/1, check_rates/2 with a name or options, check_rates/3" do
        assert :ok = RateLimiter.check_rates([{{"ex", "k"}, @still, 1}])
        assert :ok = RateLimiter.check_rates([{{"ex", "k"}, @still, 1}], [])
        assert :ok = RateLimiter.check_rates([{{"ex", "k"}, @still, 1}], max_wait_ms: 1_000)
        assert :ok = RateLimiter.check_rates([{{"ex", "k"}, @still, 1}], RateLimiter)
        assert :ok = RateLimiter.check_rates([{{"ex", "k"}, @still, 1}], RateLimiter, [])
        assert_about(RateLimiter.get_cost({"ex", "k"}, 1), 5, 0.01)
        assert :ok = RateLimiter.check_rates([])

        # With options in second position the call is a waiter: it books. (A fresh key
        # and an over-capacity cost: exactly 100 ms.)
        fast = %{capacity: 1, refill_per_sec: 10}
        assert {:delay, 100} = RateLimiter.check_rates([{{"ex", "b"}, fast, 2}])
        assert RateLimiter.get_cost({"ex", "b"}, 1) == 0
        booked_at = System.monotonic_time(:millisecond)
        assert {:delay, 100} = RateLimiter.check_rates([{{"ex", "c"}, fast, 2}], max_wait_ms: 500)
        # 2 borrowed, less what refilled since (10 a second: a loaded machine may be slow).
        refilled = 10 * (System.monotonic_time(:millisecond) - booked_at) / 1000
        assert RateLimiter.get_cost({"ex", "c"}, 1) >= 2 - refilled - 0.01
        Process.sleep(100)
        assert :ok = RateLimiter.check_rates([{{"ex", "c"}, fast, 2}], max_wait_ms: 500)

        assert_invalid(RateLimiter.check_rates([{{"ex", "k"}, @still, 1}], bogus: 1))
        assert_invalid(RateLimiter.check_rates([{{"ex", "k"}, @still, 1}], max_wait_ms: 0))
        assert_invalid(RateLimiter.check_rates(:not_a_list))
      end

      test "wait_for_capacity/2, /3, /4 with a name or options, /5" do
        assert :ok = RateLimiter.wait_for_capacity({"ex", "k"}, @still)
        assert :ok = RateLimiter.wait_for_capacity({"ex", "k"}, @still, 2)
        assert :ok = RateLimiter.wait_for_capacity({"ex", "k"}, @still, 1, RateLimiter)
        assert :ok = RateLimiter.wait_for_capacity({"ex", "k"}, @still, 1, max_wait_ms: 10)
        assert :ok = RateLimiter.wait_for_capacity({"ex", "k"}, @still, 1, RateLimiter, [])
        assert_about(RateLimiter.get_cost({"ex", "k"}, 1), 6, 0.01)

        # Fresh key, over-capacity cost: exactly 1000 ms.
        one = %{capacity: 1, refill_per_sec: 1}

        assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: 1_000}} =
                 RateLimiter.wait_for_capacity({"ex", "b"}, one, 2, max_wait_ms: 100)

        assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: 1_000}} =
                 RateLimiter.wait_for_capacity({"ex", "b"}, one, 2, RateLimiter, max_wait_ms: 100)

        assert_invalid(RateLimiter.wait_for_capacity({"ex", "b"}, one, 1, max_wait_ms: 0))
        assert_invalid(RateLimiter.wait_for_capacity({"ex", "b"}, one, 1, bogus: 1))
      end

      test "get_cost/2, record_request/1 and /2" do
        assert RateLimiter.get_cost({"ex", "k"}, 1_000) == 0
        assert :ok = RateLimiter.record_request({"ex", "k"})
        assert_about(RateLimiter.get_cost({"ex", "k"}, 1_000), 1, 1.0e-9)
        assert :ok = RateLimiter.record_request({"ex", "k"}, 2.5)
        assert_about(RateLimiter.get_cost({"ex", "k"}, 1_000), 3.5, 1.0e-9)
        assert_invalid(RateLimiter.record_request({"ex", "k"}, -1))
        assert_invalid(RateLimiter.get_cost(:key, 1))
      end

      test "reset/1, reset_exchange/1, reset_all/0, pause/2" do
        one = %{@still | capacity: 1}
        keys = [{"a", "k"}, {"a", "j"}, {"b", "k"}, {"c", "k"}]
        for key <- keys, do: drain(key, one, 1, RateLimiter)

        assert :ok = RateLimiter.reset({"a", "k"})
        assert RateLimiter.get_cost({"a", "k"}, 1) == 0
        assert_about(RateLimiter.get_cost({"a", "j"}, 1), 1, 0.01)

        assert :ok = RateLimiter.reset_exchange("a")
        assert RateLimiter.get_cost({"a", "j"}, 1) == 0
        assert_about(RateLimiter.get_cost({"b", "k"}, 1), 1, 0.01)

        assert :ok = RateLimiter.reset_all()
        assert RateLimiter.get_cost({"b", "k"}, 1) == 0
        assert RateLimiter.get_cost({"c", "k"}, 1) == 0

        assert :ok = RateLimiter.pause("d", 10_000)
        assert_delay(RateLimiter.check_rate({"d", "k"}, one), 9_000..10_000)

        assert_invalid(RateLimiter.reset({"a"}))
        assert_invalid(RateLimiter.reset_exchange(:a))
        assert_invalid(RateLimiter.pause(:d, 10))
      end

      describe "the application env" do
        setup do
          previous = Application.fetch_env(:bourse, :rate_limit_max_wait_ms)

          on_exit(fn ->
            case previous do
              {:ok, value} -> Application.put_env(:bourse, :rate_limit_max_wait_ms, value)
              :error -> Application.delete_env(:bourse, :rate_limit_max_wait_ms)
            end
          end)
        end

        test "rate_limit_max_wait_ms is wait_for_capacity's default budget" do
          # On a fresh key of capacity 1 at 10/s, cost 2 waits exactly 100 ms.
          fast = %{capacity: 1, refill_per_sec: 10}

          Application.put_env(:bourse, :rate_limit_max_wait_ms, 50)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: 100}} =
                   RateLimiter.wait_for_capacity({"ex", "a"}, fast, 2)

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: 100}} =
                   RateLimiter.wait_for_capacity({"ex", "b"}, fast, 2, RateLimiter)

          # An explicit :max_wait_ms wins over the env.
          assert :ok = RateLimiter.wait_for_capacity({"ex", "c"}, fast, 2, max_wait_ms: 1_000)

          Application.put_env(:bourse, :rate_limit_max_wait_ms, 5_000)
          {ms, answer} = timed(fn -> RateLimiter.wait_for_capacity({"ex", "d"}, fast, 2) end)
          assert answer == :ok
          assert ms >= 99, "waited #{ms} ms"

          # Without the env the documented default (Bourse.Defaults) applies.
          Application.delete_env(:bourse, :rate_limit_max_wait_ms)
          default = Bourse.Defaults.rate_limit_max_wait_ms()
          assert is_integer(default) and default > 0
          # On a fresh key of capacity 1 at 1/s, cost c waits exactly (c - 1) s.
          cost = div(default, 1000) + 2

          assert {:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: retry}} =
                   RateLimiter.wait_for_capacity(
                     {"ex", "over"},
                     %{capacity: 1, refill_per_sec: 1},
                     cost
                   )

          assert retry == (cost - 1) * 1000
          assert retry > default
        end

        test "a rate_limit_max_wait_ms out of range is :invalid_parameters, paying nothing" do
          # A wait of 10^10 ms: more than Process.sleep/1 accepts.
          slow = %{capacity: 1, refill_per_sec: 1.0e-7}

          for bad <- [4_294_967_296, 10 ** 11, 0, -1, 1.5, :infinity, "30000"] do
            Application.put_env(:bourse, :rate_limit_max_wait_ms, bad)
            message = assert_invalid(RateLimiter.wait_for_capacity({"ex", "slow"}, slow, 2))
            assert message =~ "rate_limit_max_wait_ms"
            assert RateLimiter.get_cost({"ex", "slow"}, 1) == 0
          end

          # An explicit :max_wait_ms does not read the env.
          assert {:error, %Bourse.Error{type: :rate_limit_exceeded}} =
                   RateLimiter.wait_for_capacity({"ex", "slow"}, slow, 2, max_wait_ms: 10)
        end
      end
    end
  end
end
