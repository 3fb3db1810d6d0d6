defmodule Bourse.Fuzz do
  @moduledoc """
  Random malformed calls of the public functions of `Bourse.RateLimiter` (all but
  `child_spec/1` and the default-name arities, except `observe_response/5`), from a seeded
  generator, so that a failure can be replayed with its seed.

  Each call puts one malformed term (bignums such as `10 ** 400`, floats out of range,
  `:nan` and `:infinity`, deep and improper lists, huge binaries, pids, references,
  functions, maps, tuples of every size, ...) in one argument of one function, every
  other argument being valid, so that the answer must be
  `{:error, %Bourse.Error{type: :invalid_parameters}}`.
  """

  alias Bourse.RateLimiter

  @huge_sizes [1_025, 65_536, 1_048_576]
  # A header that has `observe_response` read the bucket definitions of `limits:`.
  @used_weight [{"x-mbx-used-weight-1m", "10"}]

  @doc """
  `count` malformed calls on the limiter `name` as `{label, fun}`, from `seed` (an
  integer). `probe` is a valid key defined by `limit`, mixed into some calls: they must
  not pay on it.
  """
  @spec calls(GenServer.name(), tuple(), map(), pos_integer(), integer()) :: [
          {String.t(), (() -> term())}
        ]
  def calls(name, probe, limit, count, seed) do
    state = :rand.seed_s(:exsss, seed)
    fixtures = fixtures()

    {calls, _state} =
      Enum.map_reduce(1..count, state, fn i, state ->
        {{label, fun}, state} = call(name, probe, limit, fixtures, state)
        {{"##{i} #{label}", fun}, state}
      end)

    calls
  end

  # Terms too costly to build per call, built once.
  defp fixtures do
    %{
      big: 10 ** 400,
      huge: Enum.map(@huge_sizes, &:binary.copy("k", &1)),
      deep_list: Enum.reduce(1..10_000, [], fn _, acc -> [acc] end),
      deep_tuple: Enum.reduce(1..10_000, "ex", fn _, acc -> {acc} end),
      deep_map: Enum.reduce(1..2_000, %{}, fn _, acc -> %{capacity: acc} end),
      long_list: List.duplicate({{"ex", "k"}, %{requests: 10}, 1}, 1_025),
      pid: spawn(fn -> :ok end),
      ref: make_ref(),
      fun: fn -> :ok end
    }
  end

  defp call(name, probe, limit, fx, s) do
    good = {probe, limit, 1}

    choices = [
      {"check_rate key", :key, &RateLimiter.check_rate(&1, limit, 1, name)},
      {"check_rate limit", :limit, &RateLimiter.check_rate(probe, &1, 1, name)},
      {"check_rate cost", :cost, &RateLimiter.check_rate(probe, limit, &1, name)},
      {"check_rate cost, nil limit", :cost, &RateLimiter.check_rate(probe, nil, &1, name)},
      {"check_rate name", :name, &RateLimiter.check_rate(probe, limit, 1, &1)},
      {"check_rates checks", :checks, &RateLimiter.check_rates(&1, name)},
      {"check_rates check", :check, &RateLimiter.check_rates([good, &1], name)},
      {"check_rates check, budget", :check,
       &RateLimiter.check_rates([good, &1], name, max_wait_ms: 1_000)},
      {"check_rates options", :options, &RateLimiter.check_rates([good], name, &1)},
      {"check_rates name", :name, &RateLimiter.check_rates([good], &1, [])},
      {"wait_for_capacity key", :key, &RateLimiter.wait_for_capacity(&1, limit, 1, name, [])},
      {"wait_for_capacity limit", :limit, &RateLimiter.wait_for_capacity(probe, &1, 1, name, [])},
      {"wait_for_capacity cost", :cost,
       &RateLimiter.wait_for_capacity(probe, limit, &1, name, [])},
      {"wait_for_capacity options", :options,
       &RateLimiter.wait_for_capacity(probe, limit, 1, name, &1)},
      {"wait_for_capacity name", :name, &RateLimiter.wait_for_capacity(probe, limit, 1, &1, [])},
      {"get_cost key", :key, &RateLimiter.get_cost(&1, 1, name)},
      {"get_cost name", :name, &RateLimiter.get_cost(probe, 1, &1)},
      {"record_request key", :key, &RateLimiter.record_request(&1, 1, name)},
      {"record_request cost", :cost, &RateLimiter.record_request(probe, &1, name)},
      {"reset key", :key, &RateLimiter.reset(&1, name)},
      {"reset_exchange id", :exchange, &RateLimiter.reset_exchange(&1, name)},
      {"reset_all name", :name, &RateLimiter.reset_all(&1)},
      {"pause target", :target, &RateLimiter.pause(&1, 10, name)},
      {"pause ms", :ms, &RateLimiter.pause(probe, &1, name)},
      {"stats name", :name, &RateLimiter.stats(&1)},
      {"busiest count", :count, &RateLimiter.busiest(&1, name)},
      {"inspect_key key", :key, &RateLimiter.inspect_key(&1, name)},
      {"sync key", :key, &RateLimiter.sync(&1, 1, 1_000, name)},
      {"sync allowance", :allowance, &RateLimiter.sync(probe, &1, 1_000, name)},
      {"sync window", :ms, &RateLimiter.sync(probe, 1, &1, name)},
      {"start_link options", :start_options, &RateLimiter.start_link/1},
      {"observe_response exchange id", :exchange,
       &RateLimiter.observe_response(&1, "k", 200, [], name, [])},
      {"observe_response credential", :credential,
       &RateLimiter.observe_response("ex", &1, 200, [], name, [])},
      {"observe_response status", :status,
       &RateLimiter.observe_response("ex", "k", &1, [], name, [])},
      {"observe_response headers", :headers,
       &RateLimiter.observe_response("binance", "k", 200, &1, name, [])},
      {"observe_response options", :feedback_options,
       &RateLimiter.observe_response("binance", "k", 200, @used_weight, name, &1)},
      {"observe_response options, default name", :feedback_options,
       &RateLimiter.observe_response("binance", "k", 200, @used_weight, &1)},
      {"observe_response name", :name, &RateLimiter.observe_response("ex", "k", 200, [], &1, [])}
    ]

    {{label, kind, fun}, s} = pick(choices, s)
    {term, s} = malformed(kind, fx, s)
    {{"#{label}: #{show(term, 3)}", fn -> fun.(term) end}, s}
  end

  ## Malformed terms, by the argument they are given as

  defp malformed(:key, fx, s) do
    one_of(s, [
      &garbage(fx, &1),
      fn s -> tuple_of([&binary_part(fx, &1), &bad_credential(fx, &1)], s) end,
      fn s -> tuple_of([&bad_part(fx, &1), &binary_part(fx, &1)], s) end,
      fn s ->
        tuple_of([&binary_part(fx, &1), &binary_part(fx, &1), &bad_part(fx, &1)], s)
      end,
      fn s ->
        tuple_of([&binary_part(fx, &1), &bad_credential(fx, &1), &binary_part(fx, &1)], s)
      end,
      fn s -> {fx.deep_tuple, s} end,
      fn s -> {{"ex"}, s} end,
      fn s -> {{"ex", "k", "request", "x"}, s} end
    ])
  end

  defp malformed(:limit, fx, s) do
    one_of(s, [
      fn s -> non_nil_garbage(fx, s) end,
      fn s -> with_value(&%{capacity: &1, refill_per_sec: 1}, bad_amount(fx, s)) end,
      fn s -> with_value(&%{capacity: 10, refill_per_sec: &1}, bad_amount(fx, s)) end,
      fn s -> with_value(&%{requests: &1}, bad_amount(fx, s)) end,
      fn s -> with_value(&%{requests: 10, period: &1}, bad_period(fx, s)) end,
      fn s -> {%{capacity: 10}, s} end,
      fn s -> {%{capacity: 10, refill_per_sec: 1, burst: 1}, s} end,
      fn s -> {%{"capacity" => 10, "refill_per_sec" => 1}, s} end,
      fn s -> {fx.deep_map, s} end
    ])
  end

  defp malformed(:cost, fx, s) do
    one_of(s, [&bad_amount(fx, &1), fn s -> {-1, s} end, fn s -> {-1.0e-9, s} end])
  end

  defp malformed(:checks, fx, s) do
    one_of(s, [
      fn s -> non_list_garbage(fx, s) end,
      fn s -> {[{{"ex", "k"}, %{requests: 10}, 1} | :tail], s} end,
      fn s -> with_value(&[{{"ex", "k"}, %{requests: 10}, 1} | &1], non_list_garbage(fx, s)) end,
      fn s -> {fx.deep_list, s} end,
      fn s -> {fx.long_list, s} end
    ])
  end

  defp malformed(:check, fx, s) do
    one_of(s, [
      &garbage(fx, &1),
      fn s -> with_value(&{&1, %{requests: 10}, 1}, malformed(:key, fx, s)) end,
      fn s -> with_value(&{{"ex", "k"}, &1, 1}, malformed(:limit, fx, s)) end,
      fn s -> with_value(&{{"ex", "k"}, %{requests: 10}, &1}, malformed(:cost, fx, s)) end,
      fn s -> with_value(&{{"ex", "k"}, nil, &1}, malformed(:cost, fx, s)) end
    ])
  end

  defp malformed(:options, fx, s) do
    one_of(s, [
      fn s -> non_list_garbage(fx, s) end,
      fn s -> with_value(&[max_wait_ms: &1], bad_budget(fx, s)) end,
      fn s -> with_value(&[{&1, 100}], garbage(fx, s)) end,
      fn s -> {[bogus: 1], s} end,
      fn s -> {[:max_wait_ms], s} end
    ])
  end

  # Not a name either: a pid (a dead one is a limiter gone) or `{atom, atom}` (a node).
  defp malformed(:name, fx, s) do
    not_a_name = fn term ->
      not is_atom(term) and not is_pid(term) and
        not match?({a, b} when is_atom(a) and is_atom(b), term)
    end

    one_of(s, [
      fn s -> retry(&garbage(fx, &1), not_a_name, s) end,
      # A loaded module without `whereis_name/1`: an unloaded one would have each call
      # search the code path, thousands of times over (contract tests name one once).
      fn s -> {{:via, __MODULE__, :x}, s} end,
      fn s -> with_value(&{:via, &1, :x}, non_atom_garbage(fx, s)) end,
      fn s -> with_value(&{&1, node()}, non_atom_garbage(fx, s)) end
    ])
  end

  defp malformed(:exchange, fx, s), do: one_of(s, [&bad_part(fx, &1)])

  defp malformed(:target, fx, s) do
    one_of(s, [
      fn s -> non_binary_garbage(fx, s) end,
      fn s -> {Enum.at(fx.huge, 0), s} end,
      fn s -> tuple_of([&binary_part(fx, &1), &bad_credential(fx, &1)], s) end
    ])
  end

  defp malformed(:ms, fx, s) do
    one_of(s, [
      fn s -> {-1, s} end,
      fn s -> {-fx.big, s} end,
      fn s -> {fx.big, s} end,
      fn s -> {1.5, s} end,
      fn s -> non_number_garbage(fx, s) end
    ])
  end

  defp malformed(:count, fx, s) do
    one_of(s, [
      fn s -> {0, s} end,
      fn s -> {-1, s} end,
      fn s -> {10_001, s} end,
      fn s -> {fx.big, s} end,
      fn s -> {5.0, s} end,
      fn s -> non_number_garbage(fx, s) end
    ])
  end

  # Never starts a limiter: one option in each is malformed.
  defp malformed(:start_options, fx, s) do
    name = [name: :"fuzz_never_started_#{System.unique_integer([:positive])}"]

    one_of(s, [
      fn s -> non_list_garbage(fx, s) end,
      fn s ->
        with_value(&[{&1, 1} | name], garbage(fx, s))
      end,
      fn s ->
        with_value(&[name: &1], retry(&garbage(fx, &1), &(not is_atom(&1) or &1 == nil), s))
      end,
      fn s -> with_value(&([backend: &1] ++ name), non_atom_garbage(fx, s)) end,
      fn s -> with_value(&([booking_slack_ms: &1] ++ name), bad_interval(fx, s)) end,
      fn s -> with_value(&([sweep_interval_ms: &1] ++ name), bad_interval(fx, s)) end,
      fn s ->
        with_value(
          &([assume_busy_at_start: &1] ++ name),
          retry(&garbage(fx, &1), &(not is_boolean(&1)), s)
        )
      end,
      fn s ->
        with_value(
          &([on_event: &1] ++ name),
          retry(&garbage(fx, &1), &(&1 != nil and not is_function(&1, 3)), s)
        )
      end
    ])
  end

  defp malformed(:credential, fx, s), do: bad_credential(fx, s)

  defp malformed(:status, fx, s) do
    one_of(s, [
      fn s -> {99, s} end,
      fn s -> {600, s} end,
      fn s -> {200.0, s} end,
      fn s -> {"200", s} end,
      fn s -> retry(&garbage(fx, &1), &(not is_integer(&1) or &1 not in 100..599), s) end
    ])
  end

  defp malformed(:headers, fx, s) do
    one_of(s, [
      fn s -> retry(&garbage(fx, &1), &(not is_list(&1) and not is_map(&1)), s) end,
      fn s -> {fx.deep_list, s} end,
      fn s -> {[{"retry-after", "1"} | :tail], s} end,
      fn s -> with_value(&[{"retry-after", "1"}, &1], garbage(fx, s)) end,
      fn s -> with_value(&[{&1, "1"}], non_text_garbage(fx, s)) end,
      fn s -> with_value(&[{"x-mbx-used-weight-1m", &1}], non_value_garbage(fx, s)) end,
      fn s -> with_value(&%{"retry-after" => &1}, non_value_garbage(fx, s)) end,
      fn s -> {[{"a", "b", "c"}], s} end
    ])
  end

  # Lists only: another term in their place is a name (an atom is a valid one).
  defp malformed(:feedback_options, fx, s) do
    one_of(s, [
      fn s -> {fx.deep_list, s} end,
      fn s -> {[:body], s} end,
      fn s -> {[bogus: 1], s} end,
      fn s -> {[{"body", "x"}], s} end,
      fn s -> {[{:body, "x"} | :tail], s} end,
      fn s -> with_value(&[body: &1], retry(&garbage(fx, &1), &(not body?(&1)), s)) end,
      fn s -> with_value(&[limits: &1], retry(&garbage(fx, &1), &(&1 != %{}), s)) end,
      fn s -> with_value(&[limits: %{"ip" => &1}], malformed(:limit, fx, s)) end,
      fn s ->
        with_value(&[limits: %{&1 => %{capacity: 10, refill_per_sec: 1}}], bad_part(fx, s))
      end
    ])
  end

  defp malformed(:allowance, fx, s) do
    one_of(s, [
      fn s -> {fx.big, s} end,
      fn s -> {-fx.big, s} end,
      fn s -> {1.0e308, s} end,
      fn s -> non_number_garbage(fx, s) end
    ])
  end

  # A short description of a term (never the whole of a deep or huge one).
  defp show(term, depth) when is_tuple(term) and tuple_size(term) <= 4 and depth > 0,
    do: "{" <> Enum.map_join(Tuple.to_list(term), ", ", &show(&1, depth - 1)) <> "}"

  defp show(term, _depth) when is_binary(term) and byte_size(term) <= 16, do: inspect(term)
  defp show(term, _depth) when is_binary(term), do: "<<#{byte_size(term)} bytes>>"

  defp show(term, _depth) when is_integer(term) and abs(term) > 100_000_000_000_000_000_000,
    do: "<<an integer of #{byte_size(:binary.encode_unsigned(abs(term)))} bytes>>"

  defp show([], _depth), do: "[]"
  defp show(term, _depth) when is_list(term), do: "<<a list>>"
  defp show(term, _depth) when is_map(term), do: "<<a map of #{map_size(term)} keys>>"
  defp show(term, _depth) when is_tuple(term), do: "<<a tuple of #{tuple_size(term)}>>"

  defp show(term, _depth), do: inspect(term)

  ## Building blocks

  defp garbage(fx, s) do
    one_of(s, [
      fn s -> {fx.big, s} end,
      fn s -> {-fx.big, s} end,
      fn s -> {1.0e308, s} end,
      fn s -> {-0.0, s} end,
      fn s -> int(s, -1_000_000, 1_000_000) end,
      fn s -> {:nan, s} end,
      fn s -> {:infinity, s} end,
      fn s -> {true, s} end,
      fn s -> {nil, s} end,
      fn s -> {:public, s} end,
      fn s -> pick(fx.huge, s) end,
      fn s -> {"", s} end,
      fn s -> {<<1::3>>, s} end,
      fn s -> {fx.deep_list, s} end,
      fn s -> {[1 | 2], s} end,
      fn s -> {[:a, :b | :c], s} end,
      fn s -> {~c"charlist", s} end,
      fn s -> {fx.deep_tuple, s} end,
      fn s -> {fx.deep_map, s} end,
      fn s -> {%{}, s} end,
      fn s -> {%{a: 1}, s} end,
      fn s -> {%URI{}, s} end,
      fn s -> {{}, s} end,
      fn s -> with_value(&List.to_tuple(List.duplicate(:x, &1)), int(s, 1, 8)) end,
      fn s -> {fx.pid, s} end,
      fn s -> {self(), s} end,
      fn s -> {fx.ref, s} end,
      fn s -> {fx.fun, s} end,
      fn s -> {&Kernel.+/2, s} end
    ])
  end

  defp non_nil_garbage(fx, s), do: retry(&garbage(fx, &1), &(&1 != nil), s)
  defp non_list_garbage(fx, s), do: retry(&garbage(fx, &1), &(not is_list(&1)), s)
  defp non_atom_garbage(fx, s), do: retry(&garbage(fx, &1), &(not is_atom(&1)), s)
  defp non_binary_garbage(fx, s), do: retry(&garbage(fx, &1), &(not is_binary(&1)), s)

  defp non_text_garbage(fx, s),
    do: retry(&garbage(fx, &1), &(not is_binary(&1) and not is_list(&1)), s)

  # Not a header value: a header's value may also be a number.
  defp non_value_garbage(fx, s), do: retry(&non_text_garbage(fx, &1), &(not is_number(&1)), s)

  defp body?(term), do: is_nil(term) or is_binary(term) or is_map(term) or is_list(term)

  defp non_number_garbage(fx, s), do: retry(&garbage(fx, &1), &(not is_number(&1)), s)

  # Never a credential: anything but a binary of at most 1024 bytes or `:public`.
  defp bad_credential(fx, s),
    do:
      retry(
        &garbage(fx, &1),
        &(not (is_binary(&1) and byte_size(&1) <= 1024) and &1 != :public),
        s
      )

  # Never a key part: anything but a binary of at most 1024 bytes.
  defp bad_part(fx, s),
    do: retry(&garbage(fx, &1), &(not (is_binary(&1) and byte_size(&1) <= 1024)), s)

  defp binary_part(_fx, s), do: pick(["ex", "okx", "", "k", "request"], s)

  # Never a finite number in 0..1.0e12 (and never 0 either, for capacities).
  defp bad_amount(fx, s) do
    one_of(s, [
      fn s -> {fx.big, s} end,
      fn s -> {10 ** 13, s} end,
      fn s -> {1.0e13, s} end,
      fn s -> {1.0e308, s} end,
      fn s -> {-fx.big, s} end,
      fn s -> {-1.0e308, s} end,
      fn s -> {-1, s} end,
      fn s -> non_number_garbage(fx, s) end
    ])
  end

  defp bad_period(fx, s) do
    one_of(s, [
      fn s -> {0, s} end,
      fn s -> {-1_000, s} end,
      fn s -> {fx.big, s} end,
      fn s -> non_number_garbage(fx, s) end
    ])
  end

  # Never a booking slack or sweep interval (0 or 1 to 86_400_000).
  defp bad_interval(fx, s) do
    one_of(s, [
      fn s -> {-1, s} end,
      fn s -> {86_400_001, s} end,
      fn s -> {fx.big, s} end,
      fn s -> {1.5, s} end,
      fn s -> {nil, s} end,
      fn s -> non_number_garbage(fx, s) end
    ])
  end

  defp bad_budget(fx, s) do
    one_of(s, [
      fn s -> {0, s} end,
      fn s -> {-1, s} end,
      fn s -> {4_294_967_296, s} end,
      fn s -> {fx.big, s} end,
      fn s -> {1.5, s} end,
      fn s -> {100.0, s} end,
      fn s -> {nil, s} end,
      fn s -> non_number_garbage(fx, s) end
    ])
  end

  defp tuple_of(generators, s) do
    {parts, s} = Enum.map_reduce(generators, s, fn generator, s -> generator.(s) end)
    {List.to_tuple(parts), s}
  end

  defp with_value(build, {value, s}), do: {build.(value), s}

  defp retry(generator, valid?, s) do
    {term, s} = generator.(s)
    if valid?.(term), do: {term, s}, else: retry(generator, valid?, s)
  end

  defp one_of(s, generators) do
    {generator, s} = pick(generators, s)
    generator.(s)
  end

  defp pick(list, s) do
    {i, s} = :rand.uniform_s(length(list), s)
    {Enum.at(list, i - 1), s}
  end

  defp int(s, low, high) do
    {i, s} = :rand.uniform_s(high - low + 1, s)
    {low + i - 1, s}
  end
end
