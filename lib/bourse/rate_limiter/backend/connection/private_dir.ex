defmodule Bourse.RateLimiter.Backend.Connection.PrivateDir do
  @moduledoc false
  # A new directory that only this OS user may enter, for the port's socket. Erlang cannot
  # create a directory with a mode: it is created under the umask, then set to 0700, and in
  # between another OS user may put entries in it (with umask 000). So it is kept only if,
  # once set to 0700, it is a directory of that mode holding nothing; otherwise what can be
  # removed of it is removed and another name is tried. (Under a base only this user may
  # enter, `$XDG_RUNTIME_DIR` when private, no one else can.)

  @attempts 3

  @doc "Creates `bourse-<16 random characters>` in `base`, or says why it cannot."
  @spec create(Path.t()) :: {:ok, Path.t()} | {:error, String.t()}
  def create(base), do: create(base, @attempts, nil)

  defp create(base, 0, reason),
    do:
      {:error,
       "cannot create a private directory in #{base} for the daemon's socket " <>
         "(#{@attempts} tries, the last: #{reason}); XDG_RUNTIME_DIR or TMPDIR naming a " <>
         "directory only this OS user may enter avoids the race"}

  defp create(base, attempts, _reason) do
    dir = Path.join(base, "bourse-" <> Base.url_encode64(:crypto.strong_rand_bytes(12)))

    with :ok <- mkdir(dir),
         :ok <- chmod(dir),
         :ok <- verify(dir) do
      {:ok, dir}
    else
      {:error, {:not_created, reason}} ->
        create(base, attempts - 1, reason)

      {:error, reason} ->
        discard(dir)
        create(base, attempts - 1, reason)
    end
  end

  # A name taken already is someone else's: it is left alone.
  defp mkdir(dir) do
    case File.mkdir(dir) do
      :ok -> :ok
      {:error, :eexist} -> {:error, {:not_created, "#{dir} exists already"}}
      {:error, reason} -> {:error, {:not_created, format(reason)}}
    end
  end

  defp chmod(dir) do
    case File.chmod(dir, 0o700) do
      :ok -> :ok
      {:error, reason} -> {:error, "cannot set the mode of #{dir}: #{format(reason)}"}
    end
  end

  @doc """
  `:ok` if `dir` is a directory (not a link) of mode 0700 holding nothing. Reading a
  directory of mode 0700 proves this OS user owns it (or is root).
  """
  @spec verify(Path.t()) :: :ok | {:error, String.t()}
  def verify(dir) do
    case {File.lstat(dir), entries(dir)} do
      {{:ok, %File.Stat{type: :directory, mode: mode}}, {:ok, entries}} ->
        cond do
          Bitwise.band(mode, 0o777) != 0o700 ->
            {:error,
             "#{dir} has mode #{inspect(Bitwise.band(mode, 0o777), base: :octal)}, not 0o700"}

          entries != [] ->
            {:error,
             "#{dir} holds #{entries |> Enum.map(&shown/1) |> Enum.sort() |> Enum.join(", ")} " <>
               "that another OS user put there before it was made private"}

          true ->
            :ok
        end

      {{:ok, %File.Stat{type: type}}, _} when type != :directory ->
        {:error, "#{dir} is no longer a directory (#{type})"}

      {{:error, reason}, _} ->
        {:error, "cannot read #{dir}: #{format(reason)}"}

      {_, {:error, reason}} ->
        {:error, "cannot list #{dir}: #{format(reason)}"}
    end
  end

  @doc """
  Removes `dir` (never a link) and its entries, as far as this OS user can: a link is
  unlinked, never followed, and a directory in it removed only if empty.
  """
  @spec discard(Path.t()) :: :ok
  def discard(dir) do
    with {:ok, %File.Stat{type: :directory}} <- File.lstat(dir),
         {:ok, entries} <- entries(dir) do
      Enum.each(entries, &remove_entry(Path.join(dir, &1)))
    end

    File.rmdir(dir)
    :ok
  end

  # Every entry, its name raw: `File.ls/1` leaves out names that are not UTF-8.
  defp entries(dir), do: :file.list_dir_all(dir)

  defp shown(name) when is_binary(name),
    do: if(String.valid?(name), do: name, else: inspect(name, binaries: :as_binaries))

  defp shown(name), do: to_string(name)

  # A file, socket or link is unlinked; a directory removed only if empty.
  defp remove_entry(path) do
    with {:error, _} <- File.rm(path), do: File.rmdir(path)
  end

  defp format(reason), do: List.to_string(:file.format_error(reason))
end
