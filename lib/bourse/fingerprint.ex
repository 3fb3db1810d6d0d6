defmodule Bourse.Fingerprint do
  @moduledoc """
  A short, stable stand-in for an API key wherever one would be shown: logs, telemetry
  events, error messages, `mix bourse.top`.

      Bourse.Fingerprint.of("my-api-key")
      #=> "key:" followed by 8 hex digits, the same on every node and every run

      Bourse.Fingerprint.of(:public)
      #=> :public

  The fingerprint is the first 8 hex digits of the key's SHA-256: enough to tell the keys
  of one deployment apart and to match a row to a key (compute the key's fingerprint and
  compare), far too little to recover anything of the key.
  """

  @typedoc "`\"key:\"` and 8 lowercase hex digits, or `:public`."
  @type t :: String.t() | :public

  @doc """
  The fingerprint of a credential: `:public` stays `:public`; any other term (a binary API
  key, one that looks like a fingerprint included, or something malformed passed in its
  place) becomes `"key:1a2b3c4d"`.
  """
  @spec of(term()) :: t()
  def of(:public), do: :public
  def of(credential) when is_binary(credential), do: digest(credential)
  def of(other), do: digest(:erlang.term_to_binary(other))

  defp digest(bytes) do
    <<prefix::binary-size(4), _::binary>> = :crypto.hash(:sha256, bytes)
    "key:" <> Base.encode16(prefix, case: :lower)
  end
end
