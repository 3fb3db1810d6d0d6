defmodule Bourse.OsSignal do
  @moduledoc """
  Signals to the OS processes tests run (`bourse_daemon`, `redis-server`).
  """

  import ExUnit.Assertions

  @doc """
  Sends `signal` (`"TERM"`, `"KILL"`, `"STOP"`, `"CONT"`, ...) to `os_pid`. After
  `"STOP"` it returns once every thread of the process is stopped: `kill` returns before
  that (one thread takes the signal and stops the others when it next runs, which on a
  loaded machine may be milliseconds later), and a thread still running answers what it
  is sent meanwhile.
  """
  @spec send(pos_integer(), String.t()) :: :ok
  def send(os_pid, signal) do
    {_, 0} = System.cmd("kill", ["-#{signal}", Integer.to_string(os_pid)])
    if signal == "STOP", do: wait_stopped(os_pid, 1_000)
    :ok
  end

  defp wait_stopped(os_pid, tries) do
    states = thread_states(os_pid)

    cond do
      states != [] and Enum.all?(states, &(&1 == "T")) ->
        :ok

      tries == 0 ->
        flunk("process #{os_pid} did not stop: its threads are #{inspect(states)}")

      true ->
        Process.sleep(10)
        wait_stopped(os_pid, tries - 1)
    end
  end

  # The state letter of each thread (`/proc/PID/task/TID/stat`, after the command name in
  # parentheses).
  defp thread_states(os_pid) do
    case File.ls("/proc/#{os_pid}/task") do
      {:ok, tasks} ->
        for task <- tasks,
            {:ok, stat} <- [File.read("/proc/#{os_pid}/task/#{task}/stat")],
            [_, state] <- [Regex.run(~r/\) (\S) /, stat)],
            do: state

      {:error, _} ->
        []
    end
  end
end
