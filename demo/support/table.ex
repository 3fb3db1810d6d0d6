defmodule Demo.Table do
  @moduledoc "Prints rows as a Markdown table with aligned columns, and formats numbers for it."

  @doc "Prints `rows` (lists of cells of any type) under `headers`."
  @spec print([String.t()], [[term()]]) :: :ok
  def print(headers, rows) do
    cells = Enum.map([headers | rows], fn row -> Enum.map(row, &to_string/1) end)

    widths =
      cells
      |> Enum.zip_with(fn column -> column |> Enum.map(&String.length/1) |> Enum.max() end)

    [header | body] = Enum.map(cells, &line(&1, widths))
    rule = line(Enum.map(widths, &String.duplicate("-", &1)), widths)
    IO.puts(Enum.join([header, rule | body], "\n"))
  end

  defp line(cells, widths) do
    padded = Enum.zip_with(cells, widths, &String.pad_trailing/2)
    "| " <> Enum.join(padded, " | ") <> " |"
  end

  @doc "A number as a reader writes it: `480`, `7.2`, `1.66667` (at most 5 decimals)."
  @spec number(number()) :: String.t()
  def number(x) when is_integer(x), do: Integer.to_string(x)

  def number(x) when is_float(x) do
    rounded = Float.round(x, 5)
    if rounded == trunc(rounded), do: Integer.to_string(trunc(rounded)), else: "#{rounded}"
  end

  @doc "Milliseconds as seconds with one decimal: `5.4 s`."
  @spec seconds(number()) :: String.t()
  def seconds(ms), do: :erlang.float_to_binary(ms / 1000, decimals: 1) <> " s"
end
