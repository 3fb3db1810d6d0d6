defmodule Mix.Tasks.Compile.BourseNativeTest do
  # Changes the working directory, PATH and CARGO_TARGET_DIR.
  use ExUnit.Case, async: false

  alias Mix.Tasks.Compile.BourseNative

  setup do
    dir = Path.join(System.tmp_dir!(), "bourse_native_test_#{System.unique_integer([:positive])}")
    env = for name <- ~w(PATH CARGO_TARGET_DIR), into: %{}, do: {name, System.get_env(name)}
    cwd = File.cwd!()
    Mix.shell(Mix.Shell.Process)

    on_exit(fn ->
      Mix.shell(Mix.Shell.IO)
      File.cd!(cwd)
      File.rm_rf!(dir)

      Enum.each(env, fn
        {name, nil} -> System.delete_env(name)
        {name, value} -> System.put_env(name, value)
      end)
    end)

    bin = Path.join(dir, "bin")
    target = Path.join(dir, "target")
    File.mkdir_p!(bin)
    File.mkdir_p!(Path.join(target, "release"))
    File.mkdir_p!(Path.join(dir, "project"))
    File.cd!(Path.join(dir, "project"))
    System.put_env("PATH", bin)
    System.put_env("CARGO_TARGET_DIR", target)
    %{bin: bin, release: Path.join(target, "release")}
  end

  # A fake cargo that logs its arguments and exits with `status`.
  defp fake_cargo(bin, status) do
    File.write!(
      Path.join(bin, "cargo"),
      "#!/bin/sh\necho \"$@\" > ../cargo.args\nexit #{status}\n"
    )

    File.chmod!(Path.join(bin, "cargo"), 0o755)
  end

  test "runs cargo, installs changed artifacts into priv/native", %{bin: bin, release: release} do
    fake_cargo(bin, 0)
    File.write!(Path.join(release, "libbourse_nif.so"), "nif v1")
    File.write!(Path.join(release, "bourse_daemon"), "daemon v1")

    assert BourseNative.run([]) == {:ok, []}

    assert File.read!("../cargo.args") ==
             "build --release --locked -p bourse_nif -p bourse_daemon\n"

    assert File.read!("priv/native/libbourse_nif.so") == "nif v1"
    assert File.read!("priv/native/bourse_daemon") == "daemon v1"
    assert Bitwise.band(File.stat!("priv/native/bourse_daemon").mode, 0o777) == 0o755
    assert_received {:mix_shell, :info, ["Installed priv/native/libbourse_nif.so"]}

    assert BourseNative.run([]) == {:noop, []}

    File.write!(Path.join(release, "bourse_daemon"), "daemon v2")
    assert BourseNative.run([]) == {:ok, []}
    assert File.read!("priv/native/bourse_daemon") == "daemon v2"
    assert File.ls!("priv/native") |> Enum.sort() == ["bourse_daemon", "libbourse_nif.so"]

    BourseNative.clean()
    assert File.ls!("priv/native") == []
  end

  test "a failing cargo, or none, is a clear Mix error", %{bin: bin} do
    assert_raise Mix.Error, ~r/cargo not found/, fn -> BourseNative.run([]) end

    fake_cargo(bin, 101)
    assert_raise Mix.Error, ~r/failed \(exit 101\)/, fn -> BourseNative.run([]) end

    fake_cargo(bin, 0)
    assert_raise Mix.Error, ~r/cargo built no .*libbourse_nif/, fn -> BourseNative.run([]) end
  end
end
