defmodule Bourse.DefaultsTest do
  # Changes the application environment.
  use ExUnit.Case, async: false

  for {key, default} <- [rate_limit_max_wait_ms: 30_000, booking_slack_ms: 250] do
    test "#{key} reads the application environment, default #{default}" do
      previous = Application.fetch_env(:bourse, unquote(key))

      try do
        Application.put_env(:bourse, unquote(key), 1234)
        assert apply(Bourse.Defaults, unquote(key), []) == 1234
        Application.delete_env(:bourse, unquote(key))
        assert apply(Bourse.Defaults, unquote(key), []) == unquote(default)
      after
        with {:ok, value} <- previous, do: Application.put_env(:bourse, unquote(key), value)
      end
    end
  end

  test "a bad booking_slack_ms in config is named as config, given or not in start_link" do
    previous = Application.fetch_env(:bourse, :booking_slack_ms)

    try do
      Application.put_env(:bourse, :booking_slack_ms, :bad)

      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               Bourse.RateLimiter.start_link(name: :defaults_test_limiter)

      assert message =~ ~r/^config :bourse, booking_slack_ms must be an integer/

      assert {:error, %Bourse.Error{message: "booking_slack_ms must be" <> _}} =
               Bourse.RateLimiter.start_link(name: :defaults_test_limiter, booking_slack_ms: -1)
    after
      case previous do
        {:ok, value} -> Application.put_env(:bourse, :booking_slack_ms, value)
        :error -> Application.delete_env(:bourse, :booking_slack_ms)
      end
    end
  end

  test "config/config.exs sets the documented default" do
    assert Application.fetch_env(:bourse, :rate_limit_max_wait_ms) == {:ok, 30_000}
  end
end
