defmodule Bourse.RateLimiter.Bucket do
  @moduledoc """
  A prepared bucket: what `Bourse.RateLimiter.bucket/3` returns, and
  `Bourse.RateLimiter.check_rate/2` and `Bourse.RateLimiter.check_rates/3` take in place
  of a key and its limit. Its fields are private to `Bourse.RateLimiter`.

  Inspecting a bucket shows its key with the credential as its fingerprint
  (`Bourse.Fingerprint`), never the API key itself. Its raw fields hold the key as given:
  a print that skips `Inspect` (`inspect(bucket, structs: false)`, Erlang's `~p`) shows
  the API key.
  """

  @enforce_keys [:name, :key, :limit, :route, :prepared]
  defstruct @enforce_keys

  @typedoc false
  @type t :: %__MODULE__{
          name: GenServer.name(),
          key: Bourse.RateLimiter.key(),
          limit: Bourse.RateLimiter.rate_limit() | nil,
          route: Bourse.RateLimiter.Router.route(),
          prepared: reference() | nil
        }

  defimpl Inspect do
    def inspect(%{key: key, limit: limit, name: name}, opts) do
      %{exchange: exchange, credential: credential, axis: axis} =
        Bourse.RateLimiter.Events.describe_key(key)

      Inspect.Algebra.concat([
        "#Bourse.RateLimiter.Bucket<",
        Inspect.Algebra.to_doc({exchange, credential, axis}, opts),
        ", ",
        Inspect.Algebra.to_doc(limit, opts),
        ", ",
        Inspect.Algebra.to_doc(name, opts),
        ">"
      ])
    end
  end
end
