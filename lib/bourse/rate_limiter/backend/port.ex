defmodule Bourse.RateLimiter.Backend.Port do
  @moduledoc """
  `backend: :port`: the bucket table lives in a `bourse_daemon --stdio` process that the
  limiter runs as an Erlang port. The port is the daemon's life (its exit status, its end
  with the VM); its requests and answers go over a Unix socket of its own
  (`--stdio-socket`, in a directory only this OS user may enter): 4-byte length-prefixed
  frames of external terms (`Bourse.RateLimiter.Backend.Protocol`). A crash in native code
  there cannot take the VM down.

  The port and its socket are owned by a `Bourse.RateLimiter.Backend.Connection` process
  linked to the limiter. Callers encode their checks in their own process; a caller alone
  in flight writes to the socket and reads its own answer, others are pipelined by the
  connection, which sends each answer to its caller. Each calling process owns its own
  bookings.

  If the daemon dies (even `kill -9`), callers in flight get
  `{:error, %Bourse.Error{type: :unavailable}}` at once and the daemon is restarted with
  `--assume-busy-at-start`, so the new table admits no more than a fresh limiter that
  assumed every bucket busy at start (docs/CONTRACT.md, P6). When the limiter process ends
  (a crash, or a stop, as when its supervisor restarts it with its siblings), the port
  lives on for 5 s, and a limiter started under that name meanwhile takes it over: spent
  tokens stay spent and pauses stay. A limiter started within 5 s of the end of one of
  the same name whose port is gone (its daemon died, or the new limiter's options change
  the daemon's command line) starts its daemon with `--assume-busy-at-start` too: the
  exchange may still count what the previous one spent.

  The limiter's `:assume_busy_at_start`, `:booking_slack_ms` and `:sweep_interval_ms`
  become the daemon's command-line options.
  """

  use Bourse.RateLimiter.Backend.Protocol

  alias Bourse.RateLimiter.Backend.Connection

  # Every request the limiter accepts fits (1024 checks of long, escaped keys).
  @max_frame_bytes 64 * 1024 * 1024
  @timeout 5_000

  @impl true
  def options([]), do: {:ok, []}
  def options(args), do: {:error, "backend :port takes no arguments, got #{length(args)}"}

  @impl true
  def attach(previous, opts), do: run_daemon(previous, [], opts)

  @doc """
  Runs `bourse_daemon --stdio` with `daemon_args` and the limiter's options (`opts`, as
  given to `c:Bourse.RateLimiter.Backend.attach/2`) as the connection's port. Callers wait
  #{@timeout} ms for an answer, or `opts[:timeout]` ms if that is longer.
  """
  @spec run_daemon(term(), [String.t()], keyword()) :: {:ok, term()} | {:error, term()}
  def run_daemon(previous, daemon_args, opts) do
    executable = executable()

    if File.exists?(executable) do
      args =
        ["--stdio" | daemon_args] ++
          [
            "--booking-slack-ms",
            Integer.to_string(opts[:booking_slack_ms]),
            "--sweep-interval-ms",
            Integer.to_string(opts[:sweep_interval_ms]),
            "--max-frame-bytes",
            Integer.to_string(@max_frame_bytes)
          ]

      Connection.attach(previous, {:port, executable, args},
        timeout: max(@timeout, Keyword.get(opts, :timeout, 0)),
        assume_busy_at_start: opts[:assume_busy_at_start],
        table_outlives_daemon: Keyword.get(opts, :table_outlives_daemon, false),
        booking_slack_ms: opts[:booking_slack_ms],
        env: Keyword.get(opts, :env, [])
      )
    else
      {:error,
       "bourse_daemon not found at #{executable}: `mix compile` builds it into :bourse's " <>
         "priv/native, and `mix release` copies it from there"}
    end
  end

  @doc "The path of the `bourse_daemon` binary in `:bourse`'s `priv/native`."
  @spec executable() :: Path.t()
  def executable do
    case :code.priv_dir(:bourse) do
      {:error, _} -> Path.expand("priv/native/bourse_daemon")
      dir -> Path.join(List.to_string(dir), "native/bourse_daemon")
    end
  end
end
