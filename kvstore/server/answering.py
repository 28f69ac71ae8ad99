"""The data port's answering loop: one thread that holds every connection between its requests
and answers the small ones itself.

With a thread per connection, each small request (a lookup, a release, a lease check) woke its
own thread, and that thread then took the GIL from the others at every socket call: with four
clients looking up at once, a lookup waited for the others' requests piece by piece, and its
p99 went past 2 ms on two CPUs. Here one thread sleeps in ``epoll`` on every connection between
requests, answers each complete small request it finds buffered (several in a row without
sleeping, their answers joined into one send: a turn), and hands the connection to the workers
(``kvstore.server.workers``) for anything else: a request of another kind, one whose bytes have
not all come (the worker reads the rest under the request's deadline; the rest of one that came
behind others answered in the same turn, a client pipelining, is awaited here, PARTIAL_S at
most), an answer the socket would not take at once (the worker sends the rest under the
deadline), an error (the worker sends the error frame and closes), and every request under TLS
(its bytes sit in the TLS layer, out of epoll's sight: the loop only sees that some came). The
loop closes a connection whose peer left, one idle past IDLE_S, and all of them when the port
closes. A worker gives the connection back with ``watch`` once it has nothing more to serve.

Turns are shared per tenant first, then per connection within a tenant: each round gives every
tenant with requests ready one turn, of its connection whose turn is next, and the loop looks
for new requests between rounds. A turn is at most ANSWERS_PER_TURN requests, all from one
buffer's read (16 KiB). Given per connection, a tenant with 250 connections pipelining 500-key
lookups took 250 turns of every 251, and another tenant's lookup waited 136 ms (p50); now it
waits for at most one turn of each other tenant.

Thread rules: a connection belongs to the loop from ``watch`` until the loop passes it on
(``elsewhere``: to a worker) or ends it (``end``); only its owner touches its stream.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvstore.stream import Stream
from kvstore.wire import (
    IDLE_S,
    OP_LEASE_HELD,
    OP_LOOKUP,
    OP_LOOKUP_SLOTS,
    OP_RELEASE,
    OP_RELEASE_NOWAIT,
    small_request_size,
)

_LOOKUP_OPS = frozenset((OP_LOOKUP, OP_LOOKUP_SLOTS))
_ID_OPS = frozenset((OP_RELEASE, OP_RELEASE_NOWAIT, OP_LEASE_HELD))  # a lease id their only field
IDLE_CHECK_S = 1.0
PARTIAL_S = 1.0  # a request begun in the loop whose rest takes longer goes to a worker
# Requests of one connection answered in a row before the others' turn: a client pipelining a
# buffer's worth (1,820 lease checks in 16 KiB) holds up the rest for ~0.2 ms, not ~10 ms.
ANSWERS_PER_TURN = 32


class Outcome(Enum):
    SERVE = "a request to serve"  # its first bytes are buffered in the stream
    CLOSED = "the peer closed the connection"
    IDLE = "idle past IDLE_S"
    CLOSING = "the port is closing"
    FAILED = "a request failed"  # ``conn.error`` says how


@dataclass(eq=False)
class Connection:
    """A data connection past its hello. ``unsent``: answers the loop could not send at once, for
    the worker to send first; ``error``: what a request the loop answered raised."""

    sock: socket.socket
    stream: Stream
    answer: Callable[[], object]  # serves the request whose bytes are all buffered
    tenant: str  # whose turns this connection shares
    tls: bool  # its bytes hidden in the TLS layer: every request is a worker's
    outcome: Outcome = Outcome.SERVE
    unsent: bytes = b""
    error: BaseException | None = None
    since: float = 0.0
    partial_since: float = 0.0  # when the part of a request buffered began to wait for its rest


class AnsweringLoop:
    """One daemon thread; ``watch`` from any thread, ``close`` once. ``lookups``: whether it
    answers lookups too; not where a lookup may ask the fleet's remote tier past its local prefix
    (a network call, up to its timeout, would hold up every connection). ``elsewhere(conn)``:
    serve ``conn`` on a worker (``conn.outcome`` SERVE or FAILED); ``end(conn)``: close it."""

    def __init__(
        self, lookups: bool, elsewhere: Callable[[Connection], None], end: Callable[[Connection], None]
    ) -> None:
        self._lookups = lookups
        self._elsewhere = elsewhere
        self._end = end
        self._epoll = select.epoll()
        self._watched: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Given back with a request buffered already: epoll will not tell (by the lock).
        self._incoming: list[int] = []
        # Per tenant, in the order of its turns: its connections with requests to answer (by
        # the loop's thread only). A tenant is dropped when it has none, and joins at the end.
        self._ready: dict[str, deque[int]] = {}
        # Requests left past their last turn: back in line after the connections that became
        # ready meanwhile (appended once the loop has looked for them).
        self._again: list[tuple[str, int]] = []
        self._queued: set[int] = set()  # the connections in ``_ready`` and ``_again``
        self._waker, self._wake_end = socket.socketpair()
        self._waker.setblocking(False)
        self._wake_fd = self._waker.fileno()
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="kvstore-answering", daemon=True)
        self._thread.start()

    def answers(self, op: int) -> bool:
        """Whether requests of operation ``op`` are the loop's to answer."""
        return op in _ID_OPS or (self._lookups and op in _LOOKUP_OPS)

    def watch(self, conn: Connection) -> None:
        """The loop holds ``conn`` until its next request (or its end); does not block."""
        conn.outcome, conn.unsent, conn.error = Outcome.SERVE, b"", None
        conn.partial_since = 0.0
        conn.since = time.monotonic()
        if not conn.tls:  # the loop never reads a TLS one
            conn.sock.setblocking(False)
            conn.stream.forget_timeout()
            conn.stream.held = []
        fd = conn.sock.fileno()
        with self._lock:
            if not self._closed:
                self._watched[fd] = conn
                self._epoll.register(fd, select.EPOLLIN)
                if conn.stream.buffered():
                    self._incoming.append(fd)
                    self._wake()
                return
        self._end(conn)

    def close(self) -> None:
        """End every connection held here and stop; later ``watch`` calls end theirs at once."""
        with self._lock:
            self._closed = True
            self._wake()
        self._thread.join(5.0)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_end.send(b"x")

    # ---------------------------------------------------------------- the loop's thread

    def _run(self) -> None:
        next_idle_check = time.monotonic() + IDLE_CHECK_S
        try:
            while True:
                events = self._epoll.poll(0 if self._ready or self._again else IDLE_CHECK_S)
                if self._closed:  # set before the waker's byte is sent
                    return
                with self._lock:
                    incoming, self._incoming = self._incoming, []
                backlogged = list(dict.fromkeys([*self._ready, *(t for t, _ in self._again)]))
                for fd in [*incoming, *(fd for fd, _ in events)]:
                    if fd == self._wake_fd:
                        with contextlib.suppress(BlockingIOError):
                            self._waker.recv(4096)
                    elif fd not in self._queued and (conn := self._watched.get(fd)) is not None:
                        if conn.tls:
                            self._pass_on(fd, conn, Outcome.SERVE)
                            continue
                        self._ready.setdefault(conn.tenant, deque()).append(fd)
                        self._queued.add(fd)
                for tenant, fd in self._again:
                    self._ready.setdefault(tenant, deque()).append(fd)
                self._again = []
                # Tenants that had nothing waiting go first (as in fair queuing, where a flow
                # that starts anew is next): a quiet tenant's lookup skips the flood's turn.
                self._round([t for t in self._ready if t not in backlogged] + backlogged)
                if (now := time.monotonic()) >= next_idle_check:
                    next_idle_check = now + IDLE_CHECK_S
                    self._pass_on_idle(now)
        finally:
            with self._lock:
                self._closed = True
                left = list(self._watched.items())
            for fd, conn in left:
                self._pass_on(fd, conn, Outcome.CLOSING)
            self._epoll.close()
            self._waker.close()
            self._wake_end.close()

    def _round(self, tenants: list[str]) -> None:
        """One turn for each tenant with requests ready, in the order of ``tenants``, of its
        connection next in turn."""
        for tenant in tenants:
            if (waiting := self._ready.get(tenant)) is None:
                continue
            fd = waiting.popleft()
            if (conn := self._watched.get(fd)) is not None and self._answer(fd, conn):
                self._again.append((tenant, fd))
            else:
                self._queued.discard(fd)
            if not waiting:
                del self._ready[tenant]

    def _answer(self, fd: int, conn: Connection) -> bool:
        """Answer the complete small requests buffered (ANSWERS_PER_TURN at most), then keep
        watching, or pass the connection on; whether requests are left for its next turn."""
        stream = conn.stream
        if not self._whole_at_front(stream.buffered()):  # else those left from its last turn first
            try:
                got = stream.fill_nowait()
            except OSError:
                self._pass_on(fd, conn, Outcome.CLOSED)
                return False
            if got == 0:
                self._pass_on(fd, conn, Outcome.CLOSED)
                return False
        outcome: Outcome | None = None
        more = False
        answered = 0
        try:
            for answered in range(ANSWERS_PER_TURN + 1):
                if not self._whole_at_front(stream.buffered()):
                    break
                if more := answered == ANSWERS_PER_TURN:
                    break  # the others' turn first
                conn.answer()
        except Exception as exc:  # noqa: BLE001 (re-raised by the worker, which reports it)
            conn.error, outcome = exc, Outcome.FAILED
        held, stream.held = stream.held or [], []
        if held:
            data = b"".join(held)
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._pass_on(fd, conn, Outcome.CLOSED)
                return False
            if sent < len(data):
                conn.unsent = data[sent:]
                outcome = outcome or Outcome.SERVE
        if not stream.buffered() or more:
            conn.partial_since = 0.0
        elif outcome is None and self._rest_comes_here(conn, answered):
            conn.partial_since = conn.partial_since if answered == 0 else time.monotonic()
        elif outcome is None:
            outcome = Outcome.SERVE  # another kind, or not all here yet: a worker reads the rest
        if outcome is None:
            conn.since = time.monotonic()  # watched still: no system call to stay here
            return more
        self._pass_on(fd, conn, outcome)
        return False

    def _whole_at_front(self, buffered: memoryview) -> bool:
        """Whether ``buffered`` starts with a whole request of the loop's."""
        return (
            bool(buffered) and self.answers(buffered[0]) and 0 < small_request_size(buffered) <= len(buffered)
        )

    def _rest_comes_here(self, conn: Connection, answered: int) -> bool:
        """Whether the loop waits for the rest of the request begun at the front of the buffer:
        one of its own that fits the buffer, begun behind requests answered in this turn (a
        client pipelining; else a worker reads the rest), and not begun over PARTIAL_S ago.
        Passed on each time, every 500-key lookup pipelined took a thread of its own, and a
        tenant's 250 of them wanted the GIL together."""
        buffered = conn.stream.buffered()
        size = small_request_size(buffered) if self.answers(buffered[0]) else 0
        return (size == -1 or 0 < size <= conn.stream.capacity_bytes) and (
            answered > 0 or conn.partial_since > 0.0
        )

    def _pass_on_idle(self, now: float) -> None:
        with self._lock:
            idle = [(fd, c) for fd, c in self._watched.items() if now - c.since > IDLE_S]
            slow = [
                (fd, c)
                for fd, c in self._watched.items()
                if c.partial_since and now - c.partial_since > PARTIAL_S
            ]
        for fd, conn in idle:
            self._pass_on(fd, conn, Outcome.IDLE)
        for fd, conn in slow:  # a worker reads the rest under the request's deadline
            self._pass_on(fd, conn, Outcome.SERVE)

    def _pass_on(self, fd: int, conn: Connection, outcome: Outcome) -> None:
        """To a worker (a request to serve, an error to send), or the end."""
        with self._lock:
            if self._watched.pop(fd, None) is None:
                return
            self._epoll.unregister(fd)  # before anyone may close it
        self._queued.discard(fd)
        conn.outcome = outcome
        conn.stream.held = None
        if outcome in (Outcome.SERVE, Outcome.FAILED):
            self._elsewhere(conn)
        else:
            self._end(conn)
