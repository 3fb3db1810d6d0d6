defmodule Demo.Client do
  @moduledoc """
  An exchange client as the demo runs it: every request waits for its bucket through
  `Bourse.RateLimiter.wait_for_capacity/4`, then goes to the mock exchange.
  """

  alias Bourse.RateLimiter
  alias Bourse.RateLimiter.RetryAfter
  alias Bourse.Testing.HTTP

  @typedoc "Where the client's bucket is: the limiter's name, the key and its limit."
  @type bucket :: %{limiter: GenServer.name(), key: RateLimiter.key(), limit: map()}

  @doc """
  Sends `count` requests to `url` through `bucket` and returns how many 429s came back.

  With `retries: n` (default 0) a 429 pauses the bucket for the reply's `Retry-After`
  (`Bourse.RateLimiter.pause/3`, so every user of the bucket holds back) and the request
  is sent again, at most `n` more times, as the field report's `call` does (docs/CONTRACT.md).
  """
  @spec send_requests(String.t(), bucket(), pos_integer(), keyword()) :: non_neg_integer()
  def send_requests(url, bucket, count, opts \\ []) do
    retries = Keyword.get(opts, :retries, 0)
    Enum.reduce(1..count, 0, fn _, rejected -> rejected + send_request(url, bucket, retries) end)
  end

  defp send_request(url, bucket, retries) do
    :ok = RateLimiter.wait_for_capacity(bucket.key, bucket.limit, 1, bucket.limiter)
    {:ok, status, headers, _body} = HTTP.get(url)

    cond do
      status == 200 ->
        0

      status == 429 and retries > 0 ->
        {:ok, ms} = headers |> List.keyfind("retry-after", 0) |> elem(1) |> RetryAfter.parse()
        :ok = RateLimiter.pause(bucket.key, ms, bucket.limiter)
        1 + send_request(url, bucket, retries - 1)

      status == 429 ->
        1
    end
  end

  @doc """
  Sleeps until just after the next whole second of `System.os_time/1`, where the mock
  exchange's fixed windows begin.
  """
  @spec sleep_until_window_start() :: :ok
  def sleep_until_window_start do
    Process.sleep(1000 - rem(System.os_time(:millisecond), 1000) + 2)
  end

  @doc "Runs `fun`, returning its result and the wall time it took in milliseconds."
  @spec timed((() -> result)) :: {result, float()} when result: term()
  def timed(fun) do
    {microseconds, result} = :timer.tc(fun)
    {result, microseconds / 1000}
  end
end
