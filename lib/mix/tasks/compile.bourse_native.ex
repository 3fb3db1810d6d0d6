defmodule Mix.Tasks.Compile.BourseNative do
  @shortdoc "Builds the Rust NIF and daemon into priv/native, or installs prebuilt ones"

  @moduledoc """
  Mix compiler that puts the native parts of `:bourse` into `priv/native/`:

    * `libbourse_nif.so` (the NIF library; built as `.dylib` on macOS and renamed),
    * `bourse_daemon` (the port process and shared limiter daemon, mode 0755).

  It is listed first in the project's compilers:

      compilers: [:bourse_native] ++ Mix.compilers()

  ## From source (the default)

  It runs, from the root of `:bourse`,

      cargo build --release --locked -p bourse_nif -p bourse_daemon

  with `--target-dir` set to `CARGO_TARGET_DIR`, else `CARGO_BUILD_TARGET_DIR`, else the
  root's `target/` (a `build.target-dir` of a cargo configuration file is overridden), and
  copies the artifacts from its `release/` (`<triple>/release/` with `CARGO_BUILD_TARGET`).
  Cargo runs only when something it builds from has changed since the last build in this
  build directory: a file of `native/` (outside the crates' `tests/`, `benches/` and
  `examples/`), `Cargo.toml`, `Cargo.lock`, the cargo configuration, a cargo setting in the
  environment (`RUSTFLAGS`, `CARGO_TARGET_DIR`, `CARGO_PROFILE_*`, `CARGO_BUILD_*`, ...),
  the `cargo` found in `PATH`, or an artifact in `priv/native/`. Otherwise the compiler
  prints nothing and runs nothing. A fingerprint of those inputs is kept in the build
  directory (`_build/ENV/lib/bourse/.mix/compile.bourse_native`); `--force` runs cargo
  anyway.

  ## Prebuilt artifacts

  To skip the Rust build altogether (no Rust toolchain needed, no `target/` folder), point
  the compiler at a directory made by `mix bourse.native.package`, with an absolute path,
  in the environment:

      BOURSE_NATIVE_PREBUILT_DIR=/opt/bourse-native mix compile

  or in the application's configuration (`config/config.exs`, read when `:bourse` is
  compiled; the environment variable wins):

      config :bourse, native_prebuilt_dir: "/opt/bourse-native"

  Every `mix` command compiles: set the variable for each (export it), or use the
  configuration; a command without either builds from source.

  Before anything in it is used, the directory's `bourse_native.manifest` is checked: the
  artifacts must have been built for this machine's target triple, for a NIF version this
  Erlang/OTP loads (same major version, minor version not above this VM's: 2.16 on OTP 25),
  from this version of `:bourse` and from the same Rust sources; and the SHA-256 of each
  artifact must match the manifest. Anything else stops the build with an error saying
  what does not match.

  Files in `priv/native/` are replaced (through a temporary file and a rename, so a loaded
  library is never overwritten in place) only when their content changed. `mix clean`
  removes them and the fingerprint (not cargo's `target/`).
  """

  use Mix.Task.Compiler

  alias Mix.BourseNative.{Inputs, Prebuilt}

  @cargo_args ~w(build --release --locked -p bourse_nif -p bourse_daemon)
  @env_var "BOURSE_NATIVE_PREBUILT_DIR"
  @config_key :native_prebuilt_dir
  @fingerprint "compile.bourse_native"
  @fingerprint_format 1

  # The artifacts by their name in priv/native, with their file mode.
  @artifacts [{"libbourse_nif.so", 0o644}, {"bourse_daemon", 0o755}]

  @impl Mix.Task.Compiler
  def run(args) do
    {opts, _, _} = OptionParser.parse(args, switches: [force: :boolean])
    root = File.cwd!()
    inputs = inputs(root)

    status =
      if !opts[:force] and read_fingerprint() == {inputs, installed()} do
        :noop
      else
        changed = install(inputs, root)
        write_fingerprint({inputs, installed()})
        if changed == [], do: :noop, else: :ok
      end

    # Link priv/ into the build now: Bourse.Native loads the NIF from there as soon as the
    # Elixir compiler loads the module.
    Mix.Project.build_structure()
    {status, []}
  end

  @impl Mix.Task.Compiler
  def manifests, do: [fingerprint_path()]

  @impl Mix.Task.Compiler
  def clean do
    Enum.each(@artifacts, fn {name, _mode} -> File.rm(Path.join(priv_dir(), name)) end)
    File.rm(fingerprint_path())
  end

  @doc false
  # Runs cargo in `root`; returns the built artifacts' paths by their name in priv/native.
  @spec cargo_build!(Path.t()) :: %{String.t() => Path.t()}
  def cargo_build!(root) do
    cargo =
      System.find_executable("cargo") ||
        Mix.raise(
          "cargo not found in PATH: the :bourse native code needs a Rust toolchain " <>
            "(https://rustup.rs), or prebuilt artifacts (#{@env_var}, see " <>
            "`mix help compile.bourse_native`)"
        )

    target_dir = target_dir(root)
    args = @cargo_args ++ ["--target-dir", target_dir]

    case System.cmd(cargo, args,
           cd: root,
           into: IO.stream(:stdio, :line),
           stderr_to_stdout: true
         ) do
      {_, 0} -> :ok
      {_, status} -> Mix.raise("cargo #{Enum.join(args, " ")} failed (exit #{status})")
    end

    release = release_dir(target_dir)

    paths = %{
      "libbourse_nif.so" => Path.join(release, nif_file()),
      "bourse_daemon" => Path.join(release, "bourse_daemon")
    }

    for {_name, path} <- paths, not File.regular?(path), do: Mix.raise("cargo built no #{path}")
    paths
  end

  @doc false
  # The artifacts by their name in priv/native, with their file mode.
  @spec artifacts() :: [{String.t(), non_neg_integer()}]
  def artifacts, do: @artifacts

  @doc false
  @spec artifact_names() :: [String.t()]
  def artifact_names, do: Enum.map(@artifacts, &elem(&1, 0))

  # What the artifacts come from; the fingerprint is these inputs and the installed files.
  defp inputs(root) do
    case prebuilt_dir() do
      nil ->
        {:source, Inputs.sources_digest(root), Inputs.settings(), System.find_executable("cargo")}

      {dir, origin} ->
        files = [Prebuilt.manifest_name() | artifact_names()]
        {:prebuilt, dir, origin, file_stats(dir, files), Inputs.sources_digest(root)}
    end
  end

  defp install({:source, _digest, _settings, _cargo}, root) do
    root |> cargo_build!() |> Map.new(fn {name, path} -> {name, read!(path)} end) |> copy_all()
  end

  defp install({:prebuilt, dir, origin, _stats, digest}, _root) do
    expected = %{
      artifacts: artifact_names(),
      bourse_version: to_string(Mix.Project.config()[:version]),
      sources: digest,
      target: Prebuilt.beam_target(),
      nif_version: List.to_string(:erlang.system_info(:nif_version))
    }

    case Prebuilt.verify(dir, expected) do
      {:ok, contents} ->
        copy_all(contents)

      {:error, reason} ->
        Mix.raise(
          "cannot use the prebuilt :bourse native artifacts in #{dir} (#{origin}): " <>
            "#{reason}. Unset #{origin} to build them from source with cargo."
        )
    end
  end

  defp copy_all(contents) do
    for {name, mode} <- @artifacts,
        install_file(Map.fetch!(contents, name), Path.join(priv_dir(), name), mode),
        do: name
  end

  defp read!(path) do
    case File.read(path) do
      {:ok, binary} -> binary
      {:error, reason} -> Mix.raise("cannot read #{path}: #{:file.format_error(reason)}")
    end
  end

  # The configured directory of prebuilt artifacts and where it was configured, or nil.
  defp prebuilt_dir do
    {dir, origin} =
      case System.get_env(@env_var) do
        dir when dir in [nil, ""] ->
          {Application.get_env(:bourse, @config_key), "config :bourse, #{inspect(@config_key)}"}

        dir ->
          {dir, @env_var}
      end

    cond do
      dir == nil ->
        nil

      is_binary(dir) and Path.type(dir) == :absolute ->
        {Path.expand(dir), origin}

      true ->
        Mix.raise(
          "#{origin} must be an absolute path to a directory made by " <>
            "`mix bourse.native.package`, got #{inspect(dir, limit: 5, printable_limit: 200)}"
        )
    end
  end

  defp installed, do: file_stats(priv_dir(), artifact_names())

  defp file_stats(dir, names) do
    for name <- names do
      case File.stat(Path.join(dir, name), time: :posix) do
        {:ok, stat} -> {name, stat.size, stat.mtime, stat.mode, stat.inode}
        {:error, _} -> {name, :missing}
      end
    end
  end

  defp fingerprint_path, do: Path.join(Mix.Project.manifest_path(), @fingerprint)

  defp read_fingerprint do
    with {:ok, binary} <- File.read(fingerprint_path()),
         {@fingerprint_format, fingerprint} <- safe_binary_to_term(binary) do
      fingerprint
    else
      _ -> nil
    end
  end

  defp safe_binary_to_term(binary) do
    :erlang.binary_to_term(binary, [:safe])
  rescue
    ArgumentError -> nil
  end

  defp write_fingerprint(fingerprint) do
    File.mkdir_p!(Path.dirname(fingerprint_path()))
    File.write!(fingerprint_path(), :erlang.term_to_binary({@fingerprint_format, fingerprint}))
  end

  defp target_dir(root) do
    case Enum.find_value(~w(CARGO_TARGET_DIR CARGO_BUILD_TARGET_DIR), &env_value/1) do
      nil -> Path.join(root, "target")
      dir -> Path.expand(dir, root)
    end
  end

  defp release_dir(target_dir) do
    case env_value("CARGO_BUILD_TARGET") do
      nil -> Path.join(target_dir, "release")
      triple -> Path.join([target_dir, triple, "release"])
    end
  end

  # An environment variable's value; nil when unset or empty.
  defp env_value(name) do
    case System.get_env(name) do
      "" -> nil
      value -> value
    end
  end

  defp priv_dir, do: Path.expand("priv/native")

  defp nif_file do
    case :os.type() do
      {:unix, :darwin} -> "libbourse_nif.dylib"
      _ -> "libbourse_nif.so"
    end
  end

  # Writes `new` over dest when their contents differ; true when it wrote. The temporary
  # file is this OS process's own: two builds at once never write into the same one.
  defp install_file(new, dest, mode) do
    if File.read(dest) == {:ok, new} do
      false
    else
      File.mkdir_p!(Path.dirname(dest))
      tmp = "#{dest}.#{:os.getpid()}.tmp"
      File.write!(tmp, new)
      File.chmod!(tmp, mode)
      File.rename!(tmp, dest)
      Mix.shell().info("Installed #{Path.relative_to_cwd(dest)}")
      true
    end
  end
end
