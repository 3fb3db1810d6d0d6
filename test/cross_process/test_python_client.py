"""Tests of clients/python/bourse_client.py against a real bourse_daemon.

Run: python3 -m unittest discover -s test/cross_process -v
The daemon binary is $BOURSE_DAEMON, else target/{debug,release}/bourse_daemon, else it is
built with `cargo build -p bourse_daemon`.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path


def stop(pid):
    """SIGSTOPs `pid` and waits until it is stopped (the signal takes effect a little later)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))

from bourse_client import BourseClient, BourseError, RateLimitExceeded, key  # noqa: E402

SLOW = {"capacity": 30, "refill_per_sec": 0.001}  # nothing refills during a test


def closes_at_the_65th_timeout(test, call):
    """64 calls time out and leave the client usable; the 65th closes it."""
    for _ in range(65):
        with test.assertRaises(TimeoutError):
            call()
    with test.assertRaisesRegex(ConnectionError, "closed"):
        call()


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

    def __init__(self, *extra: str, secret: bytes = SECRET):
        self.dir = tempfile.TemporaryDirectory()
        self.socket = os.path.join(self.dir.name, "bourse.sock")
        self.process = subprocess.Popen(
            [daemon_binary(), "--listen", "127.0.0.1:0", "--socket", self.socket, *extra],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            env={**os.environb, b"BOURSE_DAEMON_SECRET": secret})
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

    def test_busy_since_starts_new_buckets_as_if_empty_then(self):
        limit = {"capacity": 10, "refill_per_sec": 1}
        self.assertTrue(self.client.check("binance", "held", limit).admitted)
        since = time.monotonic() - 4
        with BourseClient(self.daemon.tcp, secret=SECRET, busy_since=since) as busy:
            # 4 of 10 tokens accrued since its start; a bucket the daemon held is as it was.
            self.assertTrue(busy.check("binance", "new", limit, cost=4).admitted)
            self.assertEqual(busy.check("binance", "new", limit).result, "delay")
            self.assertTrue(busy.check("binance", "held", limit, cost=9).admitted)
        self.assertTrue(self.client.check("binance", "other", limit, cost=10).admitted)

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

    def test_sync_back_off_and_reset_backoff(self):
        limit = {"capacity": 100, "refill_per_sec": 0.001}
        self.assertTrue(self.client.check("bybit", "k", limit, cost=10).admitted)
        # The exchange allows 30 more until its window ends: 60 of the 90 tokens are taken.
        self.assertAlmostEqual(self.client.sync("bybit", "k", 30, 1000), 60, places=1)
        self.assertEqual(self.client.check("bybit", "k", limit, cost=31).result, "delay")
        # Never raised; a key the table does not hold is left alone.
        self.assertEqual(self.client.sync("bybit", "k", 1000, 1000), 0)
        self.assertEqual(self.client.sync("bybit", "other", 0, 1000), 0)

        self.assertEqual(self.client.back_off("bybit", "k"), 1000)
        self.assertEqual(self.client.check("bybit", "k", limit).result, "delay")
        self.assertTrue(self.client.check("bybit", "j", limit).admitted)
        self.assertEqual(self.client.back_off("bybit", None, scope="exchange"), 1000)
        self.assertEqual(self.client.check("bybit", "j", limit).result, "delay")
        self.client.reset_backoff("bybit", "k")
        with self.assertRaises(BourseError) as raised:
            self.client.back_off("bybit", "k", scope="everything")
        self.assertEqual(raised.exception.type, "invalid_parameters")
        # Refused in the client (bytes are not JSON): the error names the exchange too.
        with self.assertRaises(BourseError) as raised:
            self.client.back_off("bybit", b"K")
        self.assertEqual(raised.exception.exchange, "bybit")

    def test_a_secret_in_the_environment_is_bytes_as_the_daemon_reads_it(self):
        raw = b"python-\xff\xfe-secret-0123456789"
        daemon = Daemon(secret=raw)
        saved = os.environb.get(b"BOURSE_DAEMON_SECRET")
        os.environb[b"BOURSE_DAEMON_SECRET"] = raw
        try:
            with BourseClient(daemon.tcp) as client:
                self.assertTrue(client.check("e", "k", SLOW).admitted)
        finally:
            if saved is None:
                del os.environb[b"BOURSE_DAEMON_SECRET"]
            else:
                os.environb[b"BOURSE_DAEMON_SECRET"] = saved
            self.assertEqual(daemon.stop(), 0)

    def test_errors_raise(self):
        with self.assertRaises(BourseError) as raised:
            self.client.check("binance", "k", {"capacity": -1, "refill_per_sec": 1})
        self.assertEqual(raised.exception.type, "invalid_parameters")
        self.assertIn("capacity", raised.exception.message)
        with self.assertRaises(BourseError):
            self.client.check("binance", "k", SLOW, max_wait_ms=0)
        for cost in (float("nan"), float("inf"), {1}):
            with self.assertRaises(BourseError) as raised:
                self.client.check("binance", "k", SLOW, cost=cost)
            self.assertEqual(raised.exception.type, "invalid_parameters")
            self.assertIn("a value JSON cannot carry", raised.exception.message)
        with self.assertRaises(BourseError) as raised:
            self.client.check("binance", b"secret-bytes", SLOW)
        self.assertEqual(raised.exception.type, "invalid_parameters")
        self.assertNotIn("secret", raised.exception.message)
        self.assertTrue(self.client.check("binance", "k", SLOW).admitted)
        self.assertEqual(self.client.stats()["invalid"], 2)

    def test_processes_share_one_bucket(self):
        workers = [
            subprocess.Popen([sys.executable, "-c", WORKER, str(ROOT / "clients" / "python"),
                              self.daemon.socket], stdout=subprocess.PIPE, text=True)
            for _ in range(4)
        ]
        admitted = sum(int(worker.communicate(timeout=60)[0]) for worker in workers)
        self.assertEqual(admitted, 30)


class Interrupted(Exception):
    """Raised by a SIGALRM handler, as signal-based timeouts in bots do."""


class BourseClientFailureTest(unittest.TestCase):
    """What a bot meets: fork(), interrupted calls, a stopped daemon, pauses that outlast a
    waiter's budget, requests too large for a frame, something else on the address."""

    def setUp(self):
        self.daemon = Daemon()
        self.client = BourseClient(self.daemon.socket, timeout=5)

    def tearDown(self):
        self.client.close()
        try:
            os.kill(self.daemon.process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.assertEqual(self.daemon.stop(), 0)

    def test_a_forked_child_does_not_read_the_parents_answers(self):
        # Parent and child would share one connection and one sequence of ids: each could
        # be handed the other's answer (the child told "admitted" for a full bucket).
        self.client.check("x", "child", {"capacity": 1, "refill_per_sec": 0.001})
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                result = self.client.check("x", "child", SLOW).result
            except ConnectionError as error:
                result = "ConnectionError " + str(error)
            except BaseException as error:
                result = type(error).__name__
            os.write(write, result.encode())
            os._exit(0)
        os.close(write)
        self.assertTrue(self.client.check("x", "parent", None).admitted)
        os.waitpid(pid, 0)
        child = os.read(read, 1000).decode()
        os.close(read)
        self.assertTrue(child.startswith("ConnectionError"), child)
        self.assertIn("fork()", child)
        self.assertTrue(self.client.check("x", "parent", None).admitted)

    def test_an_interrupted_call_closes_the_client(self):
        # A call interrupted while it waits for its answer leaves that answer unread: the
        # client must not pair it with the next request.
        def interrupt(*_):
            raise Interrupted()
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            stop(self.daemon.process.pid)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with self.assertRaises(Interrupted):
                self.client.check("binance", "a", None)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            os.kill(self.daemon.process.pid, signal.SIGCONT)
        time.sleep(0.1)
        with self.assertRaises(ConnectionError):
            self.client.check("binance", "b", {"capacity": -1, "refill_per_sec": 1})
        with self.assertRaises(ConnectionError):
            self.client.check("binance", "c", None)

    def test_a_call_that_timed_out_is_not_run_when_the_daemon_resumes_and_the_client_goes_on(self):
        limit = {"capacity": 5, "refill_per_sec": 0.001}
        client = BourseClient(self.daemon.socket, timeout=0.5)
        stop(self.daemon.process.pid)
        started = time.monotonic()
        with self.assertRaises(TimeoutError):
            client.check("stopped", "k", limit, cost=5)
        self.assertLess(time.monotonic() - started, 1.5)
        os.kill(self.daemon.process.pid, signal.SIGCONT)
        time.sleep(0.2)
        self.assertEqual(self.client.get_cost("stopped", "k"), 0)
        # Its answer (an error: read too late to run) is read and dropped first.
        self.assertTrue(client.check("stopped", "k", limit, cost=5).admitted)
        self.assertAlmostEqual(client.get_cost("stopped", "k"), 5, places=2)
        client.close()

    def test_a_waiter_that_times_out_gives_its_booking_back_when_the_daemon_resumes(self):
        # Its booking's slack (50 ms) ends before the client's timeout: the claim is refused
        # as late, and the booking, lapsed, is given back (the daemon's docs/PROTOCOL.md,
        # `unbook`). Before, the bucket stayed a token short.
        daemon = Daemon("--booking-slack-ms", "50")
        self.addCleanup(daemon.stop)
        self.addCleanup(lambda: os.kill(daemon.process.pid, signal.SIGCONT))
        client = BourseClient(daemon.socket, timeout=0.3)
        self.addCleanup(client.close)
        limit = {"capacity": 10, "refill_per_sec": 1}
        self.assertTrue(client.check("unbook", "k", limit, cost=10).admitted)
        drained = time.monotonic()
        failed = []

        def wait():
            try:
                client.wait("unbook", "k", limit, max_wait_ms=5000)
            except TimeoutError as error:
                failed.append(error)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.4)
        stop(daemon.process.pid)
        waiter.join(10)
        self.assertEqual(len(failed), 1)
        os.kill(daemon.process.pid, signal.SIGCONT)
        checker = BourseClient(daemon.socket, timeout=5)
        self.addCleanup(checker.close)
        for _ in range(100):
            refilled = time.monotonic() - drained
            if 10 - checker.get_cost("unbook", "k") > refilled - 0.5:
                break
            time.sleep(0.02)
        else:
            self.fail(f"the booking was not given back: {checker.get_cost('unbook', 'k')} "
                      f"borrowed {refilled:.2f} s after the drain")

    def test_threads_sharing_a_client_each_end_within_its_timeout(self):
        client = BourseClient(self.daemon.socket, timeout=0.3)
        stop(self.daemon.process.pid)
        took = []

        def call():
            started = time.monotonic()
            with self.assertRaises(TimeoutError):
                client.check("stopped", "k", None)
            took.append(time.monotonic() - started)
        threads = [threading.Thread(target=call) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Waiting in turn for the client, the last would take 8 timeouts (2.4 s).
        self.assertEqual(len(took), 8)
        self.assertLess(max(took), 1.2)
        os.kill(self.daemon.process.pid, signal.SIGCONT)
        self.assertTrue(client.check("resumed", "k", None).admitted)
        client.close()

    def test_a_daemon_stopped_for_good_closes_the_client_after_64_timeouts(self):
        client = BourseClient(self.daemon.socket, timeout=0.01)
        stop(self.daemon.process.pid)
        closes_at_the_65th_timeout(self, lambda: client.check("stopped", "k", None))

    def test_the_budget_of_wait_covers_a_pause_begun_after_booking(self):
        # Booked for 2 s from now: the pause begins long before, even on a loaded machine.
        limit = {"capacity": 1, "refill_per_sec": 0.5}
        self.client.check("e", "k", limit)
        with BourseClient(self.daemon.socket) as other:
            threading.Timer(0.1, lambda: other.pause("e", 10_000)).start()
            started = time.monotonic()
            with self.assertRaises(RateLimitExceeded) as raised:
                self.client.wait("e", "k", limit, max_wait_ms=3000)
            self.assertLess(time.monotonic() - started, 3.0)
            self.assertGreater(raised.exception.retry_after, 3000)
            self.assertEqual(raised.exception.exchange, "e")
            self.assertRegex(raised.exception.message,
                             r"^e: waiting \d+ ms exceeds the \d+ ms left of max_wait_ms 3000$")
            # Its booking stays paid, as Elixir's wait_for_capacity leaves it.
            self.assertEqual(other.inspect("e", "k")["bookings"], 1)

    def test_wait_messages_and_budgets_as_elixir(self):
        with self.assertRaises(RateLimitExceeded) as raised:
            self.client.wait("binance", "k", SLOW, cost=31, max_wait_ms=10)
        self.assertEqual(raised.exception.exchange, "binance")
        self.assertRegex(raised.exception.message, r"^binance: waiting \d+ ms exceeds max_wait_ms 10$")
        with self.assertRaises(BourseError) as raised:
            self.client.wait("binance", "k", SLOW, max_wait_ms=None)
        self.assertEqual(raised.exception.type, "invalid_parameters")
        self.assertEqual(raised.exception.message,
                         "max_wait_ms must be an integer from 1 to 4294967295, got nil")

    def test_wait_beyond_a_full_queue_of_bookings_pays_nothing(self):
        limit = {"capacity": 1, "refill_per_sec": 10}
        self.assertTrue(self.client.check("e", "k", limit).admitted)
        # bourse_core's MAX_BOOKINGS.
        for owner in range(256):
            booked = self.client.check("e", "k", limit, owner=owner, max_wait_ms=60_000)
            self.assertEqual(booked.result, "booked")
        borrowed = self.client.get_cost("e", "k")
        with self.assertRaises(RateLimitExceeded) as raised:
            self.client.wait("e", "k", limit, max_wait_ms=60_000)
        self.assertRegex(raised.exception.message,
                         r"^e: waiters fill the queue of a bucket of this check; retry after \d+ ms, "
                         r"within max_wait_ms 60000$")
        self.assertGreater(raised.exception.retry_after, 20_000)
        self.assertAlmostEqual(self.client.get_cost("e", "k"), borrowed, places=1)

    def test_errors_carry_the_exchange(self):
        with self.assertRaises(BourseError) as raised:
            self.client.check("binance", 123, SLOW)
        self.assertEqual(raised.exception.exchange, "binance")

    def test_requests_too_large_for_a_frame_are_refused_and_the_client_goes_on(self):
        with self.assertRaises(BourseError) as raised:
            self.client.check("binance", "S" * (1 << 20), SLOW)
        self.assertEqual(raised.exception.type, "invalid_parameters")
        self.assertEqual(raised.exception.message,
                         "credential_key must be :public or a UTF-8 binary of at most 1024 bytes, "
                         "got a binary of 1048576 bytes")
        # Valid, but larger than the daemon's frames once JSON escapes its control characters.
        escaped = "\x01" * 1024
        many = [(key(escaped, escaped), SLOW, 1)] * 1024
        with self.assertRaises(BourseError) as raised:
            self.client.check_many(many)
        self.assertEqual(raised.exception.type, "invalid_parameters")
        self.assertIn("--max-frame-bytes", raised.exception.message)
        with self.assertRaises(BourseError) as raised:
            self.client.check_many([(key("b", "k"), SLOW, 1)] * 1025)
        self.assertEqual(raised.exception.message,
                         "checks must be a list of at most 1024 {key, limit, cost}, "
                         "got a list of more than 1024 elements")
        self.assertEqual(raised.exception.exchange, "b")
        self.assertTrue(self.client.check("binance", "k", SLOW).admitted)
        self.assertEqual(self.client.stats()["invalid"], 1)

    def test_a_closed_client_says_so(self):
        self.client.close()
        self.client.close()
        with self.assertRaisesRegex(ConnectionError, "closed"):
            self.client.check("binance", "k", SLOW)


class ImpostorTest(unittest.TestCase):
    """Something else listens on the daemon's address."""

    def serve(self, handler):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        self.addCleanup(listener.close)

        def accept():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                try:
                    connection.recv(100)
                    handler(connection)
                except OSError:
                    pass
        threading.Thread(target=accept, daemon=True).start()
        return listener.getsockname()

    def test_an_endless_line_is_refused_not_buffered(self):
        # 72 MiB without a newline (then the peer closes): past the client's bound on an
        # answer line. (Unbounded, it would be read whole into memory.)
        def endless(connection):
            for _ in range(72 * 16):
                connection.sendall(b"x" * 65536)
        address = self.serve(endless)
        with self.assertRaises(BourseError) as raised:
            BourseClient(address, timeout=10)
        self.assertEqual(raised.exception.type, "protocol")

    def test_a_trickle_ends_within_the_timeout(self):
        def trickle(connection):
            for _ in range(30):
                connection.sendall(b" ")
                time.sleep(0.2)
        address = self.serve(trickle)
        started = time.monotonic()
        with self.assertRaises(TimeoutError):
            BourseClient(address, timeout=1)
        self.assertLess(time.monotonic() - started, 2)

    def impostor_hello(self, connection, auth, nonce="ab" * 32):
        hello = {"ok": True, "protocol": 1, "server": "bourse_daemon 0", "id": 1,
                 "max_frame_bytes": 65536, "clock_us": 1}
        if auth:
            hello["auth"] = {"scheme": "hmac-sha256", "nonce": nonce}
        connection.sendall(json.dumps(hello).encode() + b"\n")

    def unix_listener(self):
        """A Unix socket this process listens on, and its path."""
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        path = os.path.join(directory.name, "impostor.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self.addCleanup(listener.close)
        return listener, path

    def test_a_unix_socket_served_by_another_user_is_refused_and_sent_nothing(self):
        listener, path = self.unix_listener()
        received = []

        def accept():
            connection, _ = listener.accept()
            connection.settimeout(2)
            received.append(connection.recv(1000))
            connection.close()
        thread = threading.Thread(target=accept)
        thread.start()
        # This process listens: a client told the daemon runs as another user refuses it.
        other = os.geteuid() + 1
        with self.assertRaises(BourseError) as raised:
            BourseClient(path, timeout=2, daemon_uid=other)
        thread.join()
        self.assertEqual(raised.exception.type, "unauthorized")
        self.assertIn(f"served by user {os.geteuid()}, not the daemon's user {other}",
                      raised.exception.message)
        self.assertEqual(received, [b""])
        # Told its own user, the same client is served by a real daemon.
        daemon = Daemon()
        self.addCleanup(daemon.stop)
        with BourseClient(daemon.socket, daemon_uid=os.geteuid()) as unix:
            self.assertEqual(unix.hello()["protocol"], 1)

    def test_a_tcp_peer_that_asks_no_secret_is_refused(self):
        address = self.serve(lambda connection: self.impostor_hello(connection, auth=False))
        with self.assertRaises(BourseError) as raised:
            BourseClient(address, timeout=2, secret=SECRET)
        self.assertEqual(raised.exception.type, "unauthorized")
        self.assertIn("another program may be listening there", raised.exception.message)

    def test_a_tcp_peer_that_does_not_prove_the_secret_is_refused(self):
        def accept_any_proof(connection):
            self.impostor_hello(connection, auth=True)
            connection.recv(1000)
            connection.sendall(b'{"ok": true, "id": 2}\n')
        address = self.serve(accept_any_proof)
        with self.assertRaises(BourseError) as raised:
            BourseClient(address, timeout=2, secret=SECRET)
        self.assertEqual(raised.exception.type, "unauthorized")
        self.assertIn("without proving it in turn", raised.exception.message)

    def test_a_peer_reflecting_one_clients_challenge_to_another_is_refused(self):
        # A peer without the secret hands client B, as its nonce, what the daemon would prove
        # to client A: were B to prove it, A would take B's proof for the daemon's.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        self.addCleanup(listener.close)

        def line(connection):
            data = b""
            while not data.endswith(b"\n"):
                chunk = connection.recv(4096)
                if not chunk:
                    return None
                data += chunk
            return json.loads(data)

        def reflect():
            a, _ = listener.accept()
            b = None
            try:
                line(a)
                nonce = os.urandom(32).hex()
                self.impostor_hello(a, auth=True, nonce=nonce)
                auth_a = line(a)
                b, _ = listener.accept()
                line(b)
                self.impostor_hello(b, auth=True, nonce=f"daemon {auth_a['challenge']} {nonce}")
                auth_b = line(b)
                forged = auth_b["proof"] if auth_b else ""
                a.sendall(json.dumps({"ok": True, "id": auth_a["id"], "proof": forged}).encode()
                          + b"\n")
                time.sleep(1)
            except (OSError, ValueError, TypeError, KeyError):
                pass
            finally:
                a.close()
                if b:
                    b.close()
        threading.Thread(target=reflect, daemon=True).start()
        address = listener.getsockname()
        errors = {}

        def connect(client):
            try:
                BourseClient(address, timeout=3, secret=SECRET)
            except (BourseError, OSError) as error:
                errors[client] = error
        first = threading.Thread(target=connect, args=("a",))
        first.start()
        time.sleep(0.3)
        connect("b")
        first.join()
        self.assertEqual(set(errors), {"a", "b"})
        self.assertIn("nonce is not 64 hex digits", errors["b"].message)

    def fake_daemon(self, respond, before=None):
        """A daemon on a Unix socket that answers each request as ``respond`` (the request,
        to an answer, or None for no answer) says, after a hello, each answer after those
        ``respond`` put in ``before``; returns its path, the requests it read, and its
        thread."""
        listener, path = self.unix_listener()
        read = []

        def serve():
            connection, _ = listener.accept()
            with connection, connection.makefile("rb") as lines:
                for line in lines:
                    request = json.loads(line)
                    read.append(request)
                    if request["op"] == "hello":
                        answer = {"ok": True, "protocol": 1, "server": "bourse_daemon 0",
                                  "clock_us": 1, "max_frame_bytes": 65536, "id": request["id"]}
                    else:
                        answer = respond(request)
                    for earlier in before or []:
                        connection.sendall(json.dumps(earlier).encode() + b"\n")
                    if before:
                        before.clear()
                    if answer is not None:
                        connection.sendall(json.dumps(answer).encode() + b"\n")
        server = threading.Thread(target=serve, daemon=True)
        server.start()
        return path, read, server

    def test_what_a_late_answer_paid_is_asked_back_and_its_answers_are_dropped(self):
        # A daemon that answers two checks past the client's timeout: one admitted, one an
        # error. The call that reads both gets its own answer, then asks back the admitted
        # one alone; the answer to that is dropped by the next call.
        def respond(request):
            credential = request.get("key", {}).get("credential")
            if request["op"] == "give_back":
                return {"id": request["id"], "ok": True, "given_back": True}
            time.sleep(0.5 if credential in ("paid", "refused") else 0)
            if credential == "refused":
                return {"id": request["id"], "ok": False,
                        "error": {"type": "unavailable", "message": "late"}}
            return {"id": request["id"], "ok": True, "result": "admitted"}
        path, read, server = self.fake_daemon(respond)

        client = BourseClient(path, timeout=0.2)
        for credential in ("paid", "refused"):
            with self.assertRaises(TimeoutError):
                client.check("x", credential, None)
        time.sleep(0.8)
        self.assertTrue(client.check("x", "next", None).admitted)
        # Asked back once read, not with a later call, which may be late or never come.
        deadline = time.monotonic() + 5
        while "give_back" not in [r["op"] for r in read] and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertIn("give_back", [r["op"] for r in read])
        self.assertTrue(client.check("x", "after", None).admitted)
        client.close()
        server.join(5)
        checks = [request["key"]["credential"] for request in read if request["op"] == "check"]
        self.assertEqual(checks, ["paid", "refused", "next", "after"])
        give_backs = [request["of"] for request in read if request["op"] == "give_back"]
        self.assertEqual(give_backs, [read[1]["id"]])

    def test_give_backs_in_flight_do_not_count_toward_the_64_timed_out_calls(self):
        # Ten checks answered late, all at once, then nothing: their ten give_backs are
        # never answered, and 64 more calls time out before the client closes.
        held, release = [], []

        def respond(request):
            credential = request.get("key", {}).get("credential")
            if credential == "late":
                held.append(request["id"])
            elif credential == "release":
                release.extend({"id": late, "ok": True, "result": "admitted"} for late in held)
                return {"id": request["id"], "ok": True, "result": "admitted"}
            return None
        path, read, _server = self.fake_daemon(respond, before=release)
        client = BourseClient(path, timeout=0.05)
        for _ in range(10):
            with self.assertRaises(TimeoutError):
                client.check("x", "late", None)
        self.assertTrue(client.check("x", "release", None).admitted)
        closes_at_the_65th_timeout(self, lambda: client.check("x", "stalled", None))
        self.assertEqual(len([r for r in read if r["op"] == "give_back"]), 10)

    def test_an_error_without_an_id_while_a_late_answer_is_to_come_closes_the_client(self):
        # Whose it is cannot be told: the late call's, or the next one's. The late answer
        # comes 0.3 s after the first call timed out, half-way through the next call's wait.
        def respond(request):
            if request["key"]["credential"] == "late":
                time.sleep(0.9)
            return {"ok": False, "error": {"type": "unavailable", "message": "no id"}}
        path, _read, server = self.fake_daemon(respond)
        client = BourseClient(path, timeout=0.6)
        with self.assertRaises(TimeoutError):
            client.check("x", "late", None)
        with self.assertRaises(BourseError) as raised:
            client.check("x", "next", None)
        self.assertEqual(raised.exception.type, "protocol")
        with self.assertRaisesRegex(ConnectionError, "closed"):
            client.check("x", "after", None)
        server.join(5)

    def test_an_answer_that_is_not_json_is_a_bourse_error(self):
        address = self.serve(lambda connection: connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"))
        with self.assertRaises(BourseError) as raised:
            BourseClient(address, timeout=2)
        self.assertEqual(raised.exception.type, "protocol")

    def test_answers_not_of_the_daemons_shape_are_bourse_errors(self):
        # Each raised a Python error of its own before (RecursionError, AttributeError, a
        # hello of id True taken for request 1).
        for line in [b"[" * 100000 + b"]" * 100000, b'{"ok": false, "id": 1, "error": "x"}',
                     b'{"ok": "yes", "id": 1}', b'{"ok": true, "id": true, "protocol": 1}']:
            address = self.serve(lambda connection, line=line: connection.sendall(line + b"\n"))
            with self.assertRaises(BourseError, msg=line[:40]) as raised:
                BourseClient(address, timeout=2)
            self.assertEqual(raised.exception.type, "protocol")

    def test_a_check_answered_without_its_decision_or_with_a_nan_wait_is_a_bourse_error(self):
        for answer in [{"ok": True, "id": 2}, {"ok": True, "id": 2, "result": "delay",
                                               "ms": float("nan")}]:
            listener, path = self.unix_listener()

            def daemon(answer=answer):
                connection, _ = listener.accept()
                with connection:
                    connection.recv(1000)
                    self.impostor_hello(connection, auth=False)
                    connection.recv(1000)
                    connection.sendall(json.dumps(answer).encode() + b"\n")
                    connection.recv(1000)
            threading.Thread(target=daemon, daemon=True).start()
            client = BourseClient(path, timeout=2)
            self.addCleanup(client.close)
            with self.assertRaises(BourseError) as raised:
                client.check("binance", "k", {"capacity": 1, "refill_per_sec": 1})
            self.assertEqual(raised.exception.type, "protocol")


if __name__ == "__main__":
    unittest.main()
