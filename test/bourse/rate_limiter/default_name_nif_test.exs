defmodule Bourse.RateLimiter.DefaultNameNIFTest do
  # Calls with the default name and the application env, on the in-VM NIF backend.
  use Bourse.DefaultNameContractTests, backend: :nif
end
