defmodule Bourse.RateLimiter.TelemetryTest do
  use ExUnit.Case, async: true

  import ExUnit.CaptureLog

  alias Bourse.RateLimiter
  alias Bourse.RateLimiter.Telemetry

  @credential "telemetry-test-api-key"
  @slow %{capacity: 1, refill_per_sec: 0.001}

  test "events/0 names every event the limiter documents" do
    documented =
      Regex.scan(~r/^\s*\| `:(\w+)` \|/m, Code.fetch_docs(RateLimiter.Events) |> moduledoc())
      |> Enum.map(fn [_, name] -> [:bourse, :rate_limiter, String.to_atom(name)] end)

    assert Enum.sort(Telemetry.events()) == Enum.sort(documented)
  end

  test "logger/1 as :on_event logs each event on one line, without the API key" do
    name = :"telemetry_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name, on_event: Telemetry.logger(level: :warning)})
    key = {"binance", @credential, "ip"}
    assert :ok = RateLimiter.check_rate(key, @slow, 1, name)

    log = capture_log(fn -> assert {:delay, _} = RateLimiter.check_rate(key, @slow, 1, name) end)

    assert log =~
             ~r/\[bourse\] refused delay_ms=\d+ limiter=:#{name} exchange="binance" credential="key:[0-9a-f]{8}" axis="ip" cost=1 max_wait_ms=nil reason=:delay/

    refute log =~ @credential
  end

  test "an unknown level or option is refused, and a limiter given it does not start" do
    for opts <- [[level: :nope], [level: "info"], [leve: :info], :info] do
      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               Telemetry.logger(opts),
             inspect(opts)

      assert {:error, %Bourse.Error{message: ^message}} = Telemetry.attach_default_logger(opts)

      assert {:error, %Bourse.Error{type: :invalid_parameters, message: ^message}} =
               RateLimiter.start_link(on_event: Telemetry.logger(opts))
    end

    assert {:error, %Bourse.Error{message: "level must be one of " <> _}} =
             Telemetry.logger(level: :nope)
  end

  test "attach_default_logger/1 logs the events a limiter sends to :telemetry" do
    refute Code.ensure_loaded?(:telemetry)
    assert Telemetry.attach_default_logger() == {:error, :telemetry_not_loaded}

    # Another VM, with a stand-in for the :telemetry application's API.
    script = Bourse.TempPath.new("bourse_telemetry", ".exs")

    on_exit(fn -> File.rm(script) end)

    File.write!(script, ~S"""
    defmodule :telemetry do
      def attach_many(id, events, fun, config) do
        handlers = :persistent_term.get(:handlers, %{})

        if Map.has_key?(handlers, id),
          do: {:error, :already_exists},
          else: :persistent_term.put(:handlers, Map.put(handlers, id, {events, fun, config}))
      end

      def detach(id), do: :persistent_term.put(:handlers, Map.delete(:persistent_term.get(:handlers), id))

      def execute(event, measurements, metadata) do
        for {_id, {events, fun, config}} <- :persistent_term.get(:handlers, %{}), event in events,
            do: fun.(event, measurements, metadata, config)

        :ok
      end
    end

    {:ok, _} = Application.ensure_all_started(:bourse)
    :ok = Bourse.RateLimiter.Telemetry.attach_default_logger(level: :warning)
    {:error, :already_exists} = Bourse.RateLimiter.Telemetry.attach_default_logger()
    {:ok, _} = Bourse.RateLimiter.start_link(name: :telemetry_check)
    limit = %{capacity: 1, refill_per_sec: 0.001}
    :ok = Bourse.RateLimiter.check_rate({"okx", "telemetry-test-api-key"}, limit, 1, :telemetry_check)
    {:delay, _} = Bourse.RateLimiter.check_rate({"okx", "telemetry-test-api-key"}, limit, 1, :telemetry_check)
    :ok = Bourse.RateLimiter.Telemetry.detach_default_logger()
    {:delay, _} = Bourse.RateLimiter.check_rate({"okx", "telemetry-test-api-key"}, limit, 1, :telemetry_check)
    Logger.flush()
    """)

    ebin = Path.dirname(:code.which(RateLimiter))
    {output, 0} = System.cmd("elixir", ["-pa", ebin, script], stderr_to_stdout: true)

    assert [_] =
             Regex.scan(
               ~r/\[bourse\] refused delay_ms=\d+ limiter=:telemetry_check exchange="okx" credential="key:[0-9a-f]{8}" axis="request"/,
               output
             )

    refute output =~ "telemetry-test-api-key"
  end

  defp moduledoc({:docs_v1, _, _, _, %{"en" => doc}, _, _}), do: doc
end
