defmodule Bourse.ReadmeTest do
  # The examples register global names (MyApp.Limiter) and define modules.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  @readme Path.expand("../README.md", __DIR__)
  @external_resource @readme

  # Every ```elixir block of the README, with the section it is in.
  @blocks (for section <- String.split(File.read!(@readme), ~r/^## /m),
               [_, code] <- Regex.scan(~r/^```elixir\n(.*?)^```/ms, section) do
             {section |> String.split("\n", parts: 2) |> hd(), code}
           end)

  # Each example is written for a VM of its own: forget what earlier ones left in the
  # MyApp.Limiter table (a limiter started again under a name adopts its table).
  setup do
    {:ok, pid} = Bourse.RateLimiter.start_link(name: MyApp.Limiter)
    :ok = Bourse.RateLimiter.reset_all(MyApp.Limiter)
    GenServer.stop(pid)

    # What an example started goes down with its test process; wait for it.
    on_exit(fn ->
      with pid when is_pid(pid) <- Process.whereis(MyApp.Limiter) do
        ref = Process.monitor(pid)
        assert_receive {:DOWN, ^ref, _, _, _}, 5_000
      end
    end)
  end

  test "the examples are found in their sections" do
    sections = @blocks |> Enum.map(&elem(&1, 0)) |> Enum.uniq()

    for section <- ["Usage", "Exchange feedback", "Observability"],
        do: assert(section in sections)
  end

  for {{section, code}, index} <- Enum.with_index(@blocks, 1) do
    @code code
    test "example #{index} (#{section}) runs as written" do
      capture_log(fn -> Code.eval_string(@code, [], file: "README.md") end)
    end
  end

  test "the sizing example's buckets are what its comment says" do
    {_, code} = Enum.find(@blocks, &(elem(&1, 0) =~ "Sizing"))
    {_, binding} = Code.eval_string(code)
    [comment] = Regex.run(~r/^# (%\{.*?\})$/ms, code, capture: :all_but_first)
    {expected, _} = comment |> String.replace(~r/^#\s*/m, "") |> Code.eval_string()
    assert binding[:buckets] == expected
  end
end
