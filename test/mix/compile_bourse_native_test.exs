defmodule Mix.Tasks.Compile.BourseNativeTest do
  # Changes the working directory, the Mix project, PATH and the :bourse env.
  use ExUnit.Case, async: false

  alias Mix.BourseNative.Prebuilt
  alias Mix.Tasks.Bourse.Native.Package
  alias Mix.Tasks.Compile.BourseNative

  @vars ~w(PATH CARGO_TARGET_DIR CARGO_BUILD_TARGET_DIR CARGO_BUILD_TARGET RUSTFLAGS
           BOURSE_NATIVE_PREBUILT_DIR)

  setup do
    dir = Bourse.TempPath.new("bourse_native_test")
    env = for name <- @vars, into: %{}, do: {name, System.get_env(name)}
    config = Application.get_env(:bourse, :native_prebuilt_dir)
    Mix.shell(Mix.Shell.Process)

    on_exit(fn ->
      Mix.shell(Mix.Shell.IO)
      File.rm_rf!(dir)
      Application.put_env(:bourse, :native_prebuilt_dir, config)
      if config == nil, do: Application.delete_env(:bourse, :native_prebuilt_dir)

      Enum.each(env, fn
        {name, nil} -> System.delete_env(name)
        {name, value} -> System.put_env(name, value)
      end)
    end)

    bin = Path.join(dir, "bin")
    project = Path.join(dir, "project")
    release = Path.join([dir, "target", "release"])
    Enum.each([bin, release, Path.join(project, "native/core/src")], &File.mkdir_p!/1)
    File.write!(Path.join(project, "Cargo.toml"), "[workspace]\n")
    File.write!(Path.join(project, "native/core/src/lib.rs"), "// v1\n")

    # A project of its own, so that the fingerprint goes to its build directory.
    module = "NativeFixture#{System.unique_integer([:positive])}.MixProject"

    File.write!(Path.join(project, "mix.exs"), """
    defmodule #{module} do
      use Mix.Project
      def project, do: [app: :bourse, version: "#{Mix.Project.config()[:version]}"]
    end
    """)

    Enum.each(~w(RUSTFLAGS CARGO_BUILD_TARGET_DIR CARGO_BUILD_TARGET), &System.delete_env/1)
    System.delete_env("BOURSE_NATIVE_PREBUILT_DIR")
    Application.delete_env(:bourse, :native_prebuilt_dir)
    System.put_env("PATH", bin)
    System.put_env("CARGO_TARGET_DIR", Path.join(dir, "target"))
    File.write!(Path.join(release, "libbourse_nif.so"), "nif v1")
    File.write!(Path.join(release, "bourse_daemon"), "daemon v1")
    %{dir: dir, bin: bin, project: project, release: release}
  end

  # Runs `fun` in the fixture project, as Mix runs a dependency's compilers.
  defp in_project(%{project: project}, fun) do
    Mix.Project.in_project(:bourse, project, fn _ -> fun.() end)
  after
    # Leaving a project makes the next message of Mix.shell() name the project below it:
    # other tests of this VM would read "==> bourse" first.
    Mix.Shell.printable_app_name()
  end

  defp compile(ctx, args \\ []), do: in_project(ctx, fn -> BourseNative.run(args) end)

  # A fake cargo that appends its arguments to cargo.log and exits with `status`.
  defp fake_cargo(%{bin: bin}, status) do
    File.write!(
      Path.join(bin, "cargo"),
      "#!/bin/sh\necho \"$@\" >> ../cargo.log\nexit #{status}\n"
    )

    File.chmod!(Path.join(bin, "cargo"), 0o755)
  end

  defp cargo_runs(%{dir: dir}) do
    case File.read(Path.join(dir, "cargo.log")) do
      {:ok, log} -> length(String.split(log, "\n", trim: true))
      {:error, :enoent} -> 0
    end
  end

  defp priv(%{project: project}, name), do: Path.join([project, "priv/native", name])

  defp package(ctx, output) do
    File.write!(
      Path.join(ctx.bin, "rustc"),
      "#!/bin/sh\necho 'host: #{Prebuilt.beam_target()}'\n"
    )

    File.chmod!(Path.join(ctx.bin, "rustc"), 0o755)
    in_project(ctx, fn -> Package.run(["--output", output]) end)
  end

  describe "from source" do
    test "runs cargo and installs the artifacts into priv/native", ctx do
      fake_cargo(ctx, 0)

      assert compile(ctx) == {:ok, []}

      assert File.read!(Path.join(ctx.dir, "cargo.log")) ==
               "build --release --locked -p bourse_nif -p bourse_daemon " <>
                 "--target-dir #{Path.join(ctx.dir, "target")}\n"

      assert File.read!(priv(ctx, "libbourse_nif.so")) == "nif v1"
      assert File.read!(priv(ctx, "bourse_daemon")) == "daemon v1"
      assert Bitwise.band(File.stat!(priv(ctx, "bourse_daemon")).mode, 0o777) == 0o755
      assert_received {:mix_shell, :info, ["Installed priv/native/libbourse_nif.so"]}
    end

    # Cargo is told where to build, so the artifacts are copied from where it built them.
    test "honours CARGO_BUILD_TARGET_DIR and CARGO_BUILD_TARGET", ctx do
      fake_cargo(ctx, 0)
      System.delete_env("CARGO_TARGET_DIR")
      elsewhere = Path.join(ctx.dir, "elsewhere")
      System.put_env("CARGO_BUILD_TARGET_DIR", elsewhere)

      for {triple, release, version} <- [
            {nil, Path.join(elsewhere, "release"), "v2"},
            {"x86_64-unknown-linux-gnu",
             Path.join([elsewhere, "x86_64-unknown-linux-gnu", "release"]), "v3"}
          ] do
        if triple, do: System.put_env("CARGO_BUILD_TARGET", triple)
        File.mkdir_p!(release)
        File.write!(Path.join(release, "libbourse_nif.so"), "nif #{version}")
        File.write!(Path.join(release, "bourse_daemon"), "daemon #{version}")

        assert compile(ctx) == {:ok, []}
        assert File.read!(priv(ctx, "libbourse_nif.so")) == "nif #{version}"
        assert File.read!(priv(ctx, "bourse_daemon")) == "daemon #{version}"
      end

      assert File.read!(Path.join(ctx.dir, "cargo.log")) =~ "--target-dir #{elsewhere}\n"
    end

    test "runs no cargo and prints nothing while no build input changed", ctx do
      fake_cargo(ctx, 0)
      assert compile(ctx) == {:ok, []}
      assert cargo_runs(ctx) == 1
      flush_shell()

      assert compile(ctx) == {:noop, []}
      assert compile(ctx) == {:noop, []}
      assert cargo_runs(ctx) == 1
      refute_received {:mix_shell, _, _}

      # Tests, benches and examples are not built by `cargo build -p ...`.
      File.mkdir_p!(Path.join(ctx.project, "native/core/tests"))
      File.write!(Path.join(ctx.project, "native/core/tests/t.rs"), "// test\n")
      assert compile(ctx) == {:noop, []}
      assert cargo_runs(ctx) == 1
    end

    test "runs cargo again when a source, Cargo.toml, a setting or an artifact changed", ctx do
      fake_cargo(ctx, 0)
      assert compile(ctx) == {:ok, []}

      changes = [
        fn -> File.write!(Path.join(ctx.project, "native/core/src/lib.rs"), "// v2\n") end,
        fn -> File.write!(Path.join(ctx.project, "native/core/src/new.rs"), "// new\n") end,
        fn -> File.write!(Path.join(ctx.project, "Cargo.toml"), "[workspace]\n# edited\n") end,
        fn -> File.write!(Path.join(ctx.project, "Cargo.lock"), "version = 4\n") end,
        fn -> System.put_env("RUSTFLAGS", "-C target-cpu=native") end,
        fn -> File.rm!(priv(ctx, "bourse_daemon")) end
      ]

      for {change, runs} <- Enum.with_index(changes, 2) do
        change.()
        compile(ctx)
        assert cargo_runs(ctx) == runs
        assert compile(ctx) == {:noop, []}
        assert cargo_runs(ctx) == runs
      end

      assert File.read!(priv(ctx, "bourse_daemon")) == "daemon v1"

      File.write!(Path.join(ctx.release, "bourse_daemon"), "daemon v2")
      assert compile(ctx, ["--force"]) == {:ok, []}
      assert File.read!(priv(ctx, "bourse_daemon")) == "daemon v2"
    end

    test "mix clean removes the artifacts and the fingerprint", ctx do
      fake_cargo(ctx, 0)
      assert compile(ctx) == {:ok, []}
      in_project(ctx, fn -> BourseNative.clean() end)
      assert File.ls!(Path.join(ctx.project, "priv/native")) == []
      assert compile(ctx) == {:ok, []}
      assert cargo_runs(ctx) == 2
    end

    test "a failing cargo, or none, is a clear Mix error", ctx do
      assert_raise Mix.Error, ~r/cargo not found.*BOURSE_NATIVE_PREBUILT_DIR/, fn ->
        compile(ctx)
      end

      fake_cargo(ctx, 101)
      assert_raise Mix.Error, ~r/failed \(exit 101\)/, fn -> compile(ctx) end

      fake_cargo(ctx, 0)
      File.rm!(Path.join(ctx.release, "libbourse_nif.so"))
      assert_raise Mix.Error, ~r/cargo built no .*libbourse_nif/, fn -> compile(ctx) end
    end
  end

  describe "prebuilt" do
    setup ctx do
      fake_cargo(ctx, 0)
      prebuilt = Path.join(ctx.dir, "prebuilt")
      package(ctx, prebuilt)
      # From here on, a cargo run is a failure.
      fake_cargo(ctx, 1)
      File.rm!(Path.join(ctx.dir, "cargo.log"))
      %{prebuilt: prebuilt}
    end

    test "mix bourse.native.package refuses flags it does not know, building nothing", ctx do
      for args <- [["--ouput", "x"], ["--output"], ["--bogus"], ["extra"]] do
        assert_raise Mix.Error, "usage: mix bourse.native.package [--output DIR]", fn ->
          in_project(ctx, fn -> Package.run(args) end)
        end
      end

      assert cargo_runs(ctx) == 0
    end

    test "mix bourse.native.package writes the artifacts and their manifest", ctx do
      assert File.read!(Path.join(ctx.prebuilt, "libbourse_nif.so")) == "nif v1"

      assert Bitwise.band(File.stat!(Path.join(ctx.prebuilt, "bourse_daemon")).mode, 0o777) ==
               0o755

      {:ok, terms} = :file.consult(Path.join(ctx.prebuilt, "bourse_native.manifest"))
      sha = Base.encode16(:crypto.hash(:sha256, "daemon v1"), case: :lower)
      assert {:artifact, ~c"bourse_daemon", String.to_charlist(sha)} in terms
      assert {:target, String.to_charlist(Prebuilt.beam_target())} in terms
      assert {:nif_version, :erlang.system_info(:nif_version)} in terms
    end

    test "are installed without cargo, from the environment or the config", ctx do
      System.put_env("BOURSE_NATIVE_PREBUILT_DIR", ctx.prebuilt)
      assert compile(ctx) == {:ok, []}
      assert File.read!(priv(ctx, "bourse_daemon")) == "daemon v1"
      assert compile(ctx) == {:noop, []}
      assert cargo_runs(ctx) == 0

      System.delete_env("BOURSE_NATIVE_PREBUILT_DIR")
      File.rm!(priv(ctx, "libbourse_nif.so"))
      Application.put_env(:bourse, :native_prebuilt_dir, ctx.prebuilt)
      assert compile(ctx) == {:ok, []}
      assert File.read!(priv(ctx, "libbourse_nif.so")) == "nif v1"
      assert cargo_runs(ctx) == 0
    end

    test "are refused, saying why, when they do not match", ctx do
      System.put_env("BOURSE_NATIVE_PREBUILT_DIR", ctx.prebuilt)
      manifest = Path.join(ctx.prebuilt, "bourse_native.manifest")
      original = File.read!(manifest)
      nif = List.to_string(:erlang.system_info(:nif_version))
      [major, minor] = String.split(nif, ".")
      newer = "#{major}.#{String.to_integer(minor) + 1}"
      older = "#{major}.#{String.to_integer(minor) - 1}"

      refusals = [
        {~s({nif_version,"#{nif}"}), ~s({nif_version,"#{newer}"}),
         ~r/built for NIF version "#{newer}" .* provides NIF version #{nif}\. Unset BOURSE_NATIVE_PREBUILT_DIR/},
        {~s({nif_version,"#{nif}"}), ~s({nif_version,"#{String.to_integer(major) + 1}.0"}),
         ~r/built for NIF version/},
        {~s({target,"#{Prebuilt.beam_target()}"}), ~s({target,"riscv64gc-unknown-linux-gnu"}),
         ~r/built for target "riscv64gc-unknown-linux-gnu", this machine is "#{Prebuilt.beam_target()}"/},
        {"{format,1}", "{format,0}", ~r/not of format 1/},
        {~s({bourse_version,"), ~s({bourse_version,"9), ~r/they are :bourse "90/}
      ]

      for {from, to, message} <- refusals do
        File.write!(manifest, String.replace(original, from, to))
        assert_raise Mix.Error, message, fn -> compile(ctx) end
        refute File.exists?(priv(ctx, "libbourse_nif.so"))
      end

      # An older NIF minor version loads in this VM.
      File.write!(
        manifest,
        String.replace(original, ~s({nif_version,"#{nif}"}), ~s({nif_version,"#{older}"}))
      )

      assert compile(ctx) == {:ok, []}
      assert cargo_runs(ctx) == 0
    end

    test "are refused when an artifact, the manifest or the sources changed", ctx do
      System.put_env("BOURSE_NATIVE_PREBUILT_DIR", ctx.prebuilt)
      File.write!(Path.join(ctx.prebuilt, "bourse_daemon"), "daemon tampered")

      assert_raise Mix.Error, ~r/SHA-256 of bourse_daemon is .* changed or damaged/, fn ->
        compile(ctx)
      end

      File.write!(Path.join(ctx.prebuilt, "bourse_daemon"), "daemon v1")
      assert compile(ctx) == {:ok, []}

      File.write!(Path.join(ctx.project, "native/core/src/lib.rs"), "// v2\n")
      assert_raise Mix.Error, ~r/built from other Rust sources/, fn -> compile(ctx) end

      File.rm!(Path.join(ctx.prebuilt, "bourse_native.manifest"))
      assert_raise Mix.Error, ~r/cannot read its bourse_native.manifest/, fn -> compile(ctx) end

      System.put_env("BOURSE_NATIVE_PREBUILT_DIR", "relative/dir")
      assert_raise Mix.Error, ~r/must be an absolute path/, fn -> compile(ctx) end
      assert cargo_runs(ctx) == 0
    end
  end

  test "the target triple of an Erlang VM, in Rust's words" do
    assert Prebuilt.rust_target("x86_64-pc-linux-gnu") == "x86_64-unknown-linux-gnu"
    assert Prebuilt.rust_target("aarch64-unknown-linux-gnu") == "aarch64-unknown-linux-gnu"
    assert Prebuilt.rust_target("x86_64-pc-linux-musl") == "x86_64-unknown-linux-musl"
    assert Prebuilt.rust_target("aarch64-apple-darwin22.4.0") == "aarch64-apple-darwin"
    assert Prebuilt.rust_target("x86_64-apple-darwin21.6.0") == "x86_64-apple-darwin"
  end

  defp flush_shell do
    receive do
      {:mix_shell, _, _} -> flush_shell()
    after
      0 -> :ok
    end
  end
end
