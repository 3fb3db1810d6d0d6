defmodule Bourse.RateLimiter.Backend.PortStartTest do
  # A port whose daemon refuses its configuration is told why (the daemon answers its
  # hello with the message it prints on stderr, then exits 2): the limiter's start names
  # the cause, not only the exit status.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.RateLimiter

  test "a Redis URL the daemon refuses: :invalid_parameters, naming what is wrong with it" do
    for {url, cause} <- [
          {"redis://127.0.0.1:6379/notanumber", "Invalid database number"},
          {"redis://127.0.0.1:99999", "99999"}
        ] do
      assert {:error, %Bourse.Error{type: :invalid_parameters, message: message}} =
               RateLimiter.start_link(name: :port_start_bad_url, backend: {:redis, url})

      assert message =~ "bourse_daemon refused its configuration"
      assert message =~ cause
      refute message =~ "exited with status"
    end
  end

  test "a password in the URL is never in the refusal" do
    url = "redis://:s3cret-Pa55@127.0.0.1:6379/notanumber"

    assert {:error, %Bourse.Error{message: message}} =
             RateLimiter.start_link(name: :port_start_bad_db_password, backend: {:redis, url})

    assert message =~ "Invalid database number"
    refute message =~ "s3cret"
  end
end
