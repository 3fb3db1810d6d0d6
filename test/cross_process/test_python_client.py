"""Tests of clients/python/bourse_client.py against a real bourse_daemon.

Run: python3 -m unittest discover -s test/cross_process -v
The daemon binary is $BOURSE_DAEMON, else target/{debug,release}/bourse_daemon, else it is
built with `cargo build -p bourse_daemon`.
"""

import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))

from bourse_client import BourseClient, BourseError, RateLimitExceeded, key  # noqa: E402

SLOW = {"capacity": 30, "refill_per_sec": 0.001}  # nothing refills during a test


def daemon_binary() -> str:
    if os.environ.get("BOURSE_DAEMON"):
        return os.environ["BOURSE_DAEMON"]
    for profile in ("debug", "release"):
        candidate = ROOT / "target" / profile / "bourse_daemon"
        if candidate.exists():
            return str(candidate)
    subprocess.run(["cargo", "build", "-q", "-p", "bourse_daemon"], cwd=ROOT, check=True)
    return str(ROOT / "target" / "debug" / "bourse_daemon")


SECRET = b"python-test-secret-0123"


class Daemon:
    """A daemon on a free loopback port and a Unix socket, stopped with SIGTERM."""

    def __init__(self, *extra: str):
        self.dir = tempfile.TemporaryDirectory()
        self.socket = os.path.join(self.dir.name, "bourse.sock")
        self.process = subprocess.Popen(
            [daemon_binary(), "--listen", "127.0.0.1:0", "--socket", self.socket, *extra],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            env={**os.environ, "BOURSE_DAEMON_SECRET": SECRET.decode()})
        tcp = self.process.stdout.readline().split()
        unix = self.process.stdout.readline().split()
        assert tcp[:2] == ["listening", "tcp"] and unix[:2] == ["listening", "unix"], (tcp, unix)
        host, port = tcp[2].rsplit(":", 1)
        self.tcp = (host, int(port))

    def stop(self) -> int:
        self.process.terminate()
        code = self.process.wait(timeout=30)
        self.process.stdout.close()
        self.dir.cleanup()
        return code


# Run by child processes in the cross-process test: checks one shared key 20 times.
WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
from bourse_client import BourseClient
with BourseClient(sys.argv[2]) as limiter:
    limit = {"capacity": 30, "refill_per_sec": 0.001}
    print(sum(limiter.check("shared", "k", limit).admitted for _ in range(20)))
"""


class BourseClientTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon("--booking-slack-ms", "5000")
        self.client = BourseClient(self.daemon.tcp, secret=SECRET)

    def tearDown(self):
        self.client.close()
        self.assertEqual(self.daemon.stop(), 0)

    def test_hello_over_tcp_and_unix(self):
        self.assertTrue(self.client.server.startswith("bourse_daemon "))
        with BourseClient(self.daemon.socket) as unix:
            self.assertEqual(unix.hello()["protocol"], 1)

    def test_probe_admits_then_delays_without_paying(self):
        limit = {"capacity": 2, "refill_per_sec": 0.001}
        self.assertTrue(self.client.check("binance", "k", limit).admitted)
        self.assertEqual(self.client.check("binance", "k", limit).result, "admitted")
        refused = self.client.check("binance", "k", limit)
        self.assertEqual(refused.result, "delay")
        self.assertFalse(refused.admitted)
        self.assertGreater(refused.ms, 900_000)
        self.assertAlmostEqual(self.client.get_cost("binance", "k"), 2.0, places=2)
        self.assertTrue(self.client.check("binance", "k", None, cost=100).admitted)

    def test_wait_books_sleeps_and_claims(self):
        limit = {"capacity": 1, "refill_per_sec": 20}
        self.assertTrue(self.client.check("binance", None, limit).admitted)
        waited = self.client.wait("binance", None, limit, max_wait_ms=10_000)
        self.assertGreater(waited, 0)
        stats = self.client.stats()
        self.assertEqual(stats["bookings"], 0)
        self.assertGreaterEqual(stats["claimed"] + stats["admitted"], 2)

    def test_wait_over_budget_pays_nothing(self):
        with self.assertRaises(RateLimitExceeded) as raised:
            self.client.wait("binance", "k", SLOW, cost=31, max_wait_ms=10)
        self.assertGreater(raised.exception.retry_after, 10)
        self.assertEqual(self.client.stats()["over_budget"], 1)
        self.assertEqual(self.client.get_cost("binance", "k"), 0)

    def test_check_many_record_pause_reset(self):
        checks = [(key("okx", "k"), SLOW, 10), (key("okx", "k", "ip"), SLOW, 30)]
        self.assertTrue(self.client.check_many(checks).admitted)
        self.assertEqual(self.client.check_many(checks).result, "delay")
        self.client.record("okx", "k", cost=5)
        self.assertAlmostEqual(self.client.get_cost("okx", "k"), 15, places=2)
        info = self.client.inspect("okx", "k")
        self.assertEqual(info["limit"], {"capacity": 30.0, "refill_per_sec": 0.001})
        self.assertIsNone(self.client.inspect("nowhere", None))
        self.assertEqual(self.client.busiest(1)[0]["key"]["axis"], "ip")

        self.client.pause("kraken", 60_000, credential=None)
        self.assertEqual(self.client.check("kraken", None, SLOW).result, "delay")
        self.assertTrue(self.client.check("kraken", "k", SLOW).admitted)
        self.client.pause("kraken", 60_000, credential="k", axis="request")
        self.assertGreater(self.client.inspect("kraken", "k")["pause_ms"], 0)
        self.client.reset_exchange("kraken")
        self.assertTrue(self.client.check("kraken", None, SLOW).admitted)

        self.client.reset("okx", "k", "ip")
        self.assertIsNone(self.client.inspect("okx", "k", "ip"))
        self.client.reset_all()
        self.assertEqual(self.client.stats()["buckets"], 0)
        self.assertGreaterEqual(self.client.sweep(), 0)

    def test_errors_raise(self):
        with self.assertRaises(BourseError) as raised:
            self.client.check("binance", "k", {"capacity": -1, "refill_per_sec": 1})
        self.assertEqual(raised.exception.type, "invalid_parameters")
        self.assertIn("capacity", raised.exception.message)
        with self.assertRaises(BourseError):
            self.client.check("binance", "k", SLOW, max_wait_ms=0)
        with self.assertRaises(ValueError):
            self.client.check("binance", "k", SLOW, cost=float("nan"))
        self.assertEqual(self.client.stats()["invalid"], 2)

    def test_processes_share_one_bucket(self):
        workers = [
            subprocess.Popen([sys.executable, "-c", WORKER, str(ROOT / "clients" / "python"),
                              self.daemon.socket], stdout=subprocess.PIPE, text=True)
            for _ in range(4)
        ]
        admitted = sum(int(worker.communicate(timeout=60)[0]) for worker in workers)
        self.assertEqual(admitted, 30)


if __name__ == "__main__":
    unittest.main()
