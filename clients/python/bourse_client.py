"""A Python client for bourse_daemon, the shared Bourse rate limiter (standard library only).

Several programs on one host share one limiter by talking to one daemon, so that together
they stay under an exchange's limits. Start the daemon in server mode:

    BOURSE_DAEMON_SECRET=... bourse_daemon --listen 127.0.0.1:7400   # or: --socket /run/bourse.sock

then, from any number of processes:

    from bourse_client import BourseClient, RateLimitExceeded

    limit = {"requests": 6000, "period": 60000}          # Binance spot: 6000 weight per minute
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

Over TCP the client and the daemon prove the shared secret to each other (the HMAC-SHA256
of the nonce in the daemon's hello, then of a challenge of the client's; the secret itself
is never sent), so a program without it that listens on the daemon's port is refused: pass
secret=b"...", else it is read from the environment variable BOURSE_DAEMON_SECRET. A Unix
socket needs none (its file is owner-only); on Linux the client asks the kernel which user
serves it (SO_PEERCRED) and talks only to a daemon run as daemon_uid= (by default this
process's user), so that another user listening at that path first is refused
(BourseError "unauthorized", naming its uid), never sent a key. Answers never hold an API
key: busiest() shows fingerprints.

A program that restarts while the exchange still counts its previous run's requests
passes busy_since=time.monotonic() as of its own start (the limiter's assume_busy_at_start):
buckets new to the daemon then start as if they had been empty at that moment, not full.

Keys are (exchange, credential, axis): credential None is the exchange's public pool, axis
defaults to "request". Limits are {"capacity": c, "refill_per_sec": r},
{"requests": n, "period": ms}, {"requests": n} (period 1000 ms) or None (no limit).

One client holds one connection and sends one request at a time (a lock makes it safe to
share between threads; give each busy thread its own client for throughput). A client is
not shared across fork(): in a child process it raises ConnectionError (open a new one
there). Opening a client where no daemon listens raises the socket's own OSError
(ConnectionRefusedError, FileNotFoundError, PermissionError). A call ends within
``timeout`` (TimeoutError), waiting for another thread's call on the client included, and
the client goes on: the answer of a call that timed out is read before a later call's,
and what it paid is asked back (``give_back``) then, which the daemon grants when it wrote
that answer past the call's deadline. A request the daemon reads after its caller stopped
waiting is not run. A call that failed otherwise while its answer was on its way (an
interrupt, a lost connection, a request only partly sent) closes the client, and so does
a 65th call timed out whose answers are all still to come. Bookings belong to an owner:
by default wait() uses a fresh owner per call; check() with max_wait_ms and no owner uses
the connection. The wire protocol is docs/PROTOCOL.md (version 1, newline-delimited JSON).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import struct
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
    """An error answer from the daemon (``type`` is e.g. "invalid_parameters"); ``exchange``
    is the request's exchange when the daemon could read it, as in ``%Bourse.Error{}``."""

    def __init__(self, type: str, message: str, exchange: Optional[str] = None):
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message
        self.exchange = exchange


class RateLimitExceeded(BourseError):
    """wait() would have to wait longer than what is left of its budget. Told so at once,
    it paid nothing; told so after it booked (a pause began since), its booking stays paid,
    as Elixir's wait_for_capacity/5 answers it."""

    def __init__(self, retry_after: int, exchange: Optional[str] = None,
                 message: Optional[str] = None):
        super().__init__("rate_limit_exceeded",
                         message or f"waiting {retry_after} ms exceeds max_wait_ms", exchange)
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
    return {"exchange": _part(exchange), "credential": _part(credential), "axis": _part(axis)}


# The longest key part (bytes of UTF-8), and the most checks of one check_many.
_MAX_PART_BYTES = 1024
_MAX_CHECKS = 1024


def _credential(exchange: str, credential: Optional[str]) -> dict:
    """A credential as the daemon reads one: None is the public pool."""
    return {"exchange": _part(exchange), "credential": _part(credential)}


def _part(value: Any) -> Any:
    """A key part as the daemon is to judge it: a string that cannot be one (longer than
    1024 bytes, or not UTF-8: a lone surrogate) goes as its shape, as the Elixir client
    sends such binaries, so it is refused as from Elixir ("got a binary of N bytes") and
    a misplaced API key, however long, never travels or outgrows a frame."""
    if isinstance(value, str):
        try:
            size = len(value.encode())
        except UnicodeEncodeError:
            return {"$term": "binary", "size": len(value.encode("utf-8", "surrogatepass"))}
        if size > _MAX_PART_BYTES:
            return {"$term": "binary", "size": size}
    return value


class BourseClient:
    """One connection to a bourse_daemon server (TCP (host, port) or a Unix socket path)."""

    def __init__(self, address: Address, timeout: Optional[float] = 30.0,
                 secret: Optional[bytes] = None, daemon_uid: Optional[int] = None,
                 busy_since: Optional[float] = None):
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            self._sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(address)
            if not isinstance(address, str):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            elif hasattr(socket, "SO_PEERCRED"):
                self._served_by(address, os.geteuid() if daemon_uid is None else daemon_uid)
        except (OSError, BourseError):
            self._sock.close()
            raise
        self._timeout = timeout
        self._buffer = bytearray()
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        # Requests sent whose answers are to be dropped, by id: True for a call that timed
        # out whose answer's payment is to be asked back, False for one that paid nothing
        # (hello, auth), None for a give_back. Their answers come before the next ones.
        self._late: dict = {}
        # Ids of late answers that paid, to ask back (_ask_back_now).
        self._asks: list = []
        # The process that connected: after fork() parent and child would share one
        # connection (and one sequence of ids) and read each other's answers.
        self._pid = os.getpid()
        self._max_frame_bytes: Optional[int] = None
        # The tightest lower bound of (daemon clock - our clock) in µs the hellos proved.
        self._offset_us: Optional[int] = None
        try:
            hello = self._first_hello(busy_since)
        except BaseException:
            self.close()
            raise
        if isinstance(hello.get("max_frame_bytes"), int):
            self._max_frame_bytes = hello["max_frame_bytes"]
        if hello.get("protocol") != PROTOCOL_VERSION:
            self.close()
            raise BourseError("protocol", f"the daemon speaks protocol {hello.get('protocol')!r}, "
                                          f"this client {PROTOCOL_VERSION}")
        self.server = hello.get("server")
        auth = hello.get("auth")
        if auth is not None:
            try:
                self._prove(auth, secret)
            except BaseException:
                self.close()
                raise
        elif not isinstance(address, str):
            # Every daemon serving TCP asks (a Unix socket's permissions stand for the proof).
            self.close()
            raise BourseError("unauthorized", "the peer did not ask for the shared secret, as "
                                              "every bourse_daemon serving TCP does: another "
                                              "program may be listening there")

    def _served_by(self, path: str, uid: int) -> None:
        """The user listening at the socket (pid, uid, gid: SO_PEERCRED) must be the daemon's."""
        credentials = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            struct.calcsize("iII"))
        _pid, peer, _gid = struct.unpack("iII", credentials)
        if peer != uid:
            raise BourseError("unauthorized", f"{path} is served by user {peer}, not the "
                                              f"daemon's user {uid}: another user may be "
                                              f"listening there (pass daemon_uid={peer} if it "
                                              f"is the daemon)")

    def _prove(self, auth: dict, secret: Optional[bytes]) -> None:
        """Proves the secret (the HMAC-SHA256 of the hello's nonce), and has the daemon prove
        it in turn over a challenge of ours; the secret itself never travels."""
        if secret is None:
            # Bytes, as the daemon reads it (a secret need not be UTF-8), without the
            # trailing newlines the daemon drops.
            secret = os.environb.get(b"BOURSE_DAEMON_SECRET", b"") or None
        if secret is not None:
            secret = secret.rstrip(b"\r\n") or None
        if (secret is None or auth.get("scheme") != "hmac-sha256"
                or not isinstance(auth.get("nonce"), str)):
            self.close()
            raise BourseError("unauthorized", "the daemon asks for its shared secret: pass "
                                              "secret= or set BOURSE_DAEMON_SECRET")
        nonce = auth["nonce"]
        # 64 hex digits: what the daemon proves, "daemon <challenge> <nonce>", never is, so a
        # peer cannot have this client prove that for another client's challenge.
        if not re.fullmatch(r"[0-9a-fA-F]{64}", nonce):
            self.close()
            raise BourseError("unauthorized", "the peer's nonce is not 64 hex digits, as every "
                                              "bourse_daemon's is: another program may be "
                                              "listening there")
        challenge = os.urandom(32).hex()
        proof = hmac.new(secret, nonce.encode(), hashlib.sha256).hexdigest()
        expected = hmac.new(secret, f"daemon {challenge} {nonce}".encode(),
                            hashlib.sha256).hexdigest()
        try:
            proved = self.request("auth", proof=proof, challenge=challenge)
        except BourseError:
            self.close()
            raise
        if not hmac.compare_digest(str(proved.get("proof", "")).encode("utf-8", "surrogatepass"), expected.encode()):
            self.close()
            raise BourseError("unauthorized", "the peer accepted the proof of the shared secret "
                                              "without proving it in turn: another program may "
                                              "be listening there")

    # -- plumbing ---------------------------------------------------------------------------

    def request(self, op: str, **fields: Any) -> dict:
        """Sends one request and returns its answer; raises BourseError on an error answer.

        The whole call (waiting for another thread's call on this client and sending
        included) ends within the client's ``timeout``; the request carries that moment
        (``deadline_us``, ``timeout_ms``), so a daemon that reads it too late (it was
        stopped) does not run it. A timeout before any byte of it went, or once it was sent
        whole, leaves the client usable: the answer is read with a later call's, and what it
        paid asked back. Any other failure between sending and reading the whole answer
        closes the client: its next answer could not be paired with its request.
        """
        self._usable()
        started = time.monotonic()
        deadline = None if self._timeout is None else started + self._timeout
        if not self._lock.acquire(timeout=-1 if deadline is None else max(0.0, _left(deadline))):
            raise TimeoutError("another thread's call on this BourseClient held it past the "
                               "client's timeout")
        try:
            self._usable()
            asks, asked = self._asking_back()
            self._next_id += 1
            request_id = self._next_id
            # The id first: the daemon attributes even a malformed frame by it.
            body = {"id": request_id, "op": op, **fields}
            if deadline is not None and self._offset_us is not None and op not in ("hello", "auth"):
                body["deadline_us"] = max(0, _us(started) + self._offset_us + int(self._timeout * 1e6))
                body["timeout_ms"] = max(1, int(self._timeout * 1000))
            try:
                line = json.dumps(body, allow_nan=False).encode()
            except (TypeError, ValueError) as error:
                # NaN, infinity, bytes, sets...: nothing reaches the daemon. The reason
                # names a type or a float, never a credential.
                raise BourseError("invalid_parameters",
                                  f"the request holds a value JSON cannot carry ({error})",
                                  _exchange_of(fields)) from None
            if self._max_frame_bytes is not None and len(line) > self._max_frame_bytes:
                raise BourseError("invalid_parameters",
                                  f"the request is {len(line)} bytes encoded, more than the daemon "
                                  f"accepts ({self._max_frame_bytes}, its --max-frame-bytes)",
                                  _exchange_of(fields))
            self._send(asks + line + b"\n", deadline)
            self._asked(asked)
            try:
                answer, read_us = self._answer(request_id, deadline)
            except TimeoutError:
                if sum(kind is not None for kind in self._late.values()) >= _MAX_LATE:
                    # A daemon that answers nothing any more.
                    self.close()
                else:
                    self._late[request_id] = op not in ("hello", "auth")
                raise
            except BaseException:
                # An interrupt (KeyboardInterrupt, a signal handler's exception) or a stray
                # answer: the next answer read would belong to another request.
                self.close()
                raise
            if not answer.get("ok") and "id" not in answer:
                # frame_too_large (and any error the daemon could not attribute) ends the
                # connection on the daemon's side.
                self.close()
            else:
                self._ask_back_now(deadline)
        finally:
            self._lock.release()
        if not answer.get("ok"):
            error = answer.get("error") or {}
            raise BourseError(error.get("type", "unknown"), error.get("message", repr(answer)),
                              error.get("exchange"))
        if op == "hello" and isinstance(answer.get("clock_us"), int):
            offset = answer["clock_us"] - read_us
            if self._offset_us is None or offset > self._offset_us:
                self._offset_us = offset
        return answer

    def _answer(self, request_id: int, deadline: Optional[float]) -> Tuple[dict, int]:
        """The answer to ``request_id`` and when it was read (µs), read within ``deadline``;
        the answers of requests whose callers timed out, read before it, are dropped, and
        what a paid one paid is to be asked back (``_asks``)."""
        while True:
            raw = self._read_line(deadline)
            read_us = _us(time.monotonic())
            if not raw:
                raise ConnectionError("bourse_daemon closed the connection")
            try:
                answer = json.loads(raw)
            except (ValueError, RecursionError):
                answer = None
            if not _is_answer(answer):
                raise BourseError("protocol", f"not an answer of bourse_daemon "
                                              f"({len(raw)} bytes)")
            answer_id = answer.get("id")
            # An id is an int: True and 1.0 are equal to 1 in Python, and are no id.
            if type(answer_id) is not int:
                answer_id = None if "id" not in answer else repr(answer_id)
            if answer_id != request_id and type(answer_id) is int and answer_id in self._late:
                if self._late.pop(answer_id) and answer.get("ok") is True:
                    self._asks.append(answer_id)
                continue
            # An error without an id (frame_too_large) is this request's only while no
            # earlier one's answer is still to come.
            if answer_id != request_id and not ("id" not in answer and not answer.get("ok")
                                                and not self._late):
                raise BourseError("protocol", f"answer for id {answer_id!r}, expected {request_id}")
            return answer, read_us

    def _asking_back(self) -> Tuple[bytes, list]:
        """The requests asking back what the late answers read so far paid, and their ids."""
        lines, ids = [], []
        for late in self._asks:
            self._next_id += 1
            ids.append(self._next_id)
            lines.append(json.dumps({"id": self._next_id, "op": "give_back", "of": late}).encode()
                         + b"\n")
        return b"".join(lines), ids

    def _asked(self, ids: list) -> None:
        """The give_backs sent under ``ids``: their answers, to come, are dropped."""
        for asked in ids:
            self._late[asked] = None
        del self._asks[:len(ids)]

    def _ask_back_now(self, deadline: Optional[float]) -> None:
        """Sends the give_backs of the late answers this call read, if its time allows (else
        they go with the next request); the call's own answer stands whatever happens."""
        if not self._asks:
            return
        asks, asked = self._asking_back()
        try:
            self._send(asks, deadline)
        except OSError:
            return
        self._asked(asked)

    def _unbook(self, checks: list, owner: Union[str, int]) -> None:
        """Sends ``unbook`` for ``owner``'s booking of ``checks``, without a deadline (a
        daemon that resumes after a stop still runs it) and without waiting: its answer
        is dropped when a later call reads it. Not sent if the client cannot send now."""
        if self._closed or not self._lock.acquire(timeout=-1 if self._timeout is None
                                                  else self._timeout):
            return
        try:
            self._next_id += 1
            line = json.dumps({"id": self._next_id, "op": "unbook", "checks": checks,
                               "owner": owner}, allow_nan=False).encode() + b"\n"
            deadline = None if self._timeout is None else time.monotonic() + self._timeout
            try:
                self._send(line, deadline)
            except (OSError, TimeoutError):
                return
            self._late[self._next_id] = None
        finally:
            self._lock.release()

    def _usable(self) -> None:
        if self._closed:
            raise ConnectionError("this BourseClient is closed; open a new one")
        if os.getpid() != self._pid:
            raise ConnectionError(f"this BourseClient was connected by process {self._pid}; "
                                  "after fork() open a new BourseClient in each process")

    def _send(self, data: bytes, deadline: Optional[float]) -> None:
        """Sends ``data`` whole within ``deadline``. A failure once part of it went closes
        the client (the stream would be cut in a frame); a timeout before any went does
        not."""
        view, sent = memoryview(data), 0
        try:
            while sent < len(data):
                self._sock.settimeout(_left(deadline))
                sent += self._sock.send(view[sent:])
        except _TIMEOUTS:
            if sent:
                self.close()
            raise TimeoutError("bourse_daemon did not take the request within the client's "
                               "timeout") from None
        except BaseException:
            self.close()
            raise

    def _read_line(self, deadline: Optional[float]) -> bytes:
        """One answer line (b"" when the daemon closed the connection), read within
        ``deadline`` as a whole and at most ``_MAX_ANSWER_BYTES`` long."""
        scanned = 0
        while True:
            end = self._buffer.find(b"\n", scanned)
            if end >= 0:
                line = bytes(self._buffer[:end + 1])
                del self._buffer[:end + 1]
                return line
            scanned = len(self._buffer)
            if scanned > _MAX_ANSWER_BYTES:
                raise BourseError("protocol", f"an answer longer than {_MAX_ANSWER_BYTES} bytes")
            self._sock.settimeout(_left(deadline))
            try:
                chunk = self._sock.recv(65536)
            except _TIMEOUTS:
                raise TimeoutError("bourse_daemon did not answer within the client's "
                                   "timeout") from None
            if not chunk:
                return b""
            self._buffer += chunk

    def close(self) -> None:
        """Closes the connection (again: nothing). In a child process after fork() it closes
        only the child's copy of the socket."""
        self._closed = True
        self._sock.close()

    def __enter__(self) -> "BourseClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- the calls --------------------------------------------------------------------------

    def hello(self) -> dict:
        return self.request("hello")

    def _first_hello(self, busy_since: Optional[float]) -> dict:
        if busy_since is None:
            return self.hello()
        ago = max(_us(time.monotonic() - busy_since), 0)
        return self.request("hello", busy_since_us_ago=ago)

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
        if len(fields["checks"]) > _MAX_CHECKS:
            # As Elixir refuses it, before anything travels.
            raise BourseError("invalid_parameters",
                              f"checks must be a list of at most {_MAX_CHECKS} {{key, limit, cost}}, "
                              f"got a list of more than {_MAX_CHECKS} elements",
                              _exchange_of(fields))
        _options(fields, owner, max_wait_ms)
        return _decision(self.request("check_many", **fields))

    def wait(self, exchange: str, credential: Optional[str], limit: Limit, cost: float = 1,
             axis: str = "request", max_wait_ms: int = 5000,
             owner: Union[str, int, None] = None) -> float:
        """Blocks until admitted; returns the seconds waited. Raises RateLimitExceeded at
        once, paying nothing, if the wait would exceed max_wait_ms. The budget covers the
        whole call, as Elixir's wait_for_capacity/5: a pause that began after the booking
        and outlasts what is left of the budget raises RateLimitExceeded (the booking stays
        paid); a booking that lapsed (the caller woke too late) is made again only within
        what is left. A call that times out or finds the daemon's store unavailable gives
        back the booking it made or came to claim (``unbook``), then raises."""
        owner = uuid.uuid4().hex if owner is None else owner
        started = time.monotonic()
        slept_since: Optional[int] = None
        k = key(exchange, credential, axis)
        while True:
            if slept_since is None:
                left = max_wait_ms
            else:
                left = max(max_wait_ms - (_ms(time.monotonic()) - slept_since), 0)
            fields: dict = {"key": k, "limit": limit, "cost": cost, "owner": owner}
            if slept_since is None or left > 0:
                # The first check sends the budget as given: the daemon judges it (None, 0,
                # a float... are invalid_parameters, as from Elixir).
                fields["max_wait_ms"] = left
            try:
                decision = _decision(self.request("check", **fields))
            except (TimeoutError, BourseError) as error:
                if isinstance(error, TimeoutError) or error.type == "unavailable":
                    # A call that fails this way must not pay: the booking it made or came
                    # to claim, if any, is given back.
                    self._unbook([{"key": k, "limit": limit, "cost": cost}], owner)
                raise
            if decision.admitted:
                return time.monotonic() - started
            if decision.ms > left:
                budget = _budget(left, max_wait_ms, slept_since is None)
                raise RateLimitExceeded(decision.ms, exchange,
                                        f"{exchange}: waiting {decision.ms} ms exceeds {budget}")
            if decision.result == "over_budget":
                # Within the budget: a bucket of the check already holds as many bookings
                # as it queues.
                budget = _budget(left, max_wait_ms, slept_since is None)
                raise RateLimitExceeded(decision.ms, exchange,
                                        f"{exchange}: waiters fill the queue of a bucket of "
                                        f"this check; retry after {decision.ms} ms, within "
                                        f"{budget}")
            # booked: sleep until ready, then claim; delay: a pause began since, sleep again.
            if slept_since is None:
                slept_since = _ms(time.monotonic())
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
        self.request("reset_exchange", exchange=_part(exchange))

    def reset_all(self) -> None:
        self.request("reset_all")

    def pause(self, exchange: str, ms: int, credential: Optional[str] = _ALL,  # type: ignore[assignment]
              axis: Optional[str] = None) -> None:
        """Holds every bucket of the exchange, of one credential (None: the public pool), or
        of one key (with axis) for ms milliseconds, for every client."""
        target: dict = {"exchange": _part(exchange)}
        if credential is not _ALL:
            target["credential"] = _part(credential)
            if axis is not None:
                target["axis"] = _part(axis)
        elif axis is not None:
            raise ValueError("pause: an axis needs a credential")
        self.request("pause", target=target, ms=ms)

    def sync(self, exchange: str, credential: Optional[str], allowance: float,
             window_left_ms: int, axis: str = "request") -> float:
        """Follows an exchange's used-weight header: the exchange allows only `allowance`
        more cost until its window ends in `window_left_ms`; the key's tokens are lowered
        to fit, with its bookings due by then (never raised). Returns the tokens taken."""
        return self.request("sync", key=key(exchange, credential, axis), allowance=allowance,
                            window_left_ms=window_left_ms)["taken"]

    def back_off(self, exchange: str, credential: Optional[str],
                 scope: str = "credential") -> int:
        """Counts a limited reply without a usable wait (a 429 without Retry-After) and
        pauses the credential's buckets ("credential") or its whole exchange ("exchange")
        for the backoff: 1 s, doubled per reply counted before, at most 300 s. Returns the
        pause in milliseconds."""
        return self.request("back_off", credential=_credential(exchange, credential),
                            scope=scope)["ms"]

    def reset_backoff(self, exchange: str, credential: Optional[str]) -> None:
        """After a success: the backoff counts of the credential and its exchange start
        again."""
        self.request("reset_backoff", credential=_credential(exchange, credential))

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


# The longest answer line read (busiest(10000) answers a few MB).
_MAX_ANSWER_BYTES = 64 << 20
# Answers of timed-out calls still to come past which the daemon is taken for stuck and
# the client closes.
_MAX_LATE = 64
# A socket's timeout: socket.timeout is TimeoutError from Python 3.10 on, not before.
_TIMEOUTS = (TimeoutError, socket.timeout)


def _us(seconds: float) -> int:
    return int(seconds * 1_000_000)


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _left(deadline: Optional[float]) -> Optional[float]:
    """The socket timeout that ends an operation at ``deadline`` (None: no deadline)."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("bourse_daemon did not answer within the client's timeout")
    return left


def _budget(left: int, max_wait_ms: int, first: bool) -> str:
    """The budget as Elixir's over-budget message names it."""
    if first or left == max_wait_ms:
        return f"max_wait_ms {max_wait_ms}"
    if left == 0:
        return f"max_wait_ms {max_wait_ms}, already waited"
    return f"the {left} ms left of max_wait_ms {max_wait_ms}"


def _exchange_of(fields: dict) -> Optional[str]:
    """The exchange a request names, as Elixir reads it for errors raised in the caller:
    the key's (target's, credential's) exchange; of several checks, theirs if the first
    1024 name exactly one."""
    def of(candidate: Any) -> Optional[str]:
        if isinstance(candidate, dict) and isinstance(candidate.get("exchange"), str):
            return candidate["exchange"]
        return None
    if isinstance(fields.get("checks"), list):
        named = {of(c.get("key")) for c in fields["checks"][:_MAX_CHECKS] if isinstance(c, dict)}
        named.discard(None)
        return named.pop() if len(named) == 1 else None
    for candidate in (fields.get("key"), fields.get("target"), fields.get("credential")):
        if of(candidate) is not None:
            return of(candidate)
    return fields["exchange"] if isinstance(fields.get("exchange"), str) else None


def _options(fields: dict, owner: Union[str, int, None], max_wait_ms: Optional[int]) -> None:
    if owner is not None:
        fields["owner"] = owner
    if max_wait_ms is not None:
        fields["max_wait_ms"] = max_wait_ms


def _is_answer(answer) -> bool:
    """Whether ``answer`` has the shape of a bourse_daemon answer: an object whose ``ok``
    is a boolean, with an ``error`` object when false; what its fields say is read by
    each call (``_decision``)."""
    return (isinstance(answer, dict) and isinstance(answer.get("ok"), bool)
            and (answer["ok"] or isinstance(answer.get("error"), dict)))


def _decision(answer: dict) -> Decision:
    result, ms = answer.get("result"), answer.get("ms", 0)
    # Python's JSON reader takes NaN; a wait is a whole number of milliseconds.
    if (not isinstance(result, str) or type(ms) is not int or not 0 <= ms <= 2 ** 53):
        raise BourseError("protocol", "not an answer of bourse_daemon (a check's result "
                                      "without its decision or wait)")
    return Decision(result, ms)
