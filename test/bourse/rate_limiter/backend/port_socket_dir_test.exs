defmodule Bourse.RateLimiter.Backend.PortSocketDirTest do
  # The port's daemon connects to a Unix socket in a private directory under the system's
  # temporary directory, whose path may be too long for a socket's (107 bytes): then the
  # directory goes under /tmp. Not async: it sets TMPDIR, which every test reads.
  use ExUnit.Case, async: false

  alias Bourse.RateLimiter

  @wide %{capacity: 1.0e9, refill_per_sec: 1.0e9}

  setup do
    previous = System.get_env("TMPDIR")
    root = Path.join("/tmp", "bourse-tmpdir-#{System.unique_integer([:positive])}")
    on_exit(fn -> restore(previous) && File.rm_rf!(root) end)
    %{root: root}
  end

  defp restore(nil), do: System.delete_env("TMPDIR")
  defp restore(previous), do: System.put_env("TMPDIR", previous)

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
end
