defmodule Bourse.RateLimiter.ContractNIFTest do
  # The whole contract (docs/CONTRACT.md) through the public API, on the in-VM NIF backend.
  use Bourse.ContractTests, backend: :nif
end
