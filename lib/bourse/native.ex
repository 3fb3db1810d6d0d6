defmodule Bourse.Native do
  @moduledoc false
  # The NIF over the Rust bucket table (native/bourse_nif). Loaded from priv/native when
  # this module loads; every function answers malformed input with
  # `{:error, message, exchange_id | nil}`. The core's bounds (`bounds/0`) are read once,
  # at load, into `:persistent_term` (`bound/1`).

  @on_load :load_nif

  @doc false
  def load_nif do
    path =
      case :code.priv_dir(:bourse) do
        {:error, _} -> ~c"priv/native/libbourse_nif"
        dir -> :filename.join(dir, ~c"native/libbourse_nif")
      end

    case :erlang.load_nif(path, 0) do
      :ok ->
        :persistent_term.put({__MODULE__, :bounds}, bounds())

      {:error, {reason, text}} ->
        IO.warn("Bourse.Native: cannot load #{path}: #{reason} #{text}", [])
        {:error, reason}
    end
  end

  @doc false
  # A bound or default of the core's rules: `:max_key_part_bytes`, `:max_checks`,
  # `:max_busiest`, `:max_pauses`, `:default_booking_slack_ms`, `:max_ms`,
  # `:max_setting_ms`, `:max_store_timeout_ms`, `:max_amount`, `:first_backoff_ms`,
  # `:min_secret_bytes`, `:max_secret_bytes`, `:max_secret_file_bytes`,
  # `:max_secret_path_bytes`; and the NIF's
  # `:max_inline_checks` and `:max_inline_bookings` (longer check lists, and checks of
  # buckets holding more bookings together, run on a dirty scheduler).
  def bound(name), do: Map.fetch!(:persistent_term.get({__MODULE__, :bounds}), name)

  def bounds, do: :erlang.nif_error(:not_loaded)
  def check_key(_key), do: :erlang.nif_error(:not_loaded)
  def limit_definition(_limit), do: :erlang.nif_error(:not_loaded)
  def new_table(_assume_busy_at_start, _booking_slack_ms), do: :erlang.nif_error(:not_loaded)

  def check_rate(_table, _owner, _key, _limit, _cost, _max_wait),
    do: :erlang.nif_error(:not_loaded)

  def check_rates(_table, _owner, _checks, _max_wait), do: :erlang.nif_error(:not_loaded)
  def prepare(_table, _key, _limit), do: :erlang.nif_error(:not_loaded)

  def check_prepared(_table, _owner, _bucket, _cost, _max_wait),
    do: :erlang.nif_error(:not_loaded)

  def record_request(_table, _key, _cost), do: :erlang.nif_error(:not_loaded)
  def get_cost(_table, _key), do: :erlang.nif_error(:not_loaded)
  def sync(_table, _key, _allowance, _window_left_ms), do: :erlang.nif_error(:not_loaded)
  def reset(_table, _key), do: :erlang.nif_error(:not_loaded)
  def reset_exchange(_table, _exchange), do: :erlang.nif_error(:not_loaded)
  def reset_all(_table), do: :erlang.nif_error(:not_loaded)
  def sweep(_table), do: :erlang.nif_error(:not_loaded)
  def pause(_table, _target, _ms), do: :erlang.nif_error(:not_loaded)
  def back_off(_table, _credential, _scope), do: :erlang.nif_error(:not_loaded)
  def reset_backoff(_table, _credential), do: :erlang.nif_error(:not_loaded)
  def inspect(_table, _key), do: :erlang.nif_error(:not_loaded)
  def busiest(_table, _count), do: :erlang.nif_error(:not_loaded)
  def stats(_table), do: :erlang.nif_error(:not_loaded)
end
