defmodule Bourse.FailureSummary do
  @moduledoc """
  An ExUnit formatter that repeats every failure once the suite is done, after the
  printouts of the tests that ran since, so that the end of a long run's output names
  what failed.
  """

  use GenServer

  @impl true
  def init(opts), do: {:ok, %{opts: opts, failures: []}}

  @impl true
  def handle_cast({:test_finished, %ExUnit.Test{state: {kind, failures}} = test}, state)
      when kind in [:failed, :invalid] do
    {:noreply, %{state | failures: [{test, failures} | state.failures]}}
  end

  def handle_cast({:suite_finished, _times}, %{failures: [_ | _]} = state) do
    IO.puts("\nFailures of this run, again:")

    state.failures
    |> Enum.reverse()
    |> Enum.with_index(1)
    |> Enum.each(fn {{test, failures}, n} ->
      IO.puts(format(test, failures, n, state.opts))
    end)

    {:noreply, state}
  end

  def handle_cast(_event, state), do: {:noreply, state}

  defp format(test, failures, n, opts) when is_list(failures) do
    formatter = fn _key, text -> text end
    ExUnit.Formatter.format_test_failure(test, failures, n, opts[:width] || 80, formatter)
  end

  defp format(test, _invalid, n, _opts),
    do: "  #{n}) #{test.name} (#{inspect(test.module)}): invalid (its setup_all failed)"
end
