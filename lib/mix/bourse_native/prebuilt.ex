defmodule Mix.BourseNative.Prebuilt do
  @moduledoc false
  # A directory of prebuilt native artifacts: the NIF library, the daemon binary and
  # `bourse_native.manifest`, which says what they were built for and from, with the
  # SHA-256 of each. Written by `mix bourse.native.package`, checked by
  # `mix compile.bourse_native` before anything in it is used.
  #
  # The manifest is Erlang terms (`:file.consult/1`), one per line:
  #
  #     {format, 1}.
  #     {bourse_version, "0.1.0"}.
  #     {sources, "<SHA-256 of the Rust build inputs>"}.
  #     {target, "x86_64-unknown-linux-gnu"}.
  #     {nif_version, "2.16"}.
  #     {otp_release, "25"}.
  #     {artifact, "libbourse_nif.so", "<SHA-256>"}.
  #     {artifact, "bourse_daemon", "<SHA-256>"}.

  @manifest "bourse_native.manifest"
  @format 1

  @typedoc "What a directory must match to be used."
  @type expected :: %{
          artifacts: [String.t()],
          bourse_version: String.t(),
          sources: String.t() | nil,
          target: String.t(),
          nif_version: String.t()
        }

  @doc "The manifest's file name."
  @spec manifest_name() :: String.t()
  def manifest_name, do: @manifest

  @doc """
  Writes the manifest for `artifacts` (file names in `dir`) with their SHA-256.
  `info` holds `:bourse_version`, `:sources`, `:target`, `:nif_version`, `:otp_release`.
  """
  @spec write!(Path.t(), [String.t()], map()) :: :ok
  def write!(dir, artifacts, info) do
    c = &String.to_charlist/1

    terms =
      [
        {:format, @format},
        {:bourse_version, c.(info.bourse_version)},
        {:sources, c.(info.sources)},
        {:target, c.(info.target)},
        {:nif_version, c.(info.nif_version)},
        {:otp_release, c.(info.otp_release)}
      ] ++ for(name <- artifacts, do: {:artifact, c.(name), c.(sha256!(Path.join(dir, name)))})

    text = for term <- terms, do: :io_lib.format(~c"~tp.~n", [term])

    File.write!(
      Path.join(dir, @manifest),
      ["%% Prebuilt :bourse native artifacts (mix bourse.native.package).\n" | text]
    )
  end

  @doc """
  Checks `dir` against `expected`: its manifest, then the target, the NIF version, the
  sources, and the SHA-256 of every artifact. Returns the artifacts' contents by name (the
  bytes that were checked, so a file changed after the check is not used), or an error
  saying what does not match.
  """
  @spec verify(Path.t(), expected()) :: {:ok, %{String.t() => binary()}} | {:error, String.t()}
  def verify(dir, expected) do
    with {:ok, manifest} <- read(dir),
         :ok <- same_target(manifest, expected),
         :ok <- usable_nif(manifest, expected),
         :ok <- same_sources(manifest, expected) do
      checksums(dir, manifest, expected.artifacts)
    end
  end

  @doc """
  The Rust target triple of this Erlang VM (from `:erlang.system_info(:system_architecture)`):
  `"x86_64-unknown-linux-gnu"` for `x86_64-pc-linux-gnu`, `"aarch64-apple-darwin"` for
  `aarch64-apple-darwin22.4.0`.
  """
  @spec beam_target() :: String.t()
  def beam_target, do: rust_target(List.to_string(:erlang.system_info(:system_architecture)))

  @doc false
  @spec rust_target(String.t()) :: String.t()
  def rust_target(architecture) do
    case String.split(architecture, "-") do
      [cpu, _vendor, "linux" | abi] -> Enum.join([cpu, "unknown", "linux" | abi], "-")
      [cpu, "apple", "darwin" <> _] -> "#{darwin_cpu(cpu)}-apple-darwin"
      [cpu, _vendor, "freebsd" <> _] -> "#{cpu}-unknown-freebsd"
      _ -> architecture
    end
  end

  defp darwin_cpu("arm64"), do: "aarch64"
  defp darwin_cpu(cpu), do: cpu

  @doc "The SHA-256 of a file, lower-case hex."
  @spec sha256!(Path.t()) :: String.t()
  def sha256!(path) do
    path
    |> File.stream!([], 65_536)
    |> Enum.reduce(:crypto.hash_init(:sha256), &:crypto.hash_update(&2, &1))
    |> :crypto.hash_final()
    |> Base.encode16(case: :lower)
  end

  defp read(dir) do
    path = Path.join(dir, @manifest)

    with {:dir, true} <- {:dir, File.dir?(dir)},
         {:ok, terms} <- :file.consult(String.to_charlist(path)),
         %{format: @format} = manifest <- parse(terms) do
      {:ok, manifest}
    else
      {:dir, false} ->
        {:error, "no such directory"}

      {:error, reason} ->
        {:error,
         "cannot read its #{@manifest} (#{:file.format_error(reason)}): produce the " <>
           "directory with `mix bourse.native.package`"}

      _ ->
        {:error,
         "its #{@manifest} is not of format #{@format}: produce the directory again with " <>
           "`mix bourse.native.package` from this version of :bourse"}
    end
  end

  defp parse(terms) do
    Enum.reduce(terms, %{artifacts: %{}}, fn
      {:artifact, name, sha}, acc when is_list(name) and is_list(sha) ->
        put_in(acc, [:artifacts, List.to_string(name)], List.to_string(sha))

      {field, value}, acc when is_list(value) ->
        Map.put(acc, field, List.to_string(value))

      {field, value}, acc ->
        Map.put(acc, field, value)

      _other, acc ->
        acc
    end)
  end

  defp same_target(%{target: target}, %{target: target}), do: :ok

  defp same_target(manifest, expected),
    do:
      {:error,
       "they were built for target #{inspect(manifest[:target])}, this machine is " <>
         "#{inspect(expected.target)}"}

  # A NIF built for version M.m loads in a VM providing M.n with n >= m.
  defp usable_nif(manifest, expected) do
    with {:ok, {major, minor}} <- nif_version(manifest[:nif_version]),
         {:ok, {^major, here}} when here >= minor <- nif_version(expected.nif_version) do
      :ok
    else
      _ ->
        {:error,
         "they were built for NIF version #{inspect(manifest[:nif_version])} " <>
           "(Erlang/OTP #{manifest[:otp_release] || "?"}), this Erlang/OTP " <>
           "#{System.otp_release()} provides NIF version #{expected.nif_version}"}
    end
  end

  defp nif_version(text) when is_binary(text) do
    case Enum.map(String.split(text, "."), &Integer.parse/1) do
      [{major, ""}, {minor, ""}] -> {:ok, {major, minor}}
      _ -> :error
    end
  end

  defp nif_version(_), do: :error

  defp same_sources(manifest, expected) do
    cond do
      manifest[:bourse_version] != expected.bourse_version ->
        {:error,
         "they are :bourse #{inspect(manifest[:bourse_version])}, this is " <>
           "#{inspect(expected.bourse_version)}"}

      expected.sources != nil and manifest[:sources] != expected.sources ->
        {:error,
         "they were built from other Rust sources than this checkout's (sources " <>
           "#{String.slice(to_string(manifest[:sources]), 0, 12)}, here " <>
           "#{String.slice(expected.sources, 0, 12)})"}

      true ->
        :ok
    end
  end

  defp checksums(dir, manifest, names) do
    Enum.reduce_while(names, {:ok, %{}}, fn name, {:ok, found} ->
      case {manifest.artifacts[name], File.read(Path.join(dir, name))} do
        {nil, _} ->
          {:halt, {:error, "its #{@manifest} lists no #{name}"}}

        {_sha, {:error, reason}} ->
          {:halt, {:error, "cannot read #{name}: #{:file.format_error(reason)}"}}

        {sha, {:ok, content}} ->
          case Base.encode16(:crypto.hash(:sha256, content), case: :lower) do
            ^sha ->
              {:cont, {:ok, Map.put(found, name, content)}}

            actual ->
              {:halt,
               {:error,
                "the SHA-256 of #{name} is #{actual}, its #{@manifest} says #{sha}: the " <>
                  "file was changed or damaged"}}
          end
      end
    end)
  end
end
