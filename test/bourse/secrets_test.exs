defmodule Bourse.SecretsTest do
  # Not async: captures the global Logger and Mix shell.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias Bourse.{Fingerprint, RateLimiter}
  alias Bourse.RateLimiter.Events

  @secret "SECRET-API-KEY-123"
  @fingerprint Fingerprint.of(@secret)
  @limit %{capacity: 1, refill_per_sec: 0.001}

  setup do
    name = :"secrets_#{System.unique_integer([:positive])}"
    test = self()

    on_event = fn event, measurements, metadata ->
      send(test, {:event, event, measurements, metadata})
      # Whatever the callback prints of its arguments reaches the log.
      if event == [:bourse, :rate_limiter, :paused], do: raise("failed on #{inspect(metadata)}")
    end

    start_supervised!({RateLimiter, name: name, on_event: on_event})
    %{name: name}
  end

  defp refute_secret(text) do
    refute text =~ @secret
    refute text =~ "SECRET"
    text
  end

  test "a fingerprint is short, stable and tells keys apart" do
    assert @fingerprint =~ ~r/\Akey:[0-9a-f]{8}\z/
    assert Fingerprint.of(@secret) == @fingerprint
    assert Fingerprint.of(@secret <> "4") != @fingerprint
    assert Fingerprint.of(:public) == :public
    assert Fingerprint.of("key:deadbeef") =~ ~r/\Akey:[0-9a-f]{8}\z/
    assert Fingerprint.of("key:deadbeef") != "key:deadbeef"
    assert Fingerprint.of(~c"SECRET-API-KEY-123") =~ ~r/\Akey:[0-9a-f]{8}\z/
  end

  test "events carry the fingerprint, never the key", %{name: name} do
    key = {"binance", @secret, "ip"}
    assert :ok = RateLimiter.check_rate(key, @limit, 1, name)
    assert {:delay, _} = RateLimiter.check_rate(key, @limit, 1, name)

    assert {:delay, _} =
             RateLimiter.check_rates([{key, @limit, 1}, {{"binance", @secret}, @limit, 1}], name)

    assert {:error, _} =
             RateLimiter.wait_for_capacity({"okx", @secret}, @limit, 2, name, max_wait_ms: 1)

    log = capture_log(fn -> assert :ok = RateLimiter.pause({"binance", @secret}, 5, name) end)

    assert :ok =
             Events.emit(name, :rate_limited, %{retry_after_ms: 1}, %{
               key: key,
               credential: @secret
             })

    events =
      Stream.repeatedly(fn -> receive do: ({:event, _, _, _} = e -> e), after: (0 -> nil) end)

    events = Enum.take_while(events, & &1)

    assert length(events) == 5

    for event <- events do
      assert inspect(event) |> refute_secret() =~ @fingerprint
    end

    assert refute_secret(log) =~ @fingerprint
  end

  test "error messages never echo a credential", %{name: name} do
    charlist = ~c"SECRET-API-KEY-123"
    atom = :"SECRET-API-KEY-123"

    calls = [
      fn ->
        RateLimiter.check_rate({"binance", @secret}, %{capacity: -1, refill_per_sec: 1}, 1, name)
      end,
      fn -> RateLimiter.check_rate({"binance", @secret}, %{bogus: 1}, 1, name) end,
      fn -> RateLimiter.check_rate({"binance", @secret, :ip}, @limit, 1, name) end,
      fn -> RateLimiter.check_rate({"binance", charlist}, @limit, 1, name) end,
      fn -> RateLimiter.check_rate({"binance", atom, "ip"}, @limit, 1, name) end,
      fn -> RateLimiter.check_rate({"binance", {@secret}}, @limit, 1, name) end,
      fn -> RateLimiter.check_rate({"binance", @secret, "ip", "extra"}, @limit, 1, name) end,
      fn -> RateLimiter.check_rate(@secret, @limit, 1, name) end,
      fn -> RateLimiter.check_rate({"binance", @secret}, @limit, 1, @secret) end,
      fn -> RateLimiter.check_rates([{{"binance", @secret}, @limit}], name) end,
      fn -> RateLimiter.check_rates([{{"binance", charlist}, @limit, 1}], name) end,
      fn ->
        RateLimiter.check_rates(
          [{{"binance", @secret}, @limit, 1}, {{"binance", @secret}, %{requests: 5}, 1}],
          name
        )
      end,
      fn -> RateLimiter.wait_for_capacity({"binance", charlist}, @limit, 1, name) end,
      fn -> RateLimiter.record_request({"binance", charlist}, 1, name) end,
      fn -> RateLimiter.get_cost({"binance", charlist}, 1000, name) end,
      fn -> RateLimiter.reset({"binance", charlist}, name) end,
      fn -> RateLimiter.inspect_key({"binance", charlist}, name) end,
      fn -> RateLimiter.pause({"binance", charlist}, 5, name) end,
      fn -> RateLimiter.pause({"binance", @secret, "ip", "extra"}, 5, name) end,
      fn -> RateLimiter.pause(charlist, 5, name) end
    ]

    for call <- calls do
      assert {:error, %Bourse.Error{type: :invalid_parameters} = error} = call.()
      refute_secret(Exception.message(error))
      refute_secret(inspect(error))
    end
  end

  test "inspect_key, busiest and stats show no key", %{name: name} do
    assert :ok = RateLimiter.check_rate({"binance", @secret}, @limit, 1, name)
    refute_secret(inspect(RateLimiter.inspect_key({"binance", @secret}, name)))
    assert refute_secret(inspect(RateLimiter.busiest(10, name))) =~ @fingerprint
    refute_secret(inspect(RateLimiter.stats(name)))
  end

  test "the crash report of a limiter's process shows no key" do
    # A caller's request no longer crashes it (malformed ones are refused), so the report
    # is what OTP would log: what format_status/1 leaves of the request being handled.
    key = {"binance", @secret, "ip"}
    request = {:run, :check_rate, [self(), key, %{capacity: 1, refill_per_sec: 1}, 1, nil]}

    status =
      Bourse.RateLimiter.Server.format_status(%{
        message: {:"$gen_call", {self(), make_ref()}, request},
        state: %{name: :crashing},
        reason: :crash,
        log: []
      })

    assert %{message: {:"$gen_call", _from, {:run, :check_rate, 5}}} = status
    refute_secret(inspect(status))
  end

  test "mix bourse.top shows the fingerprint", %{name: name} do
    Mix.shell(Mix.Shell.Process)
    on_exit(fn -> Mix.shell(Mix.Shell.IO) end)
    assert :ok = RateLimiter.check_rate({"binance", @secret, "ip"}, @limit, 1, name)
    Mix.Tasks.Bourse.Top.run(["--name", ":#{name}"])
    assert_received {:mix_shell, :info, [table]}
    assert refute_secret(table) =~ @fingerprint
  end
end
