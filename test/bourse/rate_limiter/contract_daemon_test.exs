defmodule Bourse.RateLimiter.ContractDaemonTest do
  # The whole contract (docs/CONTRACT.md) through the public API, with the buckets in one shared
  # bourse_daemon server on loopback TCP. Every limiter of the module connects to it, so
  # the tests run one at a time on a table cleared before each. It runs with the default
  # booking slack (each limiter's waiters name their own) and sweeps as often as the
  # limiters of the sweep tests do; the tests of limiters with buckets of their own do not
  # apply.
  use Bourse.ContractTests,
    backend: {:daemon, "set in setup_all"},
    async: false,
    skip: [:own_table]

  alias Bourse.DaemonServer

  setup_all do
    daemon = DaemonServer.start(["--listen", "127.0.0.1:0", "--sweep-interval-ms", "10"])

    on_exit(fn -> DaemonServer.stop(daemon) end)
    # Overrides the module's :backend tag for every test.
    %{backend: {:daemon, daemon.tcp}}
  end

  setup %{name: name} do
    assert :ok = Bourse.RateLimiter.reset_all(name)
    :ok
  end
end
