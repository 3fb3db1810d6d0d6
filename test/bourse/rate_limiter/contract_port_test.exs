defmodule Bourse.RateLimiter.ContractPortTest do
  # The whole contract (docs/CONTRACT.md) through the public API, with the buckets in a
  # bourse_daemon run as an Erlang port (one per limiter).
  # The random malformed calls leave out integers beyond a float (10 ** 400): bourse_daemon
  # answers a frame holding one as malformed JSON without the request's id, so its caller
  # waits for its timeout and gets :unavailable.
  use Bourse.ContractTests, backend: :port, fuzz: [bignums: false]
end
