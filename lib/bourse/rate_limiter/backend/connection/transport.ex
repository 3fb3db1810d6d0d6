defmodule Bourse.RateLimiter.Backend.Connection.Transport do
  @moduledoc false
  # One kind of stream to a bourse_daemon, for `Bourse.RateLimiter.Backend.Connection`:
  # opening it (with the hello), writing requests, reading answers, closing. Every stream
  # frames them as a port does (`Bourse.RateLimiter.Backend.Connection.PortStream.frame/2`).
  # `Bourse.RateLimiter.Backend.Connection.PortStream` is a `--stdio` port,
  # `Bourse.RateLimiter.Backend.Connection.SocketStream` a TCP or Unix socket.

  @typedoc "An open stream."
  @type stream :: port() | Bourse.RateLimiter.Backend.Connection.SocketStream.t()

  @typedoc """
  What `open/2` may use: the port's flags and environment, a socket's secret, and the
  limiter's busy start (monotonic µs) that the hello names, if it assumes one.
  """
  @type settings :: %{
          assume_busy: boolean(),
          busy_start: integer() | nil,
          env: [{charlist(), charlist()}],
          secret: String.t() | nil,
          timeout: pos_integer()
        }

  @typedoc """
  Why a stream did not open: `{:refused, message}`, a port's daemon refused its flags;
  `{:misconfigured, message}`, a daemon refused this client's configuration (its secret).
  """
  @type failure :: String.t() | {:refused, String.t()} | {:misconfigured, String.t()}

  @doc "Opens the stream to `target` and says hello; the daemon's hello answer."
  @callback open(target :: term(), settings()) :: {:ok, stream(), map()} | {:error, failure()}

  @doc """
  Writes `count` requests for the connection process (they are counted once written):
  `:busy` when the daemon is behind with its input, `:wait` while a caller writes,
  `{:partial, rest}` when only a part was written (`rest` goes first next time).
  """
  @callback write_nowait(stream(), :ets.tid(), iodata(), pos_integer()) ::
              :ok | :busy | :wait | {:partial, binary()} | {:error, term()}

  @doc "The connection process takes over a caller's frame that the stream took in part."
  @callback unsent(stream()) :: :ok

  @doc "After the connection process wrote requests, or was told to read: someone reads."
  @callback read_for(stream(), :ets.tid()) :: :ok

  @doc """
  `count` requests were answered; `partial` is what is left of an answer begun. An error
  breaks the stream.
  """
  @callback settled(stream(), non_neg_integer(), partial :: term()) :: :ok | {:error, String.t()}

  @callback close(stream()) :: :ok

  @doc "What a message to the connection process means for `stream`."
  @callback received(message :: term(), stream()) ::
              {:data, binary()} | {:down, String.t()} | :other

  @doc "What is left of an answer not complete yet, before any data."
  @callback no_partial() :: term()

  @doc """
  The complete answers in `partial` and `data`, and what is left; or the complete answers
  and why the rest cannot be an answer (the stream is then broken).
  """
  @callback answers(partial :: term(), data :: binary()) ::
              {[binary()], term()} | {:error, [binary()], String.t()}

  @doc "Whether a broken stream is reopened at once (a port) or after a backoff."
  @callback reopen() :: :at_once | :after_backoff

  @doc "Whether the limiter may start while the stream cannot be opened."
  @callback start_without_it?() :: boolean()

  @callback describe(target :: term()) :: String.t()
end
