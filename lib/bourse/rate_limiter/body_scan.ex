defmodule Bourse.RateLimiter.BodyScan do
  @moduledoc """
  The top-level fields of the JSON object a reply body starts with, read without a JSON
  library (`:bourse` depends on none at run time), for the rate-limit signals
  `Bourse.RateLimiter.Feedback` looks for.

  It reads at most the first 16,384 bytes and 8 levels of nesting (the top-level object
  included), and stops at the first thing it cannot read, keeping the fields read before
  it: exchanges put their error code first (`{"retCode":10006,...}`, `{"code":"50011",...}`,
  `{"error":["EAPI:Rate limit exceeded"],...}`), so a long or truncated body still shows
  it. Anything else (HTML, a JSON array, a number, garbage, deeper nesting) gives the
  fields read so far, often `%{}`. Its time is linear in the bytes read; it never
  raises.

      BodyScan.fields(~s({"retCode":10006,"retMsg":"Too many visits!","result":{}}))
      #=> %{"retCode" => 10006, "retMsg" => "Too many visits!", "result" => %{}}

  Values: objects are maps (the first of duplicate keys wins), arrays lists, strings
  binaries (escapes decoded; the `\\u` escapes of surrogate halves, characters outside
  the Basic Multilingual Plane, become U+FFFD), integers of at most 32 characters integers, other numbers their text,
  `true`, `false` and `nil`.
  """

  @max_bytes 16_384
  @max_depth 8
  @max_number 32

  @doc """
  The top-level fields of `body`'s leading JSON object; see the module documentation.
  With a list of `wanted` keys, only those are read: the values of other keys are passed
  over without being built, and the scan stops once every wanted key is found.
  """
  @spec fields(binary(), [String.t()] | :all) :: map()
  def fields(body, wanted \\ :all) when is_binary(body) do
    case skip(binary_part(body, 0, min(byte_size(body), @max_bytes))) do
      <<"{", rest::binary>> -> members(rest, wanted, %{})
      _not_an_object -> %{}
    end
  end

  # The top level keeps what it read when it meets something it cannot.
  defp members(text, wanted, fields) do
    with <<"\"", rest::binary>> <- skip(text),
         {:ok, key, rest} <- string(rest, []),
         <<":", rest::binary>> <- skip(rest),
         {:ok, fields, rest} <- field(key, skip(rest), wanted, fields) do
      case skip(rest) do
        _done when wanted != :all and map_size(fields) == length(wanted) -> fields
        <<",", rest::binary>> -> members(rest, wanted, fields)
        _end_or_garbage -> fields
      end
    else
      _ -> fields
    end
  end

  defp field(key, text, wanted, fields) do
    if (wanted == :all or key in wanted) and not Map.has_key?(fields, key) do
      with {:ok, value, rest} <- value(text, 1), do: {:ok, Map.put(fields, key, value), rest}
    else
      with {:ok, rest} <- pass(text), do: {:ok, fields, rest}
    end
  end

  defp member(text, depth) do
    with <<"\"", rest::binary>> <- skip(text),
         {:ok, key, rest} <- string(rest, []),
         <<":", rest::binary>> <- skip(rest),
         {:ok, value, rest} <- value(skip(rest), depth) do
      {:ok, key, value, rest}
    else
      _ -> :error
    end
  end

  defp value(<<"\"", rest::binary>>, _depth), do: string(rest, [])
  defp value(<<"{", _::binary>>, depth) when depth >= @max_depth, do: :error
  defp value(<<"[", _::binary>>, depth) when depth >= @max_depth, do: :error
  defp value(<<"{", rest::binary>>, depth), do: object(skip(rest), depth + 1, %{})
  defp value(<<"[", rest::binary>>, depth), do: array(skip(rest), depth + 1, [])
  defp value(<<"true", rest::binary>>, _depth), do: {:ok, true, rest}
  defp value(<<"false", rest::binary>>, _depth), do: {:ok, false, rest}
  defp value(<<"null", rest::binary>>, _depth), do: {:ok, nil, rest}
  defp value(<<c, _::binary>> = text, _depth) when c == ?- or c in ?0..?9, do: number(text)
  defp value(_text, _depth), do: :error

  defp object(<<"}", rest::binary>>, _depth, map) when map == %{}, do: {:ok, map, rest}

  defp object(text, depth, map) do
    with {:ok, key, value, rest} <- member(text, depth) do
      map = Map.put_new(map, key, value)

      case skip(rest) do
        <<",", rest::binary>> -> object(rest, depth, map)
        <<"}", rest::binary>> -> {:ok, map, rest}
        _ -> :error
      end
    end
  end

  defp array(<<"]", rest::binary>>, _depth, []), do: {:ok, [], rest}

  defp array(text, depth, items) do
    with {:ok, item, rest} <- value(skip(text), depth) do
      case skip(rest) do
        <<",", rest::binary>> -> array(rest, depth, [item | items])
        <<"]", rest::binary>> -> {:ok, Enum.reverse([item | items]), rest}
        _ -> :error
      end
    end
  end

  # Up to the closing quote; `acc` holds the pieces read, in reverse, `at` the bytes of
  # the current piece.
  defp string(text, acc), do: string(text, 0, acc)

  defp string(text, at, acc) do
    case text do
      <<chunk::binary-size(at), ?\", rest::binary>> ->
        {:ok, [chunk | acc] |> Enum.reverse() |> IO.iodata_to_binary(), rest}

      <<chunk::binary-size(at), ?\\, rest::binary>> ->
        escape(rest, [chunk | acc])

      <<_::binary-size(at), _, _::binary>> ->
        string(text, at + 1, acc)

      _cut ->
        :error
    end
  end

  @hex Enum.concat([?0..?9, ?a..?f, ?A..?F])

  @escapes %{
    ?" => "\"",
    ?\\ => "\\",
    ?/ => "/",
    ?b => "\b",
    ?f => "\f",
    ?n => "\n",
    ?r => "\r",
    ?t => "\t"
  }

  # A \u escape is four hex digits, no sign (`Integer.parse/2` would take "-041").
  defp escape(<<"u", a, b, c, d, rest::binary>>, acc)
       when a in @hex and b in @hex and c in @hex and d in @hex do
    case String.to_integer(<<a, b, c, d>>, 16) do
      code when code in 0xD800..0xDFFF -> string(rest, ["\uFFFD" | acc])
      code -> string(rest, [<<code::utf8>> | acc])
    end
  end

  defp escape(<<"u", _::binary>>, _acc), do: :error

  defp escape(<<c, rest::binary>>, acc) do
    case @escapes do
      %{^c => char} -> string(rest, [char | acc])
      _ -> :error
    end
  end

  defp escape(<<>>, _acc), do: :error

  defp number(text) do
    size = number_size(text, 0)
    <<digits::binary-size(size), rest::binary>> = text

    cond do
      size > @max_number -> {:ok, digits, rest}
      Regex.match?(~r/\A-?\d+\z/, digits) -> {:ok, String.to_integer(digits), rest}
      true -> {:ok, digits, rest}
    end
  end

  defp number_size(<<c, rest::binary>>, size) when c in ?0..?9 or c in [?-, ?+, ?., ?e, ?E],
    do: number_size(rest, size + 1)

  defp number_size(_rest, size), do: size

  # Over a value without building it.
  defp pass(<<"\"", rest::binary>>), do: pass_string(rest)
  defp pass(<<c, rest::binary>>) when c in [?{, ?[], do: pass_nested(rest, 1)

  defp pass(text) do
    case scalar_size(text, 0) do
      0 -> :error
      size -> {:ok, binary_part(text, size, byte_size(text) - size)}
    end
  end

  defp pass_string(<<?\", rest::binary>>), do: {:ok, rest}
  defp pass_string(<<?\\, _escaped, rest::binary>>), do: pass_string(rest)
  defp pass_string(<<_, rest::binary>>), do: pass_string(rest)
  defp pass_string(<<>>), do: :error

  defp pass_nested(<<?\", rest::binary>>, depth) do
    with {:ok, rest} <- pass_string(rest), do: pass_nested(rest, depth)
  end

  defp pass_nested(<<c, rest::binary>>, depth) when c in [?{, ?[],
    do: pass_nested(rest, depth + 1)

  defp pass_nested(<<c, rest::binary>>, 1) when c in [?}, ?]], do: {:ok, rest}

  defp pass_nested(<<c, rest::binary>>, depth) when c in [?}, ?]],
    do: pass_nested(rest, depth - 1)

  defp pass_nested(<<_, rest::binary>>, depth), do: pass_nested(rest, depth)
  defp pass_nested(<<>>, _depth), do: :error

  defp scalar_size(<<c, rest::binary>>, size) when c not in [?,, ?}, ?], ?\s, ?\t, ?\n, ?\r],
    do: scalar_size(rest, size + 1)

  defp scalar_size(_rest, size), do: size

  defp skip(<<c, rest::binary>>) when c in [?\s, ?\t, ?\n, ?\r], do: skip(rest)
  defp skip(text), do: text
end
