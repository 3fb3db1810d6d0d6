defmodule Bourse.RateLimiter.ContractPortTest do
  # The whole contract (docs/CONTRACT.md) through the public API, with the buckets in a
  # bourse_daemon run as an Erlang port (one per limiter).
  use Bourse.ContractTests, backend: :port
end
