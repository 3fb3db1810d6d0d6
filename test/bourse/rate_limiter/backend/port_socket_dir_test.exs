defmodule Bourse.RateLimiter.Backend.PortSocketDirTest do
  # The port's daemon connects to a Unix socket in a private directory under the system's
  # temporary directory, whose path may be too long for a socket's (107 bytes): then the
  # directory goes under /tmp. The directory is kept only once it is private and empty
  # (another OS user may put entries in it before its mode is set); under a runtime
  # directory only this user may enter ($XDG_RUNTIME_DIR), no one can. Not async: it sets
  # TMPDIR and XDG_RUNTIME_DIR, which every test reads.
  use ExUnit.Case, async: false

  import Bourse.BackendCase, only: [daemon_command_lines: 1]

  alias Bourse.RateLimiter
  alias Bourse.RateLimiter.Backend.Connection.PrivateDir

  @wide %{capacity: 1.0e9, refill_per_sec: 1.0e9}

  setup do
    previous = for name <- ["TMPDIR", "XDG_RUNTIME_DIR"], do: {name, System.get_env(name)}
    System.delete_env("XDG_RUNTIME_DIR")

    root =
      Path.join("/tmp", "bourse-tmpdir-#{System.pid()}-#{System.unique_integer([:positive])}")

    on_exit(fn ->
      Enum.each(previous, &restore/1)
      File.rm_rf!(root)
    end)

    %{root: root}
  end

  defp restore({name, nil}), do: System.delete_env(name)
  defp restore({name, previous}), do: System.put_env(name, previous)

  test "a private runtime directory holds the socket's directory; one open to others does not",
       %{root: root} do
    for {mode, chosen?} <- [{0o700, true}, {0o755, false}] do
      runtime = Path.join(root, "run#{mode}")
      File.mkdir_p!(runtime)
      File.chmod!(runtime, mode)
      System.put_env("XDG_RUNTIME_DIR", runtime)
      name = :"port_runtime_dir_#{mode}"
      {:ok, pid} = RateLimiter.start_link(name: name, backend: :port)
      assert :ok = RateLimiter.check_rate({"ex", "k"}, @wide, 1, name)
      assert daemon_command_lines(runtime) != [] == chosen?, inspect(mode, base: :octal)
      GenServer.stop(pid)
    end
  end

  test "root does not use a private runtime directory another user owns", %{root: root} do
    runtime = Path.join(root, "run-other")
    File.mkdir_p!(runtime)
    File.chmod!(runtime, 0o700)

    if File.chown(runtime, 65_534) == :ok do
      System.put_env("XDG_RUNTIME_DIR", runtime)
      {:ok, pid} = RateLimiter.start_link(name: :port_runtime_dir_other, backend: :port)
      assert :ok = RateLimiter.check_rate({"ex", "k"}, @wide, 1, :port_runtime_dir_other)
      assert daemon_command_lines(runtime) == []
      assert File.ls!(runtime) == []
      GenServer.stop(pid)
    end
  end

  test "a temporary directory of any length: the port starts, and leaves nothing behind", %{
    root: root
  } do
    for length <- [76, 77, 90, 200] do
      tmpdir = root <> "/" <> String.duplicate("d", length - byte_size(root) - 1)
      File.mkdir_p!(tmpdir)
      System.put_env("TMPDIR", tmpdir)
      name = :"port_socket_dir_#{length}"

      assert {:ok, pid} = RateLimiter.start_link(name: name, backend: :port),
             "TMPDIR of #{byte_size(tmpdir)} bytes"

      assert :ok = RateLimiter.check_rate({"ex", "k"}, @wide, 1, name)
      GenServer.stop(pid)
      assert File.ls!(tmpdir) == []
    end
  end

  test "a directory is private only as an empty, real directory of mode 0700", %{root: root} do
    File.mkdir_p!(root)
    assert {:ok, dir} = PrivateDir.create(root)
    assert %File.Stat{type: :directory, mode: mode} = File.lstat!(dir)
    assert Bitwise.band(mode, 0o777) == 0o700
    assert PrivateDir.verify(dir) == :ok

    # What another user could have put there before the mode was set.
    File.write!(Path.join(dir, "d.sock"), "")
    File.mkdir!(Path.join(dir, "sub"))
    assert {:error, message} = PrivateDir.verify(dir)

    assert message ==
             "#{dir} holds d.sock, sub that another OS user put there before it was made private"

    PrivateDir.discard(dir)
    refute File.exists?(dir)

    # A name that is not UTF-8 (which File.ls/1 leaves out) is seen, and removed.
    assert {:ok, dir} = PrivateDir.create(root)
    :ok = :file.write_file(Path.join(dir, <<255>>), "")
    assert {:error, message} = PrivateDir.verify(dir)
    assert message =~ "#{dir} holds <<255>> that another OS user"
    PrivateDir.discard(dir)
    refute File.exists?(dir)

    open = Path.join(root, "open")
    File.mkdir!(open)
    File.chmod!(open, 0o777)
    assert PrivateDir.verify(open) == {:error, "#{open} has mode 0o777, not 0o700"}

    target = Path.join(root, "target")
    File.mkdir!(target)
    File.chmod!(target, 0o700)
    File.write!(Path.join(target, "kept"), "")
    link = Path.join(root, "link")
    File.ln_s!(target, link)
    assert PrivateDir.verify(link) == {:error, "#{link} is no longer a directory (symlink)"}
    # A link is never followed: what it points to stays.
    PrivateDir.discard(link)
    assert File.ls!(target) == ["kept"]
  end

  @tag :capture_log
  test "a failed start leaves nothing behind", %{root: root} do
    File.mkdir_p!(root)
    System.put_env("TMPDIR", root)
    backend = {:redis, "redis://127.0.0.1:6379/notanumber"}

    assert {:error, %Bourse.Error{}} =
             RateLimiter.start_link(name: :port_socket_dir_failed, backend: backend)

    assert File.ls!(root) == []
  end
end
