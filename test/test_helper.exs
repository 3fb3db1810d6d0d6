# A message a test waits for may be late on a loaded machine: wait up to 2 s, not 100 ms.
# Failures are repeated at the end of the run, where a long run's tail shows them.
ExUnit.start(
  assert_receive_timeout: 2_000,
  formatters: [ExUnit.CLIFormatter, Bourse.FailureSummary]
)

# The secret the test daemons prove (Bourse.DaemonServer), where the daemon backend reads
# it, whichever test runs first.
System.put_env("BOURSE_DAEMON_SECRET", Bourse.DaemonServer.secret())
