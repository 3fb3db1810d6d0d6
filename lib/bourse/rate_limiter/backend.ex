defmodule Bourse.RateLimiter.Backend do
  @moduledoc """
  Where a limiter's buckets live. `Bourse.RateLimiter` routes calls and shapes answers
  (`Bourse.RateLimiter.Options` checks the limiter's options,
  `Bourse.RateLimiter.Router` its names); a backend checks its own part of the `:backend`
  option (`c:options/1`) and carries calls to a bucket table.

  Answers of the check callbacks:

    * `:ok` – paid (or claimed against the caller's own booking);
    * `{:delay, ms}` – nothing paid; to a waiter (`max_wait` not `nil`), only ever its
      own booking, ready in `ms` (`Bourse.RateLimiter` refuses it when `ms` exceeds the
      waiter's budget, leaving the booking);
    * `{:booked, ms}` – a waiter's booking, paid and ready in `ms`;
    * `{:over_budget, ms}` – the wait exceeds `max_wait`; nothing paid;
    * `{:error, message}` – malformed input, or `{:error, %Bourse.Error{}}`.

  `owner` is who the booking belongs to: the calling pid, or `{pid, integer}` once that
  process forfeited its bookings; `max_wait` is `nil` for a probe.
  """

  @type handle :: term()
  @type owner :: pid() | {pid(), integer()}
  @type error :: {:error, String.t() | Bourse.Error.t()}
  @type check_answer ::
          :ok | {:delay, pos_integer()} | {:booked, pos_integer()} | {:over_budget, pos_integer()}

  @doc """
  Checks the arguments of the backend in the `:backend` option of
  `Bourse.RateLimiter.start_link/1`: the elements after its name (`[]` for `:port`,
  `[address, opts]` for `{:daemon, address, opts}`). Returns what `attach/2` finds in its
  options as `:backend_opts`, or `{:error, message}`.
  """
  @callback options(args :: [term()]) :: {:ok, keyword()} | {:error, String.t()}

  @doc """
  Returns the handle to use from now on. `previous` is the handle an earlier incarnation
  of the same limiter left (after a crash), or `nil`.
  """
  @callback attach(previous :: handle() | nil, opts :: keyword()) ::
              {:ok, handle()} | {:error, term()}
  @callback check_rate(
              handle(),
              owner(),
              key :: term(),
              limit :: term(),
              cost :: term(),
              max_wait :: pos_integer() | nil
            ) ::
              check_answer() | error()
  @callback check_rates(handle(), owner(), checks :: term(), max_wait :: pos_integer() | nil) ::
              check_answer() | error()
  @doc """
  Gives back `owner`'s booking of `checks` (as `check_rates/4` takes them), without waiting
  for the store: its caller, waiting, was told the store was unavailable. The store runs
  it whenever it reads it, also past that caller's timeout.
  """
  @callback unbook(handle(), owner(), checks :: term()) :: :ok
  @callback record_request(handle(), key :: term(), cost :: term()) :: :ok | error()
  @callback get_cost(handle(), key :: term()) :: number() | error()
  @doc "Lowers the key's tokens so that they plus the refill over `window_left_ms` fit `allowance`; returns the tokens taken."
  @callback sync(
              handle(),
              key :: term(),
              allowance :: number(),
              window_left_ms :: non_neg_integer()
            ) ::
              number() | error()
  @callback reset(handle(), key :: term()) :: :ok | error()
  @callback reset_exchange(handle(), exchange :: term()) :: :ok | error()
  @callback reset_all(handle()) :: :ok | error()
  @callback pause(handle(), target :: term(), ms :: term()) :: :ok | error()
  @doc """
  Counts a limited reply without a usable wait for `credential`
  (`{exchange_id, credential_key}`), or for its exchange with scope `:exchange`, and
  pauses `scope` (`:credential` or `:exchange`) for the backoff; returns the pause in
  milliseconds.
  """
  @callback back_off(handle(), credential :: term(), scope :: term()) :: pos_integer() | error()
  @doc """
  Forgets the backoff counts of `credential` and of its exchange, each unless its last
  backoff's pause holds: the next backoff is the first.
  """
  @callback reset_backoff(handle(), credential :: term()) :: :ok | error()
  @callback inspect(handle(), key :: term()) :: map() | nil | error()
  @callback stats(handle()) :: map() | error()
  @doc """
  The `count` busiest keys, each as its `inspect/2` fields with `:exchange`, `:credential`
  (its fingerprint) and `:axis`.
  """
  @callback busiest(handle(), count :: pos_integer()) :: [map()] | error()
  @callback sweep(handle()) :: non_neg_integer() | error()
  @doc """
  The last moment (monotonic ms) the store may have lost the bookings it held (a daemon
  that restarted with a new table, or whose stream broke), `nil` for never.
  """
  @callback store_lost_at(handle()) :: integer() | nil
end
