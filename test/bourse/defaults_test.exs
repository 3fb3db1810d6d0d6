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

  test "config/config.exs sets the documented default" do
    assert Application.fetch_env(:bourse, :rate_limit_max_wait_ms) == {:ok, 30_000}
  end
end
