defmodule Bourse.Application do
  @moduledoc false
  # The `:bourse` application: a supervisor (`Bourse.Supervisor`) for what the library
  # keeps for the whole VM, the backoff counts of `Bourse.RateLimiter.Backoff`. Limiters
  # are started in the user's own supervision tree.

  use Application

  @impl true
  def start(_type, _args) do
    Supervisor.start_link([Bourse.RateLimiter.Backoff],
      strategy: :one_for_one,
      name: Bourse.Supervisor
    )
  end
end
