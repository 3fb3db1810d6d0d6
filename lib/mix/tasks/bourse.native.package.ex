defmodule Mix.Tasks.Bourse.Native.Package do
  @shortdoc "Builds the native artifacts into a directory usable as prebuilt artifacts"

  @moduledoc """
  Builds the NIF and the daemon from source with cargo and writes them, with a manifest,
  into a directory that `mix compile.bourse_native` can use instead of building
  (`BOURSE_NATIVE_PREBUILT_DIR` or `config :bourse, native_prebuilt_dir: ...`):

      mix bourse.native.package [--output DIR]

  Run it in a checkout of `:bourse` or in an application that depends on it. `DIR`
  defaults to `_build/bourse_native-VERSION-nif-NIF_VERSION-TARGET` and is printed at the
  end. It holds `libbourse_nif.so`, `bourse_daemon` and `bourse_native.manifest`: the
  version of `:bourse`, the SHA-256 of the Rust sources they were built from, the target
  triple (`rustc -vV`'s host), this VM's NIF version and OTP release, and the SHA-256 of
  each artifact. Copy the directory to machines of the same target and an Erlang/OTP with
  the same NIF major version and at least this minor version.
  """

  use Mix.Task

  alias Mix.BourseNative.{Inputs, Prebuilt}
  alias Mix.Tasks.Compile.BourseNative

  @impl Mix.Task
  def run(args) do
    opts =
      case OptionParser.parse(args, strict: [output: :string]) do
        {opts, [], []} -> opts
        _ -> Mix.raise("usage: mix bourse.native.package [--output DIR]")
      end

    {root, version} = bourse_root()
    built = BourseNative.cargo_build!(root)

    info = %{
      bourse_version: version,
      sources: Inputs.sources_digest(root),
      target: rust_host(),
      nif_version: List.to_string(:erlang.system_info(:nif_version)),
      otp_release: System.otp_release()
    }

    output =
      Path.expand(
        opts[:output] ||
          Path.join(
            Mix.Project.build_path() |> Path.dirname(),
            "bourse_native-#{version}-nif-#{info.nif_version}-#{info.target}"
          )
      )

    File.mkdir_p!(output)

    for {name, mode} <- BourseNative.artifacts() do
      File.cp!(Map.fetch!(built, name), Path.join(output, name))
      File.chmod!(Path.join(output, name), mode)
    end

    Prebuilt.write!(output, BourseNative.artifact_names(), info)

    Mix.shell().info("""
    Prebuilt :bourse native artifacts in #{output}
    Use them with BOURSE_NATIVE_PREBUILT_DIR=#{output} mix compile
    """)
  end

  # The checkout of :bourse (this project, or this application's dependency) and its version.
  defp bourse_root do
    root =
      if Mix.Project.config()[:app] == :bourse,
        do: File.cwd!(),
        else:
          Mix.Project.deps_paths()[:bourse] ||
            Mix.raise("this project does not depend on :bourse")

    :ok = with {:error, {:already_loaded, :bourse}} <- Application.load(:bourse), do: :ok
    {root, to_string(Application.spec(:bourse, :vsn))}
  end

  defp rust_host do
    rustc =
      System.find_executable("rustc") ||
        Mix.raise("rustc not found in PATH: cannot name the target")

    {text, 0} = System.cmd(rustc, ["-vV"])

    case Regex.run(~r/^host: (\S+)$/m, text, capture: :all_but_first) do
      [host] -> host
      nil -> Mix.raise("rustc -vV names no host")
    end
  end
end
