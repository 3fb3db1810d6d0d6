defmodule Bourse.DocsReferencesTest do
  # The contract and its sources are in docs/CONTRACT.md: no file cites a document that is
  # not in the repository, and a file speaking of the field report says where it is from.
  use ExUnit.Case, async: true

  @root Path.expand("..", __DIR__)
  @globs ~w(README.md Makefile mix.exs docs/**/*.md lib/**/*.ex test/**/*.{ex,exs} demo/**/*.{ex,exs}
            bench/**/*.{ex,exs} native/**/*.{rs,toml,lua} clients/**/*.py)

  defp files do
    @globs
    |> Enum.flat_map(&Path.wildcard(Path.join(@root, &1)))
    |> Enum.reject(&(&1 =~ ~r{/(target|_build)/} or &1 == __ENV__.file))
    |> Enum.uniq()
  end

  test "no file cites SPEC, the seed report or the seed interface" do
    offenders =
      for file <- files(),
          {line, number} <- Enum.with_index(String.split(File.read!(file), "\n"), 1),
          line =~ ~r/\bSPEC\b|seed report|seed interface/,
          do: "#{Path.relative_to(file, @root)}:#{number}: #{String.trim(line)}"

    assert offenders == []
  end

  test "a file speaking of the field report points to docs/CONTRACT.md or names it" do
    offenders =
      for file <- files(),
          text = File.read!(file),
          text =~ ~r/field report/i,
          not (text =~ "CONTRACT.md" or text =~ "Fincode"),
          do: Path.relative_to(file, @root)

    assert offenders == []
  end
end
