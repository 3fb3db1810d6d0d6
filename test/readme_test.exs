defmodule Bourse.ReadmeTest do
  use ExUnit.Case, async: false

  @readme Path.expand("../README.md", __DIR__)
  @external_resource @readme

  defp elixir_blocks(section) do
    [_, text] = String.split(File.read!(@readme), "\n## #{section}\n", parts: 2)
    [text | _] = String.split(text, "\n## ", parts: 2)
    Regex.scan(~r/```elixir\n(.*?)```/s, text, capture: :all_but_first) |> List.flatten()
  end

  test "the usage example runs as written" do
    [usage | _] = elixir_blocks("Usage")
    {_, _binding} = Code.eval_string(usage)
  end

  test "the sizing example runs as written" do
    [sizing | _] = elixir_blocks("Sizing buckets from an exchange's published limit")
    {_, binding} = Code.eval_string(sizing)
    assert map_size(binding[:buckets]) == 3
  end

  test "the adapter loop example compiles" do
    [adapter | _] = elixir_blocks("Exchange feedback")
    assert [{MyApp.Binance, _}] = Code.compile_string(adapter)
  end
end
