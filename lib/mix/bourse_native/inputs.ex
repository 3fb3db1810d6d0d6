defmodule Mix.BourseNative.Inputs do
  @moduledoc false
  # What the native artifacts are built from: the Rust build inputs of a :bourse checkout
  # and the settings cargo reads from the environment. Used by `mix compile.bourse_native`
  # to skip cargo when nothing changed, and by `mix bourse.native.package` to record which
  # sources prebuilt artifacts come from.

  # Files at the checkout's root that cargo reads.
  @root_files ~w(Cargo.toml Cargo.lock .cargo/config.toml .cargo/config rust-toolchain rust-toolchain.toml)

  # Folders under native/ that `cargo build -p bourse_nif -p bourse_daemon` does not compile.
  @skipped_dirs ~w(target tests benches examples)

  # Environment variables that change what cargo builds.
  @settings ~w(CARGO_TARGET_DIR RUSTFLAGS CARGO_ENCODED_RUSTFLAGS RUSTC RUSTC_WRAPPER RUSTUP_TOOLCHAIN)
  @setting_prefixes ~w(CARGO_BUILD_ CARGO_PROFILE_ CARGO_TARGET_)

  @doc """
  The SHA-256 (lower-case hex) of the Rust build inputs under `root`: every file of
  `native/` outside the crates' `target/`, `tests/`, `benches/` and `examples/` folders,
  and the workspace's `Cargo.toml`, `Cargo.lock` and cargo configuration. Contents and
  relative paths count, not times: the same sources give the same digest on any machine.
  """
  @spec sources_digest(Path.t()) :: String.t()
  def sources_digest(root) do
    files =
      Enum.filter(@root_files, &File.regular?(Path.join(root, &1))) ++
        native_files(root, "native")

    files
    |> Enum.sort()
    |> Enum.reduce(:crypto.hash_init(:sha256), fn file, hash ->
      content = File.read!(Path.join(root, file))
      :crypto.hash_update(hash, [file, 0, Integer.to_string(byte_size(content)), 0, content])
    end)
    |> :crypto.hash_final()
    |> Base.encode16(case: :lower)
  end

  @doc "The cargo settings read from the environment, sorted."
  @spec settings() :: [{String.t(), String.t()}]
  def settings do
    System.get_env()
    |> Enum.filter(fn {name, _} ->
      name in @settings or String.starts_with?(name, @setting_prefixes)
    end)
    |> Enum.sort()
  end

  defp native_files(root, dir) do
    case File.ls(Path.join(root, dir)) do
      {:ok, names} ->
        Enum.flat_map(names, fn name ->
          path = Path.join(dir, name)

          cond do
            File.dir?(Path.join(root, path)) and name not in @skipped_dirs ->
              native_files(root, path)

            File.regular?(Path.join(root, path)) ->
              [path]

            true ->
              []
          end
        end)

      {:error, _} ->
        []
    end
  end
end
