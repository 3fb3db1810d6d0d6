defmodule Bourse.ContractCase do
  @moduledoc """
  Case template for tests of the `Bourse.RateLimiter` contract (docs/CONTRACT.md) through its
  public API, for any backend.

      use Bourse.ContractCase, async: true, backend: :nif

  `setup` starts a limiter under the test supervisor with a unique name per test
  (bucket tables outlive their limiter in `:persistent_term`, keyed by name) and puts in
  the context:

    * `:name` – the name to call the limiter by;
    * `:start_name` – the name it was started under (differs from `:name` only for the
      `{name, node}` form);
    * `:registry` – the `Registry` of a `{:via, Registry, _}` name, or `nil`.

  Tags read by `setup`:

    * `:backend` – the `:backend` start option (set by `use ... backend: b`, default `:nif`);
    * `:backend_opts` – more start options for every test of the module (`extra_opts:`);
    * `:limiter_opts` – more start options for one test (`@tag limiter_opts: [...]`);
    * `:name_form` – `:local` (default), `:global`, `:via` or `:node` (`{atom, node()}`).
  """

  use ExUnit.CaseTemplate

  import ExUnit.Assertions

  alias Bourse.RateLimiter

  using opts do
    backend = Keyword.get(opts, :backend, :nif)
    extra_opts = Keyword.get(opts, :extra_opts, [])

    quote do
      import Bourse.ContractCase

      alias Bourse.RateLimiter

      @moduletag backend: unquote(backend)
      @moduletag backend_opts: unquote(extra_opts)
    end
  end

  setup context do
    backend = Map.get(context, :backend, :nif)
    form = Map.get(context, :name_form, :local)
    id = System.unique_integer([:positive])

    registry =
      if form == :via do
        registry = :"contract_registry_#{id}"
        start_supervised!({Registry, keys: :unique, name: registry})
        registry
      end

    {start_name, call_name} = limiter_names(form, id, registry)

    opts =
      [name: start_name, backend: backend] ++
        Map.get(context, :backend_opts, []) ++ Map.get(context, :limiter_opts, [])

    start_supervised!({RateLimiter, opts})
    %{name: call_name, start_name: start_name, registry: registry, limiter_opts: opts}
  end

  @doc "The name a limiter is started under and the name it is called by, per name form."
  def limiter_names(:local, id, _registry), do: same(:"limiter_#{id}")
  def limiter_names(:global, id, _registry), do: same({:global, {:bourse_limiter, id}})
  def limiter_names(:via, id, registry), do: same({:via, Registry, {registry, {:limiter, id}}})
  def limiter_names(:node, id, _registry), do: {:"limiter_#{id}", {:"limiter_#{id}", node()}}

  defp same(name), do: {name, name}

  @doc "The pid of the limiter started under `start_name`, or `nil`."
  def limiter_pid(start_name), do: GenServer.whereis(start_name)

  @doc "Polls `fun` every few ms until it returns a truthy value (returned) or `timeout_ms` passes."
  def eventually(fun, timeout_ms \\ 5_000) do
    deadline = now_ms() + timeout_ms
    poll(fun, deadline)
  end

  defp poll(fun, deadline) do
    case fun.() do
      falsy when falsy in [nil, false] ->
        if now_ms() > deadline, do: flunk("condition not met in time"), else: Process.sleep(5)
        poll(fun, deadline)

      value ->
        value
    end
  end

  @doc """
  A task in `wait_for_capacity(key, limit, 1, name, max_wait_ms: max_wait_ms)`, returned
  once the key holds `bookings` bookings (its own the last).
  """
  def booked_waiter(key, limit, name, max_wait_ms, bookings \\ 1) do
    waiter =
      Task.async(fn ->
        Bourse.RateLimiter.wait_for_capacity(key, limit, 1, name, max_wait_ms: max_wait_ms)
      end)

    eventually(fn -> Bourse.RateLimiter.inspect_key(key, name).bookings == bookings end)
    waiter
  end

  @doc """
  Checks `key` at cost 1 in a loop, as a busy caller does, until `done?.()`; returns how
  many checks were admitted.
  """
  def hammer(key, limit, name, done?, admitted \\ 0) do
    if done?.() do
      admitted
    else
      case RateLimiter.check_rate(key, limit, 1, name) do
        :ok -> hammer(key, limit, name, done?, admitted + 1)
        {:delay, _} -> hammer(key, limit, name, done?, admitted)
      end
    end
  end

  @doc """
  Checks `key` at cost 1 in a loop, as a busy caller does, until a check asked at or after
  `deadline_ms` (monotonic) is refused: by then every token accrued before the deadline has
  been offered to a check, however long the answers took. Returns how many were admitted.
  """
  def hammer_until_refused(key, limit, name, deadline_ms, admitted \\ 0) do
    asked_at = now_ms()

    case RateLimiter.check_rate(key, limit, 1, name) do
      :ok -> hammer_until_refused(key, limit, name, deadline_ms, admitted + 1)
      {:delay, _} when asked_at >= deadline_ms -> admitted
      {:delay, _} -> hammer_until_refused(key, limit, name, deadline_ms, admitted)
    end
  end

  @doc "Monotonic milliseconds."
  def now_ms, do: System.monotonic_time(:millisecond)

  @doc "Runs `fun`, returns `{elapsed_ms, result}` (monotonic)."
  def timed(fun) do
    start = System.monotonic_time(:microsecond)
    result = fun.()
    {(System.monotonic_time(:microsecond) - start) / 1000, result}
  end

  @doc "Asserts `answer` is `{:delay, ms}` with an integer `ms` in `range`; returns `ms`."
  def assert_delay(answer, %Range{} = range) do
    case answer do
      {:delay, ms} when is_integer(ms) and ms >= 1 ->
        assert ms in range, "expected a delay in #{inspect(range)}, got #{inspect(answer)}"
        ms

      other ->
        flunk("expected {:delay, ms} with ms in #{inspect(range)}, got #{inspect(other)}")
    end
  end

  @doc """
  Runs `call` (a check of cost 1 on `key`) and asserts it either was delayed, or was
  admitted and charged: `get_cost` rose by about 1 (not a claim of someone's booking).
  """
  def assert_delay_or_charged(name, key, call) do
    before = RateLimiter.get_cost(key, 1, name)

    case call.() do
      {:delay, ms} when is_integer(ms) and ms >= 1 ->
        :ok

      :ok ->
        charged = RateLimiter.get_cost(key, 1, name) - before
        assert charged > 0.5, "admitted but charged only #{charged}"

      other ->
        flunk("expected :ok or {:delay, ms}, got #{inspect(other)}")
    end
  end

  @doc "Asserts `answer` is `{:error, %Bourse.Error{type: :invalid_parameters}}` with a message."
  def assert_invalid(answer) do
    assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} = answer
    assert is_binary(message) and message != "", "no message in #{inspect(answer)}"
    message
  end

  @doc "Asserts `value` is a number within `tolerance` of `expected`."
  def assert_about(value, expected, tolerance) do
    assert is_number(value), "expected a number, got #{inspect(value)}"

    assert abs(value - expected) <= tolerance,
           "expected #{expected} ± #{tolerance}, got #{inspect(value)}"

    value
  end

  @doc """
  Given a waiter's last answer for `checks`, sleeps each delay it is told and asks again
  (claiming its booking) until admitted; returns that last answer.
  """
  def claim_when_told({:delay, ms}, checks, name) do
    Process.sleep(ms)
    claim_when_told(RateLimiter.check_rates(checks, name, max_wait_ms: 5_000), checks, name)
  end

  def claim_when_told(answer, _checks, _name), do: answer

  @doc "Pays `count` checks of `cost` on `key`, asserting each is admitted."
  def drain(key, limit, count, name, cost \\ 1) do
    for _ <- 1..count//1, do: assert(:ok == RateLimiter.check_rate(key, limit, cost, name))
    :ok
  end

  # Messages describe a bad value by its type and size: they stay short whatever it was.
  @max_message_bytes 512

  @doc """
  Runs each `{label, fun}` and returns those whose answer is not a well-formed
  `:invalid_parameters` error (with a message of at most #{@max_message_bytes} bytes),
  with what they answered, raised or exited.
  """
  def failing_malformed(cases) do
    for {label, fun} <- cases, reduce: [] do
      failures ->
        result =
          try do
            fun.()
          rescue
            exception -> {:raised, exception}
          catch
            kind, reason -> {kind, reason}
          end

        case result do
          {:error, %Bourse.Error{type: :invalid_parameters, message: message}}
          when is_binary(message) and message != "" and
                 byte_size(message) <= @max_message_bytes ->
            failures

          other ->
            [{label, truncate(other)} | failures]
        end
    end
    |> Enum.reverse()
  end

  defp truncate(term),
    do: term |> inspect(limit: 20, printable_limit: 200) |> String.slice(0, 600)

  @doc """
  A table of malformed calls, `{label, fun}`, on the limiter `name`. `probe` is a valid key
  defined by `limit`: calls that mix it with malformed parts must not pay on it.
  """
  def malformed_calls(name, probe, limit) do
    huge = :binary.copy("x", 2_000)
    deep_tuple = Enum.reduce(1..50_000, "binance", fn _, acc -> {acc} end)
    deep_list = Enum.reduce(1..50_000, [], fn _, acc -> [acc] end)
    deep_map = Enum.reduce(1..10_000, %{}, fn _, acc -> %{capacity: acc} end)
    good = {probe, limit, 1}
    check = fn key -> RateLimiter.check_rate(key, limit, 1, name) end
    limit_is = fn bad -> RateLimiter.check_rate(probe, bad, 1, name) end
    cost_is = fn bad -> RateLimiter.check_rate(probe, limit, bad, name) end
    checks_are = fn bad -> RateLimiter.check_rates(bad, name) end
    opts_are = fn bad -> RateLimiter.check_rates([good], name, bad) end
    wait_opts_are = fn bad -> RateLimiter.wait_for_capacity(probe, limit, 1, name, bad) end
    other_limit = %{capacity: 10, refill_per_sec: 2}
    used = [{"x-mbx-used-weight-1m", "10"}]

    observe = fn status, headers, name, opts ->
      RateLimiter.observe_response("binance", "k", status, headers, name, opts)
    end

    [
      # keys
      {"key: a binary", fn -> check.("binance") end},
      {"key: a list", fn -> check.(["binance", "k", "request"]) end},
      {"key: a map", fn -> check.(%{exchange: "binance", credential: "k"}) end},
      {"key: a pid", fn -> check.(self()) end},
      {"key: empty tuple", fn -> check.({}) end},
      {"key: 1-tuple", fn -> check.({"binance"}) end},
      {"key: 4-tuple", fn -> check.({"binance", "k", "request", "extra"}) end},
      {"key: atom exchange", fn -> check.({:binance, "k", "request"}) end},
      {"key: integer credential", fn -> check.({"binance", 123, "request"}) end},
      {"key: atom credential other than :public", fn -> check.({"binance", :private}) end},
      {"key: nil credential", fn -> check.({"binance", nil, "request"}) end},
      {"key: atom axis", fn -> check.({"binance", "k", :request}) end},
      {"key: charlist axis", fn -> check.({"binance", "k", ~c"request"}) end},
      {"key: huge exchange id", fn -> check.({huge, "k", "request"}) end},
      {"key: huge credential", fn -> check.({"binance", huge}) end},
      {"key: huge axis (get_cost)", fn -> RateLimiter.get_cost({"b", "k", huge}, 1, name) end},
      {"key: deep tuple", fn -> check.(deep_tuple) end},
      {"key: deep list credential (record_request)",
       fn -> RateLimiter.record_request({"binance", deep_list}, 1, name) end},
      {"key: bad key with nil limit", fn -> RateLimiter.check_rate({"b"}, nil, 1, name) end},
      {"key: bad key (reset)", fn -> RateLimiter.reset({"binance", 1}, name) end},
      {"key: bad key (wait_for_capacity)",
       fn -> RateLimiter.wait_for_capacity({1, 2, 3}, limit, 1, name) end},
      # limits
      {"limit: negative capacity", fn -> limit_is.(%{capacity: -1, refill_per_sec: 1}) end},
      {"limit: zero capacity", fn -> limit_is.(%{capacity: 0, refill_per_sec: 1}) end},
      {"limit: zero refill", fn -> limit_is.(%{capacity: 10, refill_per_sec: 0}) end},
      {"limit: negative refill", fn -> limit_is.(%{capacity: 10, refill_per_sec: -0.5}) end},
      {"limit: capacity 1.0e308", fn -> limit_is.(%{capacity: 1.0e308, refill_per_sec: 1}) end},
      {"limit: refill 1.0e308", fn -> limit_is.(%{capacity: 1, refill_per_sec: 1.0e308}) end},
      {"limit: bignum capacity", fn -> limit_is.(%{capacity: 10 ** 30, refill_per_sec: 1}) end},
      {"limit: bignum refill", fn -> limit_is.(%{capacity: 1, refill_per_sec: -(10 ** 30)}) end},
      {"limit: string capacity", fn -> limit_is.(%{capacity: "10", refill_per_sec: 1}) end},
      {"limit: missing refill", fn -> limit_is.(%{capacity: 10}) end},
      {"limit: extra key", fn -> limit_is.(%{capacity: 10, refill_per_sec: 1, burst: 5}) end},
      {"limit: mixed forms", fn -> limit_is.(%{capacity: 10, requests: 10}) end},
      {"limit: zero period", fn -> limit_is.(%{requests: 10, period: 0}) end},
      {"limit: negative period", fn -> limit_is.(%{requests: 10, period: -1000}) end},
      {"limit: bignum period", fn -> limit_is.(%{requests: 10, period: 10 ** 40}) end},
      {"limit: zero requests", fn -> limit_is.(%{requests: 0}) end},
      {"limit: string requests", fn -> limit_is.(%{requests: "10"}) end},
      {"limit: period without requests", fn -> limit_is.(%{period: 1000}) end},
      {"limit: string keys", fn -> limit_is.(%{"capacity" => 10, "refill_per_sec" => 1}) end},
      {"limit: keyword list", fn -> limit_is.(capacity: 10, refill_per_sec: 1) end},
      {"limit: atom", fn -> limit_is.(:unlimited) end},
      {"limit: a struct", fn -> limit_is.(%URI{}) end},
      {"limit: deep map", fn -> limit_is.(deep_map) end},
      {"limit: huge binary value", fn -> limit_is.(%{capacity: huge, refill_per_sec: 1}) end},
      {"limit: bad (wait_for_capacity)",
       fn -> RateLimiter.wait_for_capacity(probe, %{capacity: 0}, 1, name) end},
      # costs
      {"cost: negative", fn -> cost_is.(-1) end},
      {"cost: string", fn -> cost_is.("1") end},
      {"cost: nil", fn -> cost_is.(nil) end},
      {"cost: bignum", fn -> cost_is.(10 ** 30) end},
      {"cost: :infinity", fn -> cost_is.(:infinity) end},
      {"cost: 1.0e308", fn -> cost_is.(1.0e308) end},
      {"cost: negative with nil limit", fn -> RateLimiter.check_rate(probe, nil, -1, name) end},
      {"cost: negative (record_request)",
       fn -> RateLimiter.record_request(probe, -0.5, name) end},
      {"cost: list (record_request)", fn -> RateLimiter.record_request(probe, [1], name) end},
      {"cost: :nan (wait_for_capacity)",
       fn -> RateLimiter.wait_for_capacity(probe, limit, :nan, name) end},
      # check lists
      {"checks: a tuple", fn -> checks_are.(good) end},
      {"checks: a map", fn -> checks_are.(%{probe => limit}) end},
      {"checks: improper list, atom tail", fn -> checks_are.([good | :tail]) end},
      {"checks: improper list, check tail", fn -> checks_are.([good | good]) end},
      {"checks: non-tuple element", fn -> checks_are.([good, :check]) end},
      {"checks: 2-tuple element", fn -> checks_are.([good, {probe, limit}]) end},
      {"checks: 4-tuple element", fn -> checks_are.([good, {probe, limit, 1, 1}]) end},
      {"checks: bad key after a good check", fn -> checks_are.([good, {{"b"}, limit, 1}]) end},
      {"checks: bad limit after a good check", fn -> checks_are.([good, {probe, %{}, 1}]) end},
      {"checks: bad cost with nil limit", fn -> checks_are.([good, {probe, nil, -1}]) end},
      {"checks: conflicting definitions", fn -> checks_are.([good, {probe, other_limit, 1}]) end},
      {"checks: deep list", fn -> checks_are.(deep_list) end},
      # options
      {"check_rates opts: not a keyword list", fn -> opts_are.([:max_wait_ms]) end},
      {"check_rates opts: a map", fn -> opts_are.(%{max_wait_ms: 100}) end},
      {"check_rates opts: unknown key", fn -> opts_are.(bogus: 1) end},
      {"check_rates opts: max_wait_ms 0", fn -> opts_are.(max_wait_ms: 0) end},
      {"check_rates opts: max_wait_ms -1", fn -> opts_are.(max_wait_ms: -1) end},
      {"check_rates opts: max_wait_ms 1.5", fn -> opts_are.(max_wait_ms: 1.5) end},
      {"check_rates opts: max_wait_ms :infinity", fn -> opts_are.(max_wait_ms: :infinity) end},
      {"wait opts: not a keyword list", fn -> wait_opts_are.([1, 2]) end},
      {"wait opts: unknown key", fn -> wait_opts_are.(timeout: 5_000) end},
      {"wait opts: max_wait_ms 0", fn -> wait_opts_are.(max_wait_ms: 0) end},
      {"wait opts: max_wait_ms -1", fn -> wait_opts_are.(max_wait_ms: -1) end},
      {"wait opts: max_wait_ms 1.5", fn -> wait_opts_are.(max_wait_ms: 1.5) end},
      {"wait opts: max_wait_ms :x", fn -> wait_opts_are.(max_wait_ms: :x) end},
      {"wait opts: max_wait_ms nil", fn -> wait_opts_are.(max_wait_ms: nil) end},
      # names
      {"name: a string (check_rate)", fn -> RateLimiter.check_rate(probe, limit, 1, "lim") end},
      {"name: an integer (check_rate)", fn -> RateLimiter.check_rate(probe, limit, 1, 123) end},
      {"name: nil (check_rate)", fn -> RateLimiter.check_rate(probe, limit, 1, nil) end},
      {"name: a string (check_rates)", fn -> RateLimiter.check_rates([good], "lim", []) end},
      {"name: an integer (check_rates/2)", fn -> RateLimiter.check_rates([good], 123) end},
      {"name: a string (wait_for_capacity)",
       fn -> RateLimiter.wait_for_capacity(probe, limit, 1, "lim", []) end},
      {"name: an integer (get_cost)", fn -> RateLimiter.get_cost(probe, 1, 123) end},
      {"name: a string (record_request)", fn -> RateLimiter.record_request(probe, 1, "l") end},
      {"name: a float (reset)", fn -> RateLimiter.reset(probe, 1.5) end},
      {"name: a 3-tuple (reset_exchange)", fn -> RateLimiter.reset_exchange("b", {1, 2, 3}) end},
      {"name: a string (reset_all)", fn -> RateLimiter.reset_all("lim") end},
      {"name: an integer (pause)", fn -> RateLimiter.pause(probe, 10, 123) end},
      # other arguments
      {"reset_exchange: atom", fn -> RateLimiter.reset_exchange(:binance, name) end},
      {"reset_exchange: huge id", fn -> RateLimiter.reset_exchange(huge, name) end},
      {"pause: atom target", fn -> RateLimiter.pause(:binance, 10, name) end},
      {"pause: 4-tuple target", fn -> RateLimiter.pause({"b", "k", "r", "x"}, 10, name) end},
      {"pause: bad credential", fn -> RateLimiter.pause({"b", :private}, 10, name) end},
      {"pause: huge exchange id", fn -> RateLimiter.pause(huge, 10, name) end},
      {"pause: negative duration", fn -> RateLimiter.pause(probe, -1, name) end},
      {"pause: float duration", fn -> RateLimiter.pause(probe, 1.5, name) end},
      {"pause: atom duration", fn -> RateLimiter.pause(probe, :x, name) end},
      {"pause: string duration", fn -> RateLimiter.pause(probe, "10", name) end},
      # exchange feedback
      {"observe_response: {:via, NotAModule, _} name",
       fn -> observe.(200, [], {:via, NotAModule, :x}, []) end},
      {"observe_response: huge credential, status 200",
       fn -> RateLimiter.observe_response("binance", :binary.copy("k", 65_536), 200, [], name) end},
      {"observe_response: deep map exchange id",
       fn -> RateLimiter.observe_response(deep_map, "k", 200, [], name) end},
      {"observe_response: deep list options", fn -> observe.(200, [], name, deep_list) end},
      {"observe_response: deep list options, default name",
       fn -> RateLimiter.observe_response("binance", "k", 200, [], deep_list) end},
      {"observe_response: deep tuple header", fn -> observe.(200, [deep_tuple], name, []) end},
      {"observe_response: status 200.0", fn -> observe.(200.0, [], name, []) end},
      {"observe_response: deep map status", fn -> observe.(deep_map, [], name, []) end},
      {"observe_response: deep map headers",
       fn -> observe.(200, %{"retry-after" => deep_map}, name, []) end},
      {"observe_response: bignum capacity in limits:",
       fn ->
         observe.(200, used, name, limits: %{"ip" => %{capacity: 10 ** 400, refill_per_sec: 1}})
       end},
      {"observe_response: huge axis in limits:",
       fn -> observe.(200, used, name, limits: %{huge => %{capacity: 10, refill_per_sec: 1}}) end},
      {"observe_response: a struct as limits:",
       fn -> observe.(200, used, name, limits: %URI{}) end},
      {"observe_response: deep tuple body", fn -> observe.(200, [], name, body: deep_tuple) end}
    ]
  end
end
