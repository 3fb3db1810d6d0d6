defmodule Bourse.RateLimiter.RetryAfter do
  @moduledoc """
  Parses an exchange's `Retry-After` header into a wait in milliseconds.

  RFC 9110 allows seconds or an HTTP date. Accepted here:

    * seconds: `"2"`, `" 1.5 "`, `"3e1"`, `"-5"` (text matching
      `-?digits[.digits][e[+-]digits]`), or an integer or float;
    * HTTP dates: IMF-fixdate (`"Wed, 21 Oct 2015 07:28:00 GMT"`), the obsolete RFC 850
      (`"Wednesday, 21-Oct-15 07:28:00 GMT"`) and asctime (`"Wed Oct 21 07:28:00 2015"`)
      forms, with `GMT`, `UTC`, `UT`, `Z` or a numeric zone such as `-0000` or `+0200`
      (as Python's `email.utils` reads them).

  Results:

    * `{:ok, ms}` – wait `ms`: seconds are rounded up to whole ms, and anything shorter
      than `:floor_ms` (tiny, zero, negative, a past date) is raised to it;
    * `{:stop, ms}` – the server asks for more than `:cap_ms` (a ban): stop, don't wait;
    * `:error` – unusable (not a number or a date, infinite such as `"1e400"`, `"inf"`,
      `"nan"` or an integer past the largest double, or a non-text term): fall back to
      your own backoff.

  It never raises on a binary, number or any other term.

  Options: `:floor_ms` (default 1000, or `:cap_ms` when lower) and `:cap_ms` (default
  300_000), non-negative integers, the floor no greater than the cap, and `:now`, the
  current time used for dates, a `DateTime` or unix ms (default: the system clock). Other
  options are `{:error, %Bourse.Error{type: :invalid_parameters}}`, naming the option.

      RetryAfter.parse("2")                                  #=> {:ok, 2000}
      RetryAfter.parse("1e-400")                             #=> {:ok, 1000}
      RetryAfter.parse("86400")                              #=> {:stop, 86_400_000}
      RetryAfter.parse("1e400")                              #=> :error
      RetryAfter.parse("Wed, 21 Oct 2015 07:28:05 GMT",
        now: ~U[2015-10-21 07:28:00Z])                       #=> {:ok, 5000}
  """

  alias Bourse.Error
  alias Bourse.RateLimiter.Options

  @options [:floor_ms, :cap_ms, :now]
  @max_unix_ms 253_402_300_799_999

  @type result ::
          {:ok, non_neg_integer()} | {:stop, pos_integer()} | :error | {:error, Bourse.Error.t()}

  # Longer values are nonsense for this header; refusing them bounds the work.
  @max_length 256
  # The largest finite double, in s and in ms: larger texts are infinity as a float, and
  # larger integers are taken as such texts are.
  @max_finite_s trunc(1.7976931348623157e308)
  @max_finite_ms @max_finite_s * 1000

  @seconds ~r/\A\s*(-?)(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?\s*\z/
  @fixdate ~r/\A\s*(?:[a-z]{3,9},\s*)?(?<day>\d{1,2})[ -](?<mon>[a-z]{3})[ -](?<year>\d{4}|\d{2})\s+(?<hour>\d{1,2}):(?<min>\d{2})(?::(?<sec>\d{2}))?(?:\s*(?<zone>gmt|utc|ut|z|[+-]\d{4}))?\s*\z/i
  @asctime ~r/\A\s*[a-z]{3}\s+(?<mon>[a-z]{3})\s+(?<day>\d{1,2})\s+(?<hour>\d{1,2}):(?<min>\d{2}):(?<sec>\d{2})\s+(?<year>\d{4})\s*\z/i

  @months ~w(jan feb mar apr may jun jul aug sep oct nov dec) |> Enum.with_index(1) |> Map.new()

  @doc """
  Parses a `Retry-After` value; see the module documentation.
  """
  @spec parse(term(), keyword()) :: result()
  def parse(value, opts \\ []) do
    with {:ok, floor, cap} <- options(opts) do
      case to_ms(value, opts) do
        {:ok, ms} when ms > cap -> {:stop, ms}
        {:ok, ms} -> {:ok, max(ms, floor)}
        :error -> :error
      end
    end
  end

  @doc """
  The time an HTTP date (IMF-fixdate, RFC 850 or asctime, as `parse/2` reads them) names,
  in unix milliseconds; `:error` for anything else (numbers included).

      RetryAfter.http_date_ms("Wed, 21 Oct 2015 07:28:00 GMT")   #=> {:ok, 1_445_412_480_000}
  """
  @spec http_date_ms(term()) :: {:ok, integer()} | :error
  def http_date_ms(text) when is_binary(text) and byte_size(text) <= @max_length do
    now = System.os_time(:millisecond)

    with match when is_map(match) <-
           Regex.named_captures(@fixdate, text) || Regex.named_captures(@asctime, text),
         {:ok, from_now} <- date_ms(match, now: now) do
      {:ok, from_now + now}
    else
      _ -> :error
    end
  end

  def http_date_ms(_other), do: :error

  defp options(opts) do
    with :ok <- Options.known_options(opts, "option", @options, "one of #{inspect(@options)}"),
         {:ok, cap} <- ms_option(opts, :cap_ms, 300_000),
         {:ok, floor} <- ms_option(opts, :floor_ms, min(1000, cap)),
         :ok <- floor_within_cap(floor, cap),
         {:ok, _now} <- now_option(opts[:now]) do
      {:ok, floor, cap}
    else
      {:error, message} -> {:error, Error.invalid(message)}
    end
  end

  defp ms_option(opts, key, default) do
    case Keyword.get(opts, key, default) do
      ms when is_integer(ms) and ms >= 0 -> {:ok, ms}
      other -> {:error, "#{key} must be a non-negative integer, got #{Error.describe(other)}"}
    end
  end

  defp floor_within_cap(floor, cap) when floor <= cap, do: :ok

  defp floor_within_cap(floor, cap),
    do: {:error, "floor_ms (#{floor}) must not exceed cap_ms (#{cap})"}

  # Unix ms from 1970 to the end of 9999, as DateTime reads them.
  defp now_option(now) when is_nil(now) or (is_integer(now) and now in 0..@max_unix_ms),
    do: {:ok, now}

  defp now_option(%DateTime{} = now), do: {:ok, now}

  defp now_option(other),
    do:
      {:error,
       "now must be a DateTime or unix ms from 0 to #{@max_unix_ms}, got #{Error.describe(other)}"}

  defp to_ms(seconds, _opts) when is_integer(seconds) and abs(seconds) <= @max_finite_s,
    do: {:ok, seconds * 1000}

  defp to_ms(seconds, _opts) when is_integer(seconds), do: :error
  # Times 1000, a huge double would overflow; far above any cap, whole seconds will do.
  defp to_ms(seconds, _opts) when is_float(seconds) and abs(seconds) < 1.0e15,
    do: {:ok, ceil(seconds * 1000)}

  defp to_ms(seconds, _opts) when is_float(seconds), do: {:ok, trunc(seconds) * 1000}

  defp to_ms(text, opts) when is_binary(text) and byte_size(text) <= @max_length do
    cond do
      match = Regex.run(@seconds, text, capture: :all_but_first) -> decimal_ms(match)
      match = Regex.named_captures(@fixdate, text) -> date_ms(match, opts)
      match = Regex.named_captures(@asctime, text) -> date_ms(match, opts)
      true -> :error
    end
  end

  defp to_ms(_other, _opts), do: :error

  # Exact decimal arithmetic, so "1e400" is infinite and "1e-400" tiny, as doubles are.
  defp decimal_ms([sign, int | rest]) do
    [frac, exp] = Enum.take(rest ++ ["", ""], 2)
    digits = String.trim_leading(int <> frac, "0")
    # |value| in ms = digits * 10^shift < 10^magnitude
    shift = if(exp == "", do: 0, else: String.to_integer(exp)) - byte_size(frac) + 3
    magnitude = byte_size(digits) + shift

    cond do
      digits == "" -> {:ok, 0}
      magnitude > 315 -> :error
      magnitude <= 0 and sign == "-" -> {:ok, 0}
      magnitude <= 0 -> {:ok, 1}
      true -> exact_ms(sign, String.to_integer(digits), shift)
    end
  end

  defp exact_ms(sign, n, shift) do
    ms =
      cond do
        shift >= 0 -> n * Integer.pow(10, shift)
        sign == "-" -> div(n, Integer.pow(10, -shift))
        true -> div(n + Integer.pow(10, -shift) - 1, Integer.pow(10, -shift))
      end

    cond do
      ms > @max_finite_ms -> :error
      sign == "-" -> {:ok, -ms}
      true -> {:ok, ms}
    end
  end

  defp date_ms(%{"mon" => mon} = date, opts) do
    now = now_ms(opts[:now])
    [day, year, hour, min, sec] = for k <- ~w(day year hour min sec), do: to_int(date[k])

    with {:ok, month} <- Map.fetch(@months, String.downcase(mon)),
         {:ok, naive} <-
           NaiveDateTime.new(full_year(year, date["year"], now), month, day, hour, min, sec) do
      local = naive |> DateTime.from_naive!("Etc/UTC") |> DateTime.to_unix(:millisecond)
      {:ok, local - zone_offset_ms(Map.get(date, "zone", "")) - now}
    else
      _ -> :error
    end
  end

  defp to_int(""), do: 0
  defp to_int(digits), do: String.to_integer(digits)

  # RFC 9110: a two-digit year more than 50 years ahead is in the previous century.
  defp full_year(year, text, now) when byte_size(text) == 2 do
    this_year = DateTime.from_unix!(now, :millisecond).year
    year = year + this_year - rem(this_year, 100)
    if year > this_year + 50, do: year - 100, else: year
  end

  defp full_year(year, _text, _now), do: year

  defp zone_offset_ms(<<sign, hh::binary-2, mm::binary-2>>) when sign in [?+, ?-] do
    ms = (String.to_integer(hh) * 60 + String.to_integer(mm)) * 60_000
    if sign == ?-, do: -ms, else: ms
  end

  defp zone_offset_ms(_gmt), do: 0

  defp now_ms(nil), do: System.os_time(:millisecond)
  defp now_ms(%DateTime{} = now), do: DateTime.to_unix(now, :millisecond)
  defp now_ms(ms) when is_integer(ms), do: ms
end
