defmodule Bourse.RateLimiter.NotLoadedTest do
  # A limiter that is not running judges malformed input in the caller, also in a VM that
  # never loaded the NIF backend (interactive code loading: `mix run`, `iex -S mix`): a
  # peer VM started here with this build's code, which loads modules when first called.
  use ExUnit.Case, async: false

  @moduletag :distributed

  setup_all do
    %{node: Bourse.PeerNode.start_for_module()}
  end

  test "malformed input to a limiter not running is :invalid_parameters, not :noproc",
       %{node: node} do
    assert :erpc.call(node, :code, :is_loaded, [Bourse.RateLimiter.Backend.NIF]) == false

    limit = %{capacity: 1, refill_per_sec: 1}

    calls = [
      {Bourse.RateLimiter, :check_rate, [{"ex", "k"}, limit, -1, :never_started]},
      {Bourse.RateLimiter, :check_rates, [[{{"ex", "k"}, :bad, 1}], :never_started]},
      {Bourse.RateLimiter, :record_request, [{"ex", 5}, 1, :never_started]}
    ]

    for {module, fun, args} <- calls do
      assert {:error, %Bourse.Error{type: :invalid_parameters, exchange: "ex"}} =
               :erpc.call(node, module, fun, args),
             "#{fun}"
    end
  end
end
