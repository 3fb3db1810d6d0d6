defmodule Mix.Tasks.Compile.BourseNative do
  @shortdoc "Builds the Rust NIF and daemon into priv/native"

  @moduledoc """
  Mix compiler that builds the native parts of `:bourse` with cargo.

  It runs, from the project root,

      cargo build --release --locked -p bourse_nif -p bourse_daemon

  and copies the artifacts into `priv/native/`:

    * `libbourse_nif.so` (the NIF library; built as `.dylib` on macOS and renamed),
    * `bourse_daemon` (the port process and shared limiter daemon, mode 0755).

  Cargo decides what to rebuild; files in `priv/native/` are replaced (through a
  temporary file and a rename, so a loaded library is never overwritten in place) only
  when their content changed. `CARGO_TARGET_DIR` is honoured.

  It is listed first in the project's compilers:

      compilers: [:bourse_native] ++ Mix.compilers()

  `mix clean` removes the copied artifacts (not cargo's `target/`).
  """

  use Mix.Task.Compiler

  @cargo_args ~w(build --release --locked -p bourse_nif -p bourse_daemon)

  @impl Mix.Task.Compiler
  def run(_args) do
    cargo =
      System.find_executable("cargo") ||
        Mix.raise(
          "cargo not found in PATH: the :bourse native code needs a Rust toolchain " <>
            "(https://rustup.rs)"
        )

    case System.cmd(cargo, @cargo_args, into: IO.stream(:stdio, :line), stderr_to_stdout: true) do
      {_, 0} -> :ok
      {_, status} -> Mix.raise("cargo #{Enum.join(@cargo_args, " ")} failed (exit #{status})")
    end

    release = Path.join(target_dir(), "release")

    changed =
      for {source, dest, mode} <- [
            {Path.join(release, nif_file()), "libbourse_nif.so", 0o644},
            {Path.join(release, "bourse_daemon"), "bourse_daemon", 0o755}
          ],
          install(source, Path.join(priv_dir(), dest), mode),
          do: dest

    # Link priv/ into the build now: Bourse.Native loads the NIF from there as soon as the
    # Elixir compiler loads the module.
    Mix.Project.build_structure()
    if changed == [], do: {:noop, []}, else: {:ok, []}
  end

  @impl Mix.Task.Compiler
  def clean do
    Enum.each(~w(libbourse_nif.so bourse_daemon), &File.rm(Path.join(priv_dir(), &1)))
  end

  defp target_dir do
    case System.get_env("CARGO_TARGET_DIR") do
      dir when dir in [nil, ""] -> Path.expand("target")
      dir -> Path.expand(dir)
    end
  end

  defp priv_dir, do: Path.expand("priv/native")

  defp nif_file do
    case :os.type() do
      {:unix, :darwin} -> "libbourse_nif.dylib"
      _ -> "libbourse_nif.so"
    end
  end

  # Copies source over dest when their contents differ; true when it copied.
  defp install(source, dest, mode) do
    new =
      case File.read(source) do
        {:ok, binary} -> binary
        {:error, reason} -> Mix.raise("cargo built no #{source}: #{:file.format_error(reason)}")
      end

    if File.read(dest) == {:ok, new} do
      false
    else
      File.mkdir_p!(Path.dirname(dest))
      tmp = dest <> ".tmp"
      File.write!(tmp, new)
      File.chmod!(tmp, mode)
      File.rename!(tmp, dest)
      Mix.shell().info("Installed #{Path.relative_to_cwd(dest)}")
      true
    end
  end
end
