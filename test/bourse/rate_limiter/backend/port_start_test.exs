defmodule Bourse.RateLimiter.Backend.PortStartTest do
  # A port whose daemon refuses its configuration is told why (the daemon answers its
  # hello with the message it prints on stderr, then exits 2): the limiter's start names
  # the cause, not only the exit status.
  use ExUnit.Case, async: true

  @moduletag :capture_log

  alias Bourse.RateLimiter

  test "a Redis URL the daemon refuses: the start's error names what is wrong with it" do
    url = "redis://127.0.0.1:6379/notanumber"

    assert {:error, %Bourse.Error{message: message}} =
             RateLimiter.start_link(name: :port_start_bad_db, backend: {:redis, url})

    assert message =~ "it refused its configuration"
    assert message =~ "Invalid database number"
    refute message =~ "exited with status"
  end

  test "a password in the URL is never in the refusal" do
    url = "redis://:s3cret-Pa55@127.0.0.1:6379/notanumber"

    assert {:error, %Bourse.Error{message: message}} =
             RateLimiter.start_link(name: :port_start_bad_db_password, backend: {:redis, url})

    assert message =~ "Invalid database number"
    refute message =~ "s3cret"
  end
end
