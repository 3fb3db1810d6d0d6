defmodule Bourse.ContractTests do
  @moduledoc """
  The `Bourse.RateLimiter` contract (docs/CONTRACT.md §1–6, P1–P6) as ExUnit tests through the
  public API, for one backend per test module:

      defmodule Bourse.RateLimiter.ContractNIFTest do
        use Bourse.ContractTests, backend: :nif
      end

  Options:

    * `:backend` – the `:backend` start option of every limiter (required);
    * `:extra_opts` – more start options for every limiter of the module (default `[]`);
    * `:async` – default `true`;
    * `:fuzz_calls` – how many random malformed calls (`Bourse.Fuzz`) the P5 tests make
      (default 20_000);
    * `:skip` – groups of tests that do not apply to the backend, each skipped with a
      reason: `:crash` (P6 by killing the limiter process), `:concurrency`, `:names`,
      `:own_table` (every
      limiter has buckets of its own: limiters on one daemon share them),
      `:several_exchanges` (one check over buckets of several exchanges: a Redis Cluster
      refuses it).

  The tests live in one module per topic under `test/support/contract_tests/`
  (`Bourse.ContractTests.Bookings`, ...), each `use`d here; they share the imports and
  attributes set below (`@still`, `@one_token_ms`, `@contract_skip`).

  Every test gets a fresh limiter with a unique name (see `Bourse.ContractCase`).
  Calls with the default name live in `Bourse.DefaultNameContractTests`.

  Timing: answers are asserted as `{:delay, ms}` ranges; a delay is exact only on a key
  seen for the first time in that very call (a fresh bucket holds exactly its capacity).
  Sleeps are never bounded above by less than several hundred ms.
  """

  @doc false
  def skip(skipped, group) do
    group in skipped && "#{inspect(group)} does not apply to this backend"
  end

  defmacro __using__(opts) do
    backend = Keyword.fetch!(opts, :backend)
    extra_opts = Keyword.get(opts, :extra_opts, [])
    async = Keyword.get(opts, :async, true)
    skipped = Keyword.get(opts, :skip, [])
    fuzz_calls = Keyword.get(opts, :fuzz_calls, 20_000)

    quote location: :keep do
      use Bourse.ContractCase,
        async: unquote(async),
        backend: unquote(backend),
        extra_opts: unquote(extra_opts)

      import Bourse.RateLimiter,
        only: [
          check_rate: 1,
          check_rate: 2,
          check_rate: 4,
          check_rates: 2,
          check_rates: 3,
          wait_for_capacity: 4,
          wait_for_capacity: 5,
          get_cost: 3,
          record_request: 3,
          reset: 2,
          reset_exchange: 2,
          reset_all: 1,
          pause: 3,
          observe_response: 5,
          stats: 1,
          busiest: 2
        ]

      @contract_skip unquote(skipped)
      @fuzz_calls unquote(fuzz_calls)

      # Refills so slow that nothing accrues during a test: one token per 1000 s.
      @still %{capacity: 10, refill_per_sec: 0.001}
      @one_token_ms 1_000_000

      use Bourse.ContractTests.KeysAndLimits
      use Bourse.ContractTests.Bucket
      use Bourse.ContractTests.CheckRates
      use Bourse.ContractTests.PreparedBuckets
      use Bourse.ContractTests.Bookings
      use Bourse.ContractTests.WaitForCapacity
      use Bourse.ContractTests.Bookkeeping
      use Bourse.ContractTests.Pause
      use Bourse.ContractTests.Backoff
      use Bourse.ContractTests.Concurrency
      use Bourse.ContractTests.Malformed
      use Bourse.ContractTests.Names
      use Bourse.ContractTests.Supervision
      use Bourse.ContractTests.LimiterProcess
      use Bourse.ContractTests.BudgetsAndErrors
    end
  end
end
