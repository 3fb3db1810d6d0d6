"""A Python client for bourse_daemon, the shared Bourse rate limiter (standard library only).

Several programs on one host share one limiter by talking to one daemon, so that together
they stay under an exchange's limits. Start the daemon in server mode:

    BOURSE_DAEMON_SECRET=... bourse_daemon --listen 127.0.0.1:7400   # or: --socket /run/bourse.sock

then, from any number of processes:

    from bourse_client import BourseClient, RateLimitExceeded

    limit = {"requests": 1200, "period": 60000}          # Binance: 1200 weight per minute
    with BourseClient(("127.0.0.1", 7400)) as limiter:   # or BourseClient("/run/bourse.sock")
        # Probe: admitted now (and paid), or told how long to wait (nothing paid).
        decision = limiter.check("binance", "API-KEY", limit, cost=5)
        if decision.admitted:
            ...  # send the request
        else:
            print("retry in", decision.ms, "ms")

        # Wait: book the cost now, sleep until the booking is ready, claim it. Waiters are
        # served first come, first served. Raises RateLimitExceeded (nothing paid) when the
        # wait would exceed max_wait_ms.
        limiter.wait("binance", "API-KEY", limit, cost=5, max_wait_ms=10_000)

        # After a 429 with Retry-After: 30, hold every bucket of that credential.
        limiter.pause("binance", 30_000, credential="API-KEY")

Over TCP the client proves the daemon's shared secret (the HMAC-SHA256 of the nonce in the
daemon's hello; the secret itself is never sent): pass secret=b"...", else it is read from
the environment variable BOURSE_DAEMON_SECRET. A Unix socket needs none (its file is
owner-only). Answers never hold an API key: busiest() shows fingerprints.

Keys are (exchange, credential, axis): credential None is the exchange's public pool, axis
defaults to "request". Limits are {"capacity": c, "refill_per_sec": r},
{"requests": n, "period": ms}, {"requests": n} (period 1000 ms) or None (no limit).

One client holds one connection and sends one request at a time (a lock makes it safe to
share between threads; give each busy thread its own client for throughput). Bookings
belong to an owner: by default wait() uses a fresh owner per call; check() with
max_wait_ms and no owner uses the connection. The wire protocol is docs/PROTOCOL.md
(version 1, newline-delimited JSON).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Iterable, NamedTuple, Optional, Sequence, Tuple, Union

PROTOCOL_VERSION = 1

__all__ = [
    "BourseClient",
    "BourseError",
    "Decision",
    "RateLimitExceeded",
    "key",
    "PROTOCOL_VERSION",
]

Address = Union[Tuple[str, int], str]
Limit = Optional[dict]

# Marks an argument that was not given (None is meaningful: the public pool).
_ALL = object()


class BourseError(Exception):
    """An error answer from the daemon (``type`` is e.g. "invalid_parameters")."""

    def __init__(self, type: str, message: str):
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message


class RateLimitExceeded(BourseError):
    """wait() would have to wait longer than its budget; nothing was paid."""

    def __init__(self, retry_after: int):
        super().__init__("rate_limit_exceeded", f"the wait of {retry_after} ms exceeds max_wait_ms")
        self.retry_after = retry_after


class Decision(NamedTuple):
    """The answer to a check: ``result`` is admitted, claimed, delay, booked or over_budget;
    ``ms`` the wait in milliseconds (0 when admitted or claimed)."""

    result: str
    ms: int

    @property
    def admitted(self) -> bool:
        """Paid (or admitted against the caller's own booking): go ahead."""
        return self.result in ("admitted", "claimed")


def key(exchange: str, credential: Optional[str], axis: str = "request") -> dict:
    """A key object; credential None is the public pool."""
    return {"exchange": exchange, "credential": credential, "axis": axis}


class BourseClient:
    """One connection to a bourse_daemon server (TCP (host, port) or a Unix socket path)."""

    def __init__(self, address: Address, timeout: Optional[float] = 30.0,
                 secret: Optional[bytes] = None):
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            self._sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(address)
            if not isinstance(address, str):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            self._sock.close()
            raise
        self._reader = self._sock.makefile("rb")
        self._lock = threading.Lock()
        self._next_id = 0
        hello = self.hello()
        if hello.get("protocol") != PROTOCOL_VERSION:
            self.close()
            raise BourseError("protocol", f"the daemon speaks protocol {hello.get('protocol')!r}, "
                                          f"this client {PROTOCOL_VERSION}")
        self.server = hello.get("server")
        auth = hello.get("auth")
        if auth is not None:
            self._prove(auth, secret)

    def _prove(self, auth: dict, secret: Optional[bytes]) -> None:
        if secret is None:
            secret = os.environ.get("BOURSE_DAEMON_SECRET", "").encode() or None
        if secret is None or auth.get("scheme") != "hmac-sha256":
            self.close()
            raise BourseError("unauthorized", "the daemon asks for its shared secret: pass "
                                              "secret= or set BOURSE_DAEMON_SECRET")
        proof = hmac.new(secret, auth["nonce"].encode(), hashlib.sha256).hexdigest()
        try:
            self.request("auth", proof=proof)
        except BourseError:
            self.close()
            raise

    # -- plumbing ---------------------------------------------------------------------------

    def request(self, op: str, **fields: Any) -> dict:
        """Sends one request and returns its answer; raises BourseError on an error answer."""
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            # The id first: the daemon attributes even a malformed frame by it.
            line = json.dumps({"id": request_id, "op": op, **fields}, allow_nan=False)
            try:
                self._sock.sendall(line.encode() + b"\n")
                raw = self._reader.readline()
            except OSError:
                # A timeout mid-answer would pair later answers with the wrong requests.
                self.close()
                raise
        if not raw:
            raise ConnectionError("bourse_daemon closed the connection")
        answer = json.loads(raw)
        if not answer.get("ok"):
            error = answer.get("error") or {}
            raise BourseError(error.get("type", "unknown"), error.get("message", repr(answer)))
        if answer.get("id") != request_id:
            raise BourseError("protocol", f"answer for id {answer.get('id')!r}, expected {request_id}")
        return answer

    def close(self) -> None:
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> "BourseClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- the calls --------------------------------------------------------------------------

    def hello(self) -> dict:
        return self.request("hello")

    def check(self, exchange: str, credential: Optional[str], limit: Limit, cost: float = 1,
              axis: str = "request", owner: Union[str, int, None] = None,
              max_wait_ms: Optional[int] = None) -> Decision:
        """One bucket. Without max_wait_ms a probe (a delay pays nothing); with it a waiter
        (a delay within the budget is booked: come back with the same owner after ms)."""
        fields: dict = {"key": key(exchange, credential, axis), "limit": limit, "cost": cost}
        _options(fields, owner, max_wait_ms)
        return _decision(self.request("check", **fields))

    def check_many(self, checks: Iterable[Tuple[dict, Limit, float]],
                   owner: Union[str, int, None] = None,
                   max_wait_ms: Optional[int] = None) -> Decision:
        """All-or-nothing over several (key(...), limit, cost) buckets."""
        fields: dict = {"checks": [{"key": k, "limit": lim, "cost": c} for k, lim, c in checks]}
        _options(fields, owner, max_wait_ms)
        return _decision(self.request("check_many", **fields))

    def wait(self, exchange: str, credential: Optional[str], limit: Limit, cost: float = 1,
             axis: str = "request", max_wait_ms: int = 5000,
             owner: Union[str, int, None] = None) -> float:
        """Blocks until admitted; returns the seconds waited. Raises RateLimitExceeded at
        once, paying nothing, if the wait would exceed max_wait_ms."""
        owner = uuid.uuid4().hex if owner is None else owner
        started = time.monotonic()
        while True:
            decision = self.check(exchange, credential, limit, cost, axis, owner, max_wait_ms)
            if decision.admitted:
                return time.monotonic() - started
            if decision.result == "over_budget":
                raise RateLimitExceeded(decision.ms)
            # booked: sleep until ready, then claim; delay: a pause began since, sleep again.
            time.sleep(decision.ms / 1000)

    def record(self, exchange: str, credential: Optional[str], cost: float = 1,
               axis: str = "request") -> None:
        """Debits usage spent elsewhere, without checking."""
        self.request("record", key=key(exchange, credential, axis), cost=cost)

    def get_cost(self, exchange: str, credential: Optional[str], axis: str = "request") -> float:
        """Tokens borrowed from the bucket now (0 for an unknown key)."""
        return self.request("get_cost", key=key(exchange, credential, axis))["borrowed"]

    def reset(self, exchange: str, credential: Optional[str], axis: str = "request") -> None:
        """Forgets one key: it is as new (its bookings are dropped)."""
        self.request("reset", key=key(exchange, credential, axis))

    def reset_exchange(self, exchange: str) -> None:
        """Forgets every key of one exchange."""
        self.request("reset_exchange", exchange=exchange)

    def reset_all(self) -> None:
        self.request("reset_all")

    def pause(self, exchange: str, ms: int, credential: Optional[str] = _ALL,  # type: ignore[assignment]
              axis: Optional[str] = None) -> None:
        """Holds every bucket of the exchange, of one credential (None: the public pool), or
        of one key (with axis) for ms milliseconds, for every client."""
        target: dict = {"exchange": exchange}
        if credential is not _ALL:
            target["credential"] = credential
            if axis is not None:
                target["axis"] = axis
        elif axis is not None:
            raise ValueError("pause: an axis needs a credential")
        self.request("pause", target=target, ms=ms)

    def inspect(self, exchange: str, credential: Optional[str],
                axis: str = "request") -> Optional[dict]:
        """A snapshot of the key (tokens, borrowed, debt, bookings, pause_ms, ...) or None."""
        return self.request("inspect", key=key(exchange, credential, axis))["info"]

    def busiest(self, count: int = 10) -> Sequence[dict]:
        return self.request("busiest", count=count)["keys"]

    def stats(self) -> dict:
        return self.request("stats")["stats"]

    def sweep(self) -> int:
        return self.request("sweep")["dropped"]


def _options(fields: dict, owner: Union[str, int, None], max_wait_ms: Optional[int]) -> None:
    if owner is not None:
        fields["owner"] = owner
    if max_wait_ms is not None:
        fields["max_wait_ms"] = max_wait_ms


def _decision(answer: dict) -> Decision:
    return Decision(answer["result"], answer.get("ms", 0))
