defmodule Bourse.Defaults do
  @moduledoc """
  Defaults of `:bourse`, each overridable in the application environment:

      # config/config.exs
      config :bourse,
        rate_limit_max_wait_ms: 30_000,
        booking_slack_ms: 250

  | key | default | meaning |
  | --- | --- | --- |
  | `:rate_limit_max_wait_ms` | `30_000` | longest wait `wait_for_capacity` accepts before it answers `:rate_limit_exceeded`: a positive integer of at most `4_294_967_295` (what `Process.sleep/1` accepts), as the `:max_wait_ms` option |
  | `:booking_slack_ms` | `250` | how long after its ready time a booking waits to be claimed before it lapses |
  """

  @doc """
  The longest wait, in ms, `Bourse.RateLimiter.wait_for_capacity/5` accepts when the caller
  gives no `:max_wait_ms`: `config :bourse, rate_limit_max_wait_ms: ms`, default `30_000`.
  A value that is not an integer from 1 to `4_294_967_295` makes those calls answer
  `:invalid_parameters`; it is returned as configured, checked where it is used.
  """
  @spec rate_limit_max_wait_ms() :: term()
  def rate_limit_max_wait_ms, do: Application.get_env(:bourse, :rate_limit_max_wait_ms, 30_000)

  @doc """
  How long, in ms, a booking stays claimable after its ready time:
  `config :bourse, booking_slack_ms: ms`, default `250`. It is returned as configured: a
  limiter started with a value that is not an integer from 0 to one day is refused with
  `:invalid_parameters`.
  """
  @spec booking_slack_ms() :: term()
  def booking_slack_ms,
    do:
      Application.get_env(
        :bourse,
        :booking_slack_ms,
        Bourse.Native.bound(:default_booking_slack_ms)
      )
end
