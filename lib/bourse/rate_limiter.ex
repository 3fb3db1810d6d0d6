defmodule Bourse.RateLimiter do
  @moduledoc """
  Per-credential, weighted token-bucket rate limiter for exchange API requests.

  Each `{exchange_id, credential_key, bucket_axis}` key holds a bucket of `capacity`
  tokens refilling at `refill_per_sec`. A request of cost `c` is admitted when the bucket
  holds `c`; otherwise the answer is how long to wait. Costs above the capacity are
  limited, not exempt: they wait until that much has accrued, then leave the bucket empty.

  ## Keys

    * `exchange_id` – a binary such as `"binance"`;
    * `credential_key` – the API key (a binary), or `:public` for the shared pool of
      unauthenticated requests;
    * `bucket_axis` – the counter the exchange keeps (`"request"`, `"ip"`, `"uid"`,
      `"order_weight"`, ...). `{exchange_id, credential_key}` means axis `"request"`.

  ## Limits

    * `%{capacity: c, refill_per_sec: r}`;
    * `%{requests: n, period: ms}` – the same as `%{capacity: n, refill_per_sec: n / (ms / 1000)}`;
    * `%{requests: n}` – a period of one second;
    * `nil` – no limit: validated, then `:ok` without recording anything.

  See `Bourse.RateLimiter.Limits` to size buckets from an exchange's published limits.

  ## Probes and waiters

  `check_rate/4` and `check_rates/3` without `:max_wait_ms` are *probes*: a delay pays
  nothing and reserves nothing. `wait_for_capacity/5` and `check_rates/3` with
  `:max_wait_ms` are *waiters*: a delay within the budget *books* the cost at once, so
  later callers queue behind it and cheap traffic cannot starve a heavy call. The same
  process coming back with the same checks at the ready time is admitted against its
  booking without a second charge (unless the process forfeited its bookings, on every
  limiter, when a waiter of it was admitted without its store's word or told
  `:unavailable`: see `wait_for_capacity/5`). A booking not claimed within
  `:booking_slack_ms` of its ready time lapses; its cost stays paid.

  ## Usage

      children = [{Bourse.RateLimiter, name: MyApp.Limiter}]
      Supervisor.start_link(children, strategy: :one_for_one)

      key = {"okx", api_key, "request"}

      case Bourse.RateLimiter.check_rate(key, %{capacity: 1, refill_per_sec: 9.09}, 1, MyApp.Limiter) do
        :ok -> make_request()
        {:delay, ms} -> Process.sleep(ms) && make_request()
      end

  ## Prepared buckets

  An adapter that checks the same endpoint many times can prepare its buckets once:
  `bucket/3` validates a key and its limit (with the errors a check of them would give)
  and returns a bucket that `check_rate/2` and `check_rates/3` take in place of them.
  With the NIF backend a check of a bucket skips decoding the key and the limit, hashing
  the key and looking the limiter up by name; its answers are those of its key and limit.

      {:ok, orders} = Bourse.RateLimiter.bucket({"okx", api_key, "order"}, %{capacity: 60, refill_per_sec: 30}, MyApp.Limiter)
      {:ok, ip} = Bourse.RateLimiter.bucket({"okx", :public, "ip"}, %{capacity: 20, refill_per_sec: 10}, MyApp.Limiter)

      :ok = Bourse.RateLimiter.check_rate(orders, 1)
      :ok = Bourse.RateLimiter.check_rates([{orders, 1}, {ip, 1}], MyApp.Limiter)

  Callers reach the bucket table from their own process (no mailbox on the hot path),
  whatever the name's form; a call to a limiter on another node runs in a process started
  there for it (`:erpc`), not in the limiter's process.

  ## Observing

  `inspect_key/2` shows one bucket, `stats/1` the limiter's counters, `busiest/2` (and
  `mix bourse.top`) the keys closest to their limits. Refusals, bookings, waits, lapses
  and pauses are emitted as events (`Bourse.RateLimiter.Events`) to an `:on_event`
  callback and to `:telemetry` when it is loaded. API keys never appear in any of them:
  a credential is shown as its fingerprint (`Bourse.Fingerprint`).

  ## Errors

  Malformed input (keys, limits, costs, options, names) is answered with
  `{:error, %Bourse.Error{type: :invalid_parameters, message: ...}}` naming what is wrong;
  nothing is paid and nothing crashes. A name that is not a limiter's (another process,
  `{:via, NotAModule, _}`) is malformed too, and that process is never called. A call
  of well-formed input to a limiter that is not running exits the caller with `:noproc`,
  as `GenServer.call/2` would; malformed input is answered as malformed all the same.

  Every error carries the `:exchange` of the call's key when it can be read (for
  `check_rates/3`: the exchange of the check a malformed input error is about, or the one
  exchange every check names; `nil` when they name several, or one cannot be read).
  Messages describe a bad value by its type and size and never show an API key; a wait
  over the budget reads `"okx: waiting 1000 ms exceeds max_wait_ms 40"`.
  """

  alias Bourse.Error
  alias Bourse.RateLimiter.{Backend, Bucket, Events, Feedback, Options, Router, Server}

  @default __MODULE__
  @owner_key {__MODULE__, :owner}
  @typedoc "Rate limiter key: `{exchange_id, api_key | :public, bucket_axis}`."
  @type key ::
          {String.t(), String.t() | :public, String.t()} | {String.t(), String.t() | :public}

  @typedoc "Token-bucket configuration."
  @type rate_limit ::
          %{capacity: number(), refill_per_sec: number()}
          | %{requests: number(), period: number()}
          | %{requests: number()}

  @typedoc "A single bucket check: `{key, rate_limit, cost}`, or `{bucket, cost}`."
  @type bucket_check :: {key(), rate_limit() | nil, number()} | {bucket(), number()}

  @typedoc """
  A prepared bucket (`bucket/3`): a key and its limit, validated once, that `check_rate/2`
  and `check_rates/3` take in place of them.
  """
  @opaque bucket :: Bucket.t()

  @typedoc "What `pause/3` holds: a full key, `{exchange_id, credential_key}` or an exchange id."
  @type pause_target :: key() | String.t()

  @type error :: {:error, Error.t()}

  @typedoc "A snapshot of one key: see `inspect_key/2`."
  @type key_info :: %{
          limit: %{capacity: float(), refill_per_sec: float()} | nil,
          tokens: float(),
          borrowed: float(),
          debt: float(),
          bookings: non_neg_integer(),
          booked_cost: float(),
          next_ready_ms: non_neg_integer() | nil,
          pause_ms: pos_integer() | nil
        }

  ## Checks

  @doc """
  Checks if a request of `cost` can be made now.

  Returns `:ok` (paid) or `{:delay, ms}`: nothing paid; come back in `ms` milliseconds.
  `check_rate(key, limit)` and `check_rate(key, limit, cost)` check with the default
  limiter, `Bourse.RateLimiter`.
  """
  @spec check_rate(key(), rate_limit() | nil, number(), GenServer.name()) ::
          :ok | {:delay, pos_integer()} | error()
  def check_rate(key, limit, cost, name) do
    route = Router.route(name)

    # The hot path: a direct call to the backend, no argument list built for `apply/3`;
    # the NIF and the daemon's backends named, so that the call is not looked up by its
    # module.
    answer =
      case route do
        {Backend.NIF, table, _events, _pid} ->
          Backend.NIF.check_rate(table, owner(), key, limit, cost, nil)

        # The port's and the socket's, one implementation.
        {backend, handle, _events, _pid} when backend in [Backend.Port, Backend.Daemon] ->
          Backend.Protocol.check_rate(handle, owner(), key, limit, cost, nil)

        {backend, handle, _events, _pid} ->
          backend.check_rate(handle, owner(), key, limit, cost, nil)

        elsewhere ->
          routed(elsewhere, name, :check_rate, [owner(), key, limit, cost, nil])
      end

    case answer do
      :ok -> :ok
      other -> checked(other, route, key, cost)
    end
  end

  @doc """
  `check_rate(bucket, cost \\\\ 1)`: checks a bucket made by `bucket/3`, as
  `check_rate(key, limit, cost, name)` checks its key and limit with its limiter.
  `check_rate(key, limit)` is `check_rate(key, limit, 1, Bourse.RateLimiter)`.
  """
  @spec check_rate(bucket(), number()) :: :ok | {:delay, pos_integer()} | error()
  @spec check_rate(key(), rate_limit() | nil) :: :ok | {:delay, pos_integer()} | error()
  def check_rate(bucket_or_key, cost_or_limit)

  def check_rate(
        %Bucket{route: {Backend.NIF, table, _events, pid} = route, prepared: prepared} = bucket,
        cost
      )
      when is_reference(prepared) and is_pid(pid) do
    # While the limiter that prepared the bucket lives and its name still routes to it,
    # its table is the one the name reaches (a `{:global, _}` name, say, may have been
    # registered to another limiter since).
    if reaches(bucket.name) === route and :erlang.is_process_alive(pid) do
      case Backend.NIF.check_prepared(table, owner(), prepared, cost, nil) do
        :ok -> :ok
        :not_prepared -> check_rate(bucket.key, bucket.limit, cost, bucket.name)
        other -> checked(other, route, bucket.key, cost)
      end
    else
      check_rate(bucket.key, bucket.limit, cost, bucket.name)
    end
  end

  def check_rate(%Bucket{key: key, limit: limit, name: name}, cost),
    do: check_rate(key, limit, cost, name)

  def check_rate(key, limit), do: check_rate(key, limit, 1, @default)

  @doc "`check_rate(bucket)` is `check_rate(bucket, 1)`; anything but a bucket is `:invalid_parameters`."
  @spec check_rate(bucket()) :: :ok | {:delay, pos_integer()} | error()
  def check_rate(%Bucket{} = bucket), do: check_rate(bucket, 1)

  def check_rate(other) do
    message = "check_rate/1 takes a bucket made by bucket/3, got #{Error.describe(other)}"
    failed({:error, message}, {:key, other})
  end

  @doc "`check_rate(key, limit, cost)` is `check_rate(key, limit, cost, Bourse.RateLimiter)`."
  @spec check_rate(key(), rate_limit() | nil, number()) ::
          :ok | {:delay, pos_integer()} | error()
  # Passes on a cost that is no number on purpose: the store refuses it, as any other.
  @dialyzer {:nowarn_function, check_rate: 3}
  def check_rate(key, limit, cost) when is_atom(cost) and not is_boolean(cost) and cost != nil do
    # Most often a limiter's name where the cost goes: the message says where names go.
    case check_rate(key, limit, cost, @default) do
      {:error, %Error{type: :invalid_parameters, message: "cost " <> _} = error} ->
        hint = " (the third argument is the cost; name a limiter as the fourth)"
        {:error, %{error | message: error.message <> hint}}

      answer ->
        answer
    end
  end

  def check_rate(key, limit, cost), do: check_rate(key, limit, cost, @default)

  # What a prepared bucket's name reaches now: an atom's route is what it published.
  defp reaches(name) when is_atom(name), do: Router.published(name)
  defp reaches(name), do: Router.route(name)

  # A probe's answer other than `:ok`, with its event and its error shaped.
  defp checked(answer, route, key, cost),
    do: answer |> observe(route, nil, fn -> %{key: key, cost: cost} end) |> failed({:key, key})

  @doc """
  Prepares a bucket of the limiter `name`: `key` and `limit` checked once, for
  `check_rate/2` and `check_rates/3` to take in place of them.

  Returns `{:ok, bucket}`, or the `{:error, %Bourse.Error{}}` that
  `check_rate(key, limit, 1, name)` answers for that key and limit, and nothing is paid
  either way. Like every call, it needs the limiter running (otherwise it exits with
  `:noproc`). A `nil` limit is allowed: checks of the bucket validate their cost and
  answer `:ok`.

  With the NIF backend the bucket holds the key packed and hashed and the limit decoded,
  so a check of it does less work than one of its key and limit. With the other backends,
  or a limiter on another node, it holds the key and the limit, and its checks are those
  of them. Checking a bucket is checking its key and limit in every way (bookings,
  events, errors); after its limiter was restarted, a bucket is checked as its key and
  limit with the limiter now running under its name (make it again to have it prepared
  for the new one).

      {:ok, orders} = Bourse.RateLimiter.bucket({"okx", api_key, "order"}, %{capacity: 60, refill_per_sec: 30}, MyApp.Limiter)
      :ok = Bourse.RateLimiter.check_rate(orders, 1)
  """
  @spec bucket(key(), rate_limit() | nil, GenServer.name()) :: {:ok, bucket()} | error()
  def bucket(key, limit, name \\ @default) do
    route = Router.route(name)

    case prepare(route, name, key, limit) do
      {:ok, prepared} ->
        {:ok, %Bucket{name: name, key: key, limit: limit, route: route, prepared: prepared}}

      error ->
        failed(error, {:key, key})
    end
  end

  defp prepare({Backend.NIF, table, _events, _pid}, _name, key, limit) do
    case Backend.NIF.prepare(table, key, limit) do
      {:error, _} = error -> error
      prepared -> {:ok, prepared}
    end
  end

  # Other backends, and limiters on other nodes, check keys and limits as the NIF does:
  # the same rules and messages.
  defp prepare({_backend, _handle, _events, _pid} = route, _name, key, limit),
    do: validate(route, key, limit)

  defp prepare({:remote, _pid} = route, _name, key, limit), do: validate(route, key, limit)

  defp prepare(elsewhere, name, key, limit) do
    with {:ok, nil} <- validate(elsewhere, key, limit), do: routed(elsewhere, name, :prepare, [])
  end

  defp validate(route, key, limit) do
    with :ok <- verdict(Bourse.Native.check_key(key)),
         {:ok, _definition} <- verdict(Bourse.Native.limit_definition(limit)) do
      {:ok, nil}
    else
      error ->
        count_invalid(route)
        error
    end
  end

  defp verdict({:error, message, exchange}),
    do: {:error, Error.with_exchange(Error.invalid(message), exchange)}

  defp verdict(valid), do: valid

  @doc """
  Checks several buckets at once: all of them pay, or none does. Each check is
  `{key, limit, cost}`, or `{bucket, cost}` with a bucket of `bucket/3`, which stands
  for its key and limit (checked with the limiter the call names).

  Repeated checks of one key are charged once at their combined cost; two checks of one
  key with different definitions are `:invalid_parameters`. Returns `:ok`, or
  `{:delay, ms}` for the longest wait.

  With `max_wait_ms: budget` (a positive integer of at most `4_294_967_295`) the caller
  is a waiter: a delay within the budget is booked (see the moduledoc) and the caller
  must come back after `ms`; a longer delay books nothing. A caller that holds a booking
  for these checks and comes back with a budget shorter than the booking's remaining
  wait gets `{:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: remaining}}`;
  its booking stays and may still be claimed. A waiter's call answered `:unavailable`
  gives back the booking it made or came to claim (docs/CONTRACT.md §8, "Stores").
  """
  @spec check_rates([bucket_check()], GenServer.name() | keyword(), keyword()) ::
          :ok | {:delay, pos_integer()} | error()
  def check_rates(checks, name_or_opts \\ @default, opts \\ [])

  def check_rates(checks, opts, []) when is_list(opts), do: check_rates(checks, @default, opts)

  def check_rates(checks, name, opts) do
    route = Router.route(name)

    with {:ok, max_wait} <- options(opts, nil, route, {:checks, checks}) do
      # The NIF takes buckets as they are; every other backend their keys and limits.
      answer =
        case route do
          {Backend.NIF, table, _events, _pid} ->
            Backend.NIF.check_rates(table, owner(), checks, max_wait)

          elsewhere ->
            routed(elsewhere, name, :check_rates, [owner(), unprepared(checks), max_wait])
        end

      case answer do
        :ok ->
          :ok

        answer ->
          metadata = fn -> checks |> unprepared() |> Events.checks_metadata() end

          case observe(answer, route, max_wait, metadata) do
            {:over_budget, ms} ->
              {:delay, ms}

            {:error, %Error{type: :unavailable}} = unavailable when max_wait != nil ->
              unbook(route, [owner(), unprepared(checks)])
              failed(unavailable, {:checks, checks})

            other ->
              failed(other, {:checks, checks})
          end
      end
    end
  end

  @doc """
  Blocks the caller until the request is admitted, then returns `:ok`.

  The cost is booked at once (first come, first served); the caller sleeps in its own
  process, then claims the booking. When the wait would exceed `:max_wait_ms` (a positive
  integer of at most `4_294_967_295`, default `Bourse.Defaults.rate_limit_max_wait_ms/0`)
  it returns at once, paying nothing:
  `{:error, %Bourse.Error{type: :rate_limit_exceeded, retry_after: ms}}`. A caller that
  already holds a booking for this check gets the same answer, at once, when the
  booking's remaining wait exceeds the budget; the booking stays, to be claimed later.
  The budget covers the whole call: a caller that wakes after its booking lapsed (later
  than `:booking_slack_ms` after its ready time) books again only within what is left.
  Each lapsed booking stays paid, so a caller that keeps waking late pays once per
  booking and may still end with `:rate_limit_exceeded` when the budget runs out: keep
  the slack above the caller's wake-up delay.
  A caller that wakes to find the limiter stopped, or is told its store is unavailable
  within `:booking_slack_ms` of its booking's ready time, is admitted against the booking
  it paid: `:ok`. That booking, which the store may still hold, is not claimed again: the
  process's later checks, on every limiter, book under a new owner, and bookings it left
  behind lapse, paid. Not so when a pause was recorded through this limiter, of any key
  (`pause/3`, or `observe_response/6` after a limited reply, also one the store did not
  confirm), or the limiter started, since the caller asked: such a pause may hold its
  booking, and move the bookings ahead of it, past the ready time it was told, which only
  the store knows, so the call answers `:unavailable`. So it does when the connection to
  the limiter's daemon broke, or the daemon came back with a new table, since the caller
  asked: the booking may be gone, its refill given to others. Told later than the slack, its
  booking has lapsed (as any late waiter's), and the call answers `:unavailable`. A call
  answered `:unavailable` gives back the booking it made or came to claim: the store takes
  it back when it reads the request, where it is still the latest booking held
  (docs/CONTRACT.md §8, "Stores"); the process books under a new owner from then on, as
  the store may read that request after the process's next check.
  """
  @spec wait_for_capacity(
          key(),
          rate_limit() | nil,
          number(),
          GenServer.name() | keyword(),
          keyword()
        ) ::
          :ok | error()
  def wait_for_capacity(key, limit, cost \\ 1, name_or_opts \\ @default, opts \\ [])

  def wait_for_capacity(key, limit, cost, opts, []) when is_list(opts),
    do: wait_for_capacity(key, limit, cost, @default, opts)

  def wait_for_capacity(key, limit, cost, name, opts) do
    route = Router.route(name)

    default = Bourse.Defaults.rate_limit_max_wait_ms()

    with {:ok, max_wait} <- options(opts, default, route, {:key, key}) do
      await(route, name, [owner(), key, limit, cost, max_wait], nil)
    end
  end

  # `slept`: `nil` until the caller first sleeps, then `{since, due}`: when it first asked
  # (before its booking was made), and when its last sleep was to end, its booking's ready
  # time (monotonic ms). Each check after a sleep has what is left of the budget: a caller
  # that woke later than the booking slack after its ready time finds its booking lapsed
  # (and paid), and books again only within its budget; with nothing left it only probes
  # (it claims a ready booking, or pays what the bucket holds now), so the call ends by
  # then.
  #
  # A caller that slept has paid its booking: when it finds the limiter stopped, or is told
  # its store is unavailable within the booking slack of the booking's ready time, it is
  # admitted against that booking (an exit, or an `:unavailable` refusal, would be an
  # answer that paid), which it then forfeits; unless a pause was noted since it asked,
  # which may hold the booking (never send inside an exchange's Retry-After), or the store
  # may have lost the booking since. Told later than that, its booking has lapsed, as any
  # late waiter's.
  defp await(:noproc, _name, _args, {_since, _due}), do: forfeit_bookings()

  defp await(route, name, [owner, key, limit, cost, max_wait], slept) do
    metadata = fn -> %{key: key, cost: cost} end
    asked_at = System.monotonic_time(:millisecond)
    since = slept && elem(slept, 0)
    {left, _max_wait} = budget = budget_left(max_wait, since)
    args = [owner, key, limit, cost, if(left > 0, do: left)]

    case route |> routed(name, :check_rate, args) |> observe(route, budget, metadata) do
      :ok when since == nil ->
        :ok

      :ok ->
        admitted_after_wait(route, since, metadata)

      {:error, %Error{type: :unavailable}} = unavailable ->
        if since != nil and on_time?(route, slept) and not paused_since?(route, slept) and
             not lost_since?(route, slept) do
          forfeit_bookings()
          admitted_after_wait(route, since, metadata)
        else
          # Under a new owner from now on: the store may read the unbook after this
          # process's next check, whose booking it must not give back.
          unbook(route, [owner, [{key, limit, cost}]])
          forfeit_bookings()
          failed(unavailable, {:key, key})
        end

      # Booked, or early for the caller's booking: within the budget either way.
      {:delay, ms} ->
        now = System.monotonic_time(:millisecond)
        Process.sleep(ms)

        await(
          again(route, name),
          name,
          [owner, key, limit, cost, max_wait],
          {since || asked_at, now + ms}
        )

      {:over_budget, ms} ->
        {:error, over_budget(ms, budget, exchange({:key, key}))}

      other ->
        failed(other, {:key, key})
    end
  end

  # The booking owner of the calling process: the process, until it forfeits its bookings.
  defp owner, do: Process.get(@owner_key, self())

  # A waiter told `:unavailable` gives back the booking its check made or came to claim,
  # if the store holds one, whenever the store reads this (a call answered `:unavailable`
  # never pays): sent without waiting, also to a limiter on another node.
  defp unbook({backend, handle, _events, _pid}, args),
    do: apply(backend, :unbook, [handle | args])

  defp unbook({:remote, pid}, args),
    do: :erpc.cast(node(pid), Bourse.RateLimiter, :run_here, [pid, :unbook, args])

  defp unbook(_gone, _args), do: :ok

  # A waiter admitted without its store's word (the limiter stopped, or the store did not
  # answer its claim) leaves its booking where the process's next check could claim it
  # again: the process books under a new owner from then on. What it left behind lapses,
  # paid.
  defp forfeit_bookings do
    Process.put(@owner_key, {self(), System.unique_integer([:positive])})
    :ok
  end

  # Whether a waiter is still within its booking slack of the booking's ready time. A
  # connection's handle holds its limiter's slack; without one (a limiter on another node)
  # it is not.
  defp on_time?({_backend, %{booking_slack_ms: slack}, _events, _pid}, {_since, due})
       when is_integer(slack),
       do: System.monotonic_time(:millisecond) - due <= slack

  defp on_time?(_route, _slept), do: false

  # Whether a pause was noted through the limiter (of any key), or the limiter started,
  # since the waiter first asked: such a pause may hold the booking, and the bookings
  # behind it, past the ready time the waiter was told, which only the store knows.
  # Unknown (a limiter on another node) counts as paused.
  defp paused_since?(route, {since, _due}) do
    case Events.noted_at(sink(route)) do
      nil -> true
      noted_at -> noted_at >= since
    end
  end

  # Whether the store may have lost the booking since the waiter first asked: its daemon's
  # stream broke, or the daemon came back with a new table, which may already give others
  # the refill the booking paid for.
  defp lost_since?({backend, handle, _events, _pid}, {since, _due}) do
    case backend.store_lost_at(handle) do
      nil -> false
      lost_at -> lost_at >= since
    end
  end

  defp admitted_after_wait(route, since, metadata) do
    waited_ms = System.monotonic_time(:millisecond) - since
    Events.emit_to(sink(route), :admitted_after_wait, %{waited_ms: waited_ms}, metadata)
    :ok
  end

  # `{left, max_wait}`: the milliseconds a waiter may still wait (0 for none), and its
  # whole budget.
  defp budget_left(max_wait, nil), do: {max_wait, max_wait}

  defp budget_left(max_wait, since),
    do: {max(max_wait - (System.monotonic_time(:millisecond) - since), 0), max_wait}

  # The route of a waiter's next check: the name is looked up again, as a supervisor may
  # have restarted the limiter while the waiter slept, with the table (and the booking)
  # taken over, or, past the takeover, with a table of its own, which knows the pauses
  # recorded since. A local route holds its table itself: it is kept while no limiter runs
  # under the name.
  defp again({:remote, _pid}, name), do: Router.route(name)

  defp again(route, name) do
    case Router.route(name) do
      {_backend, _handle, _events, _pid} = current -> current
      _none -> route
    end
  end

  # What a check's answer means to its caller, with the event it calls for (never for
  # `:ok`): one place for probes and waiters (docs/CONTRACT.md §4, §8). A waiter's `{:delay, ms}` is
  # its own booking, not ready yet: past the budget it is `{:held, ms, budget}`, refused
  # by `failed/2` while the booking stays (an `:over_budget` refusal, as the store counts
  # it). `budget` is `nil` (a probe), the budget, or `{left, max_wait}` (a waiter's,
  # `budget_left/2`).
  defp observe(answer, route, {left, _max_wait} = budget, metadata) do
    case answer do
      {:delay, ms} when ms > left ->
        refused(route, ms, :over_budget, left, metadata)
        {:held, ms, budget}

      {:over_budget, ms} ->
        refused(route, ms, :over_budget, left, metadata)
        {:over_budget, ms}

      answer ->
        observe(answer, route, left, metadata)
    end
  end

  defp observe(answer, route, max_wait, metadata) do
    case answer do
      {:delay, ms} when max_wait == nil ->
        refused(route, ms, :delay, nil, metadata)
        {:delay, ms}

      {:delay, ms} when ms > max_wait ->
        refused(route, ms, :over_budget, max_wait, metadata)
        {:held, ms, max_wait}

      {:booked, ms} ->
        Events.emit_to(sink(route), :booked, %{delay_ms: ms}, metadata)
        {:delay, ms}

      {:over_budget, ms} ->
        refused(route, ms, :over_budget, max_wait, metadata)
        {:over_budget, ms}

      other ->
        other
    end
  end

  defp refused(route, ms, reason, max_wait, metadata) do
    Events.emit_to(sink(route), :refused, %{delay_ms: ms}, fn ->
      Map.merge(metadata.(), %{reason: reason, max_wait_ms: max_wait})
    end)
  end

  # Shapes an answer that is not a plain success: errors as `%Bourse.Error{}` carrying
  # the exchange of `source` (`{:key, key}`, `{:checks, checks}`, `{:exchange, id}`,
  # `{:target, pause_target}` or `nil`) when it can be read.
  defp failed({:held, ms, max_wait}, source),
    do: {:error, over_budget(ms, max_wait, exchange(source), several_exchanges(source))}

  defp failed({:error, message}, source) when is_binary(message),
    do: {:error, Error.with_exchange(Error.invalid(message), exchange(source))}

  defp failed({:error, %Error{} = error}, source),
    do: {:error, Error.with_exchange(error, exchange(source))}

  defp failed(answer, _source), do: answer

  # The message names the exchange, or the exchanges of a call's checks (`named`).
  defp over_budget(ms, budget, exchange, named \\ nil) do
    Error.rate_limited(ms,
      exchange: exchange,
      message: "#{named || exchange}#{if named || exchange, do: ": "}" <> refusal(ms, budget)
    )
  end

  # Why a waiter was refused: its wait exceeds its budget or, within it, a bucket of its
  # check already holds as many bookings as it queues (docs/CONTRACT.md §4).
  defp refusal(ms, budget) do
    if ms > left(budget),
      do: "waiting #{ms} ms exceeds " <> budget(budget),
      else:
        "waiters fill the queue of a bucket of this check; retry after #{ms} ms, within " <>
          budget(budget)
  end

  defp left({left, _max_wait}), do: left
  defp left(max_wait), do: max_wait

  # The exchanges of checks that name several, as a message lists them: the first three,
  # then how many more.
  defp several_exchanges({:checks, checks}) do
    case checks |> checks_exchanges() |> Enum.reject(&is_nil/1) |> Enum.split(3) do
      {[_, _ | _] = named, []} -> Enum.join(named, ", ")
      {named, [_ | _] = more} -> "#{Enum.join(named, ", ")} and #{length(more)} more"
      _one_or_none -> nil
    end
  end

  defp several_exchanges(_source), do: nil

  defp budget({max_wait, max_wait}), do: budget(max_wait)
  defp budget({0, max_wait}), do: "max_wait_ms #{max_wait}, already waited"
  defp budget({left, max_wait}), do: "the #{left} ms left of max_wait_ms #{max_wait}"
  defp budget(max_wait), do: "max_wait_ms #{max_wait}"

  # The exchange id an answer is about: `nil` when it cannot be read, or when the checks
  # of one call do not all name one exchange (an error about one check names its own).
  defp exchange({:checks, checks}) do
    case checks_exchanges(checks) do
      [exchange] -> exchange
      _none_several_or_unread -> nil
    end
  end

  defp exchange({:exchange, exchange}) when is_binary(exchange), do: exchange
  defp exchange({:target, exchange}) when is_binary(exchange), do: exchange
  defp exchange({:target, target}), do: exchange({:key, target})

  defp exchange({:key, key}) when is_tuple(key) and tuple_size(key) in 2..3,
    do: exchange({:exchange, elem(key, 0)})

  defp exchange(_source), do: nil

  # The exchanges the checks of one call name, each once, in order: `nil` for a check
  # whose exchange cannot be read, and for a malformed tail, which is not walked.
  defp checks_exchanges(checks),
    do: checks |> unprepared() |> checks_exchanges([], Bourse.Native.bound(:max_checks))

  defp checks_exchanges([], found, _left), do: found |> Enum.reverse() |> Enum.uniq()
  defp checks_exchanges(_longer, found, 0), do: checks_exchanges([], found, 0)

  defp checks_exchanges([{key, _limit, _cost} | rest], found, left),
    do: checks_exchanges(rest, [exchange({:key, key}) | found], left - 1)

  defp checks_exchanges(_malformed, found, left), do: checks_exchanges([], [nil | found], left)

  # Checks with every `{bucket, cost}` as `{key, limit, cost}`: the first `:max_checks` + 1
  # elements (a longer list is refused as it is), a malformed tail left as it is.
  defp unprepared(checks), do: unprepared(checks, Bourse.Native.bound(:max_checks) + 1)

  defp unprepared([{%Bucket{key: key, limit: limit}, cost} | rest], left) when left > 0,
    do: [{key, limit, cost} | unprepared(rest, left - 1)]

  defp unprepared([check | rest], left) when left > 0, do: [check | unprepared(rest, left - 1)]
  defp unprepared(rest, _left), do: rest

  ## Bookkeeping

  @doc """
  Tokens currently borrowed from the bucket: `capacity - tokens` after refill, larger
  than the capacity while in debt; `0` for an unknown key or a full bucket (any other
  amount is a float). `period` is ignored.
  """
  @spec get_cost(key(), term(), GenServer.name()) :: number() | error()
  def get_cost(key, _period, name \\ @default),
    do: name |> run(:get_cost, [key]) |> failed({:key, key}) |> nothing_as_zero()

  # Nothing borrowed is `0`, as the contract writes it for an unknown key; any other amount
  # is the float the store answered.
  defp nothing_as_zero(borrowed) when borrowed == 0, do: 0
  defp nothing_as_zero(answer), do: answer

  @doc """
  Debits `cost` without checking: usage spent elsewhere. The bucket may go into debt; on
  a key without a definition yet, the debt waits for the key's first check.
  """
  @spec record_request(key(), number(), GenServer.name()) :: :ok | error()
  def record_request(key, cost \\ 1, name \\ @default),
    do: name |> run(:record_request, [key, cost]) |> failed({:key, key})

  @doc "Forgets a key: it is as new, and its bookings are dropped."
  @spec reset(key(), GenServer.name()) :: :ok | error()
  def reset(key, name \\ @default), do: name |> run(:reset, [key]) |> failed({:key, key})

  @doc "Forgets every key of one exchange; other exchanges are untouched."
  @spec reset_exchange(String.t(), GenServer.name()) :: :ok | error()
  def reset_exchange(exchange_id, name \\ @default),
    do: name |> run(:reset_exchange, [exchange_id]) |> failed({:exchange, exchange_id})

  @doc "Forgets every key."
  @spec reset_all(GenServer.name()) :: :ok | error()
  def reset_all(name \\ @default), do: name |> run(:reset_all, []) |> failed(nil)

  @doc """
  Holds every bucket of `target` for `ms` milliseconds, for every caller at once: probes
  answer the remaining pause, waiters book behind it. `target` is a full key,
  `{exchange_id, credential_key}` (every axis of that credential) or an exchange id.
  Overlapping pauses keep the later end. A limiter's own table (NIF, port, daemon) holds
  at most 10,000 pauses of keys and credentials in force,
  past which a new one pauses its whole exchange, and as many of exchanges, past which a
  new exchange's pause pauses every exchange until it ends (only `reset_all/1` ends it
  sooner): a limited reply is never ignored. Ended pauses the sweep has not taken yet are
  taken out first. Redis keeps every pause.
  """
  @spec pause(pause_target(), non_neg_integer(), GenServer.name()) :: :ok | error()
  def pause(target, ms, name \\ @default) do
    route = Router.route(name)

    with :ok <- route |> routed(name, :pause, [target, ms]) |> failed({:target, target}) do
      Events.emit_to(sink(route), :paused, %{ms: ms}, fn -> Events.describe_target(target) end)
    end
  end

  ## Observing

  @doc """
  Counters since the limiter's bucket table was created (they survive a restart of the
  limiter's process; a port's daemon restarted after it died, or replaced for a limiter
  started with other options, has a new table, and counts from zero), and what it holds
  now. A limiter on a shared daemon, or on Redis, reads its daemon's counters: the
  answers to every client of that daemon.

    * `:admitted` – checks paid at once;
    * `:claimed` – waiters admitted against their booking;
    * `:delayed` – probes answered `{:delay, ms}`, and waiters that came back early or
      with none of their budget left (they ask as a probe does; their event says
      `:over_budget`);
    * `:booked` – waiters that booked their cost;
    * `:over_budget` – waiters refused because the wait exceeded `:max_wait_ms` (or a
      bucket's queue of bookings was full);
    * `:lapsed` – bookings not claimed in time (counted when next looked at: at the
      latest by the next sweep);
    * `:paused` – answers held back by a pause;
    * `:debited` – `record_request/3` calls;
    * `:invalid` – calls refused as malformed (`:invalid_parameters`); with the port,
      daemon and Redis backends, calls the daemon did not judge (it could not answer, or
      the request was larger than its frames) are refused by the caller and not counted;
    * `:event_failures` – `:on_event` callbacks that raised;
    * `:buckets`, `:bookings` – live buckets and bookings now.
  """
  @spec stats(GenServer.name()) :: %{atom() => non_neg_integer()} | error()
  def stats(name \\ @default) do
    case Router.route(name) do
      {backend, handle, events, _pid} -> Server.stats(backend, handle, events)
      elsewhere -> routed(elsewhere, name, :stats, [])
    end
    |> failed(nil)
  end

  @doc """
  The `count` (an integer from 1 to 10,000) busiest keys – most tokens borrowed, or holding
  bookings – busiest first. Each row has the fields of `inspect_key/2` and the key as
  `:exchange`, `:credential` (its fingerprint, `Bourse.Fingerprint.of/1`) and `:axis`.
  `mix bourse.top` prints them as a table.
  """
  @spec busiest(pos_integer(), GenServer.name()) :: [map()] | error()
  def busiest(count \\ 10, name \\ @default) do
    name |> run(:busiest, [count]) |> failed(nil)
  end

  ## Exchange feedback

  @doc """
  The one call an adapter makes after every response from `exchange_id` made with
  `credential_key`. `headers` are `{name, value}` pairs or a map of name to value or list
  of values; names are case-insensitive; names and values may be binaries or charlists
  (as `:httpc` returns them), a value also a number (a count or seconds, as a decoder may
  give it, read as its text; a count of more than 15 digits is beyond any limit and holds
  the bucket as the largest would); the values of headers it does not read are not judged.
  A repeated header is read the most cautious way (the largest count used, the smallest
  remaining, the longest `Retry-After`). Malformed headers are `:invalid_parameters` and
  sync nothing, but a limited reply is acted on all the same (the error then has its
  `http_status`, `retry_after` and `stop`).
  Options: `body:` the reply's body, a binary or the decoded JSON (map or list), for the
  rate-limit signals exchanges put there
  (`Bourse.RateLimiter.BodySignal`); `limits:` the credential's bucket definitions by
  axis (`%{"ip" => %{capacity: 480, refill_per_sec: 72}}`), which spares header sync a
  read of each definition from the table; `axis:` the axis of the reply's endpoint, which
  the per-endpoint headers (Bybit `X-Bapi-Limit*`, generic `x-ratelimit-*`) then sync
  instead of `"request"`; `ip:` the credential part of the buckets of the IP the reply
  came from, for keys that share it (`:public`): the headers that count the IP (Binance
  `x-mbx-used-weight-1m`, `x-sapi-used-ip-weight-1m`) then sync those (and `limits:`
  gives those axes' definitions for the IP's buckets), and a 429 whose body names no limit
  of the credential alone pauses those too. Like `check_rates/3`, the name may
  be left out before the options: `observe_response("bybit", key, 200, headers, body: body)`.

  Used-weight headers (Binance `x-mbx-used-weight-1m`, Bybit `x-bapi-limit*`, generic
  `x-ratelimit-*`, ...) bring the bucket of the matching axis in line with what the
  exchange counted, within the exchange's own limit for that counter. After a 429, or a
  rate-limit signal in the body (Bybit `retCode` 10006 on an HTTP 200, ...), every bucket
  of the credential is paused for every caller (after a 418, an IP ban, or an IP-wide
  signal: every bucket of the exchange), for `Retry-After`, the wait the reply names, or
  an exponential backoff, and the answer is
  `{:error, %Bourse.Error{type: :rate_limit_exceeded, http_status: status, retry_after: ms}}`,
  with `stop: true` when retrying is pointless. Otherwise `:ok`. The rules are in
  `Bourse.RateLimiter.Feedback`.
  """
  @spec observe_response(
          String.t(),
          String.t() | :public,
          100..599,
          Feedback.headers(),
          GenServer.name() | keyword(),
          keyword()
        ) ::
          :ok | error()
  def observe_response(
        exchange_id,
        credential_key,
        status,
        headers,
        name_or_opts \\ @default,
        opts \\ []
      )

  def observe_response(exchange_id, credential_key, status, headers, opts, []) when is_list(opts),
    do: Feedback.observe_response(exchange_id, credential_key, status, headers, @default, opts)

  def observe_response(exchange_id, credential_key, status, headers, name, opts),
    do: Feedback.observe_response(exchange_id, credential_key, status, headers, name, opts)

  @doc """
  Brings `key`'s bucket in line with an exchange that allows only `allowance` more cost
  until its window ends in `window_left_ms`: the tokens are lowered so that they plus the
  refill until then fit the allowance, less the bookings due by then (paid, but not yet
  sent, so not in the exchange's count); the bookings it cannot cover go out once the
  window ends. The tokens are never raised. A key without a definition
  is left alone. Returns the tokens taken. `observe_response/6` calls it for the headers
  it knows; call it directly for others.
  """
  @spec sync(key(), number(), non_neg_integer(), GenServer.name()) :: number() | error()
  def sync(key, allowance, window_left_ms, name \\ @default),
    do: name |> run(:sync, [key, allowance, window_left_ms]) |> failed({:key, key})

  @doc false
  # Counts a limited reply without a usable wait, for `{exchange_id, credential_key}` or
  # (scope `:exchange`) for the exchange, in the limiter's table and pauses `scope`
  # (`:credential` or `:exchange`) for the backoff (`Bourse.RateLimiter.Feedback`);
  # returns the pause in milliseconds.
  @spec back_off({String.t(), String.t() | :public}, :credential | :exchange, GenServer.name()) ::
          pos_integer() | error()
  def back_off(credential, scope, name) do
    route = Router.route(name)

    with ms when is_integer(ms) <-
           route |> routed(name, :back_off, [credential, scope]) |> failed({:key, credential}) do
      target = if scope == :exchange, do: elem(credential, 0), else: credential
      Events.emit_to(sink(route), :paused, %{ms: ms}, fn -> Events.describe_target(target) end)
      ms
    end
  end

  @doc false
  @spec reset_backoff({String.t(), String.t() | :public}, GenServer.name()) :: :ok | error()
  # Starts the backoff counts of the credential and of its exchange again (each unless its
  # backoff's pause holds).
  def reset_backoff(credential, name),
    do: name |> run(:reset_backoff, [credential]) |> failed({:key, credential})

  @doc """
  A snapshot of one key, or `nil` when the limiter holds nothing for it (never seen, or
  dropped by the sweep once full and idle, when it behaves as a new full bucket) and no
  pause covers it:

    * `:limit` – the bucket definition `%{capacity: c, refill_per_sec: r}`; `nil` for a
      key that only has `record_request/3` debt, or only a pause, or that only refused
      checks have seen (with `assume_busy_at_start`, the table keeps when a check first
      saw it: its bucket starts from then); its other fields are then zero;
    * `:tokens` – tokens now, negative while in debt;
    * `:borrowed` – what `get_cost/3` answers;
    * `:debt` – how far below zero the bucket is (or the pending debt of a key without a
      definition);
    * `:bookings`, `:booked_cost` – how many waiters' bookings the key holds, and their
      total cost;
    * `:next_ready_ms` – milliseconds until the earliest booking is ready (`nil` without
      bookings);
    * `:pause_ms` – milliseconds left of a pause covering the key (`nil` when none).
  """
  @spec inspect_key(key(), GenServer.name()) :: key_info() | nil | error()
  def inspect_key(key, name \\ @default), do: name |> run(:inspect, [key]) |> failed({:key, key})

  ## Supervision

  @doc """
  A child specification; the child id is the limiter's name. `opts` may be any term: one
  that is not a keyword list has the default name's id, and `start_link/1` refuses it.
  Supervisors print a child's start arguments in their reports (a child that fails to
  start, for one): options that may hold a password (a Redis URL with a user or a query,
  a backend of another shape) are passed to `start_link/1` in a function instead, which
  reports show as such.
  """
  @spec child_spec(term()) :: Supervisor.child_spec()
  def child_spec(opts) do
    id = if Keyword.keyword?(opts), do: Keyword.get(opts, :name, @default), else: @default

    if Options.may_hold_password?(opts),
      do: %{id: id, start: {__MODULE__, :start_hidden, [fn -> opts end]}},
      else: %{id: id, start: {__MODULE__, :start_link, [opts]}}
  end

  @doc false
  # `start_link/1` of the options `child_spec/1` hid in a function.
  @spec start_hidden((() -> keyword())) :: GenServer.on_start() | error()
  def start_hidden(opts), do: start_link(opts.())

  @doc """
  Starts a limiter.

  Options:

    * `:name` – a `GenServer.name()`, default `Bourse.RateLimiter`;
    * `:backend` – where the buckets live:
      * `:nif` (default) – in this VM, behind a NIF;
      * `:port` – in a `bourse_daemon` process run as an Erlang port
        (`Bourse.RateLimiter.Backend.Port`);
      * `{:daemon, address}` or `{:daemon, address, opts}` – in a `bourse_daemon` server
        shared with other OS processes and programs, at `"127.0.0.1:PORT"` or
        `{:unix, path}` (`Bourse.RateLimiter.Backend.Daemon`);
      * `{:redis, url}` or `{:redis, url, opts}` – in Redis, shared by limiters on every
        machine using that server; `{:redis, [url, ...]}` (seed nodes) in a Redis Cluster
        (`Bourse.RateLimiter.Backend.Redis`);
    * `:assume_busy_at_start` – buckets first seen within their fill time after start
      begin as if they had been empty at start (default `false`); on a shared daemon or
      Redis, buckets new to the store, from the limiter's start or the store's own if later
      (the daemon's `--assume-busy-at-start`, the start of the exchange's state in Redis);
    * `:booking_slack_ms` – how long a booking may be claimed after its ready time, 0 to
      86_400_000 ms (default `Bourse.Defaults.booking_slack_ms/0`); keep it above the
      waiters' scheduling delay, or they find their bookings lapsed (and paid) when they
      wake;
    * `:sweep_interval_ms` – how often full idle buckets are dropped, 1 to 86_400_000
      ms (default 1000); on the NIF and the port (a shared daemon sweeps on its own
      `--sweep-interval-ms`, Redis by TTL);
    * `:on_event` – a function `fn event, measurements, metadata -> ... end` or
      `{module, function, extra_args}` called with every event the limiter emits (see
      `Bourse.RateLimiter.Events`).

  Any other option is refused, naming it. Every failure to start is
  `{:error, %Bourse.Error{}}` (`:invalid_parameters` for the options), but for
  `{:error, {:already_started, pid}}` when a limiter already runs under the name.

  The bucket table outlives the limiter's process: a limiter started under the same name
  within 5 s (its supervisor's restart, after a crash or with its siblings) re-attaches to
  it, so spent tokens stay spent and pauses stay. A NIF table taken over keeps the
  `:booking_slack_ms` it was made with; a port whose daemon's command line the new
  options change starts a new daemon, which assumes every bucket busy and is asked for
  the pauses the previous one held. A limiter of another backend started within those
  5 s begins with a table of its own that assumes every bucket busy; the previous table's
  pauses do not reach it. Once the process has ended, calls exit with `:noproc`, as for a
  limiter never started; 5 s later the table is dropped, and a limiter started under
  that name then begins with a new one.
  """
  @spec start_link(keyword()) :: GenServer.on_start() | error()
  def start_link(opts \\ []) do
    with {:ok, config} <- Options.start(opts), do: Server.start_link(config)
  end

  ## Routing: local names reach the table from the caller's process, others go through
  ## the limiter's process.

  defp run(name, fun, args), do: name |> Router.route() |> routed(name, fun, args)

  # Pauses are noted on the limiter's node, whoever asked (`Events.note_pause/1`), also
  # when the store may have recorded them without answering.
  defp routed({backend, handle, events, _pid}, _name, fun, args)
       when fun in [:pause, :back_off] do
    answer = apply(backend, fun, [handle | args])
    if paused?(answer), do: Events.note_pause(events)
    answer
  end

  defp routed({backend, handle, _events, _pid}, _name, fun, args),
    do: apply(backend, fun, [handle | args])

  defp routed({:remote, pid}, name, fun, args), do: Router.run(pid, fun, args, name || pid)
  defp routed(:noproc, name, fun, args), do: absent(:noproc, name, fun, args)
  defp routed({:exit, reason}, name, fun, args), do: absent(reason, name, fun, args)
  defp routed({:invalid, message}, _name, _fun, _args), do: {:error, message}

  # No limiter answers: malformed input is still answered as such (judged by the NIF on a
  # scratch table thrown away after), anything else exits as `GenServer.call/2` would. The
  # NIF backend may not be loaded yet (interactive code loading, no NIF limiter started).
  defp absent(reason, name, fun, args) do
    judged =
      if Code.ensure_loaded?(Backend.NIF) and
           function_exported?(Backend.NIF, fun, length(args) + 1),
         do: apply(Backend.NIF, fun, [Bourse.Native.new_table(false, 0) | args])

    case judged do
      {:error, %Error{type: :invalid_parameters}} = invalid -> invalid
      _ -> Router.exit_as_call(reason, name)
    end
  end

  @doc false
  # A call of `fun` for the limiter `pid` of this node, run for a caller on another node
  # (`Router.run/4`).
  @spec run_here(pid(), atom(), list()) :: term()
  def run_here(pid, :stats, []), do: stats(pid)
  def run_here(pid, fun, args), do: pid |> Router.route() |> routed(pid, fun, args)

  @doc false
  # Runs `fun` on the limiter published as `entry`, from its own process.
  def run_entry(entry, fun, args), do: routed(entry, nil, fun, args)

  # A pause taken, or maybe taken (its store did not answer); not one refused.
  defp paused?({:error, %Error{type: :unavailable}}), do: true
  defp paused?({:error, _refused}), do: false
  defp paused?(_taken), do: true

  # Where the events of a routed call go.
  defp sink({_backend, _handle, events, _pid}), do: events
  defp sink({:remote, pid}), do: {:remote, pid}
  defp sink(_), do: nil

  defp options(opts, default, route, source) do
    with {:error, _} = error <- Options.max_wait(opts, default) do
      count_invalid(route)
      failed(error, source)
    end
  end

  defp count_invalid(route), do: route |> sink() |> Events.count_invalid()
end
