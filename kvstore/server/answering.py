"""The data port's answering loop: one thread that watches every connection between requests
and answers the small ones itself.

With a thread per connection, each small request (a lookup, a release, a lease check) wakes its
own thread, and that thread then takes the GIL from the others at every socket call: with four
clients looking up at once, a lookup waited for the others' requests piece by piece, and its
p99 went past 2 ms on two CPUs. Here one thread sleeps in ``epoll`` on every parked connection,
answers each complete small request it finds buffered (several in a row without sleeping, their
answers joined into one send: a turn), and hands the connection back to its own thread for
anything else: a request of another kind, one whose bytes have not all come (the thread then
reads the rest under the request's deadline; the rest of one that came behind others answered
in the same turn, a client pipelining, is awaited here, PARTIAL_S at most), an answer the
socket would not take at once (the thread sends the rest under the deadline), an error (the
thread sends the error frame and closes), the peer gone, the connection idle past IDLE_S, or
the port closing. A thread that served a request of another kind waits for its connection's
next request itself (``answers`` says which kinds are the loop's): a write's next one comes
soon, and a hand-over each time cost it.

Turns are shared per tenant first, then per connection within a tenant: each round gives every
tenant with requests ready one turn, of its connection whose turn is next, and the loop looks
for new requests between rounds. A turn is at most ANSWERS_PER_TURN requests, all from one
buffer's read (16 KiB). Given per connection, a tenant with 250 connections pipelining 500-key
lookups took 250 turns of every 251, and another tenant's lookup waited 136 ms (p50); now it
waits for at most one turn of each other tenant.

Order of calls, per connection: its thread calls ``park(parked)`` and blocks until the loop
hands the connection back; ``parked.outcome`` then says why. Only the thread that owns a
connection touches its stream, except between ``park`` and the hand-back, when only the loop
does. TLS connections are never parked (their bytes sit in the TLS layer, out of epoll's sight).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
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
PARTIAL_S = 1.0  # a request begun in the loop whose rest takes longer goes to its thread
# Requests of one connection answered in a row before the others' turn: a client pipelining a
# buffer's worth (1,820 lease checks in 16 KiB) holds up the rest for ~0.2 ms, not ~10 ms.
ANSWERS_PER_TURN = 32


class Outcome(Enum):
    SERVE = "a request to serve"  # its first bytes are buffered in the stream
    CLOSED = "the peer closed the connection"
    IDLE = "idle past IDLE_S"
    CLOSING = "the port is closing"
    FAILED = "a request failed"  # ``parked.error`` says how


@dataclass(eq=False)
class Parked:
    """A connection between requests. ``unsent``: answers the loop could not send at once, for
    the thread to send first; ``error``: what a request the loop answered raised."""

    sock: socket.socket
    stream: Stream
    answer: Callable[[], object]  # serves the request whose bytes are all buffered
    tenant: str  # whose turns this connection shares
    outcome: Outcome = Outcome.SERVE
    unsent: bytes = b""
    error: BaseException | None = None
    since: float = 0.0
    partial_since: float = 0.0  # when the part of a request buffered began to wait for its rest
    _handed: threading.Lock = field(default_factory=threading.Lock)


class AnsweringLoop:
    """One daemon thread; ``park`` from any connection thread, ``close`` once. ``lookups``:
    whether it answers lookups too; not where a lookup may ask the fleet's remote tier past
    its local prefix (a network call, up to its timeout, would hold up every connection)."""

    def __init__(self, lookups: bool) -> None:
        self._lookups = lookups
        self._epoll = select.epoll()
        self._parked: dict[int, Parked] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Per tenant, in the order of its turns: its connections with requests to answer (by
        # the loop's thread only). A tenant is dropped when it has none, and joins at the end.
        self._ready: dict[str, deque[int]] = {}
        # Requests left past their last turn: back in line after the connections that became
        # ready meanwhile (appended once the loop has looked for them).
        self._again: list[tuple[str, int]] = []
        self._queued: set[int] = set()  # the connections in ``_ready`` and ``_again``
        self._waker, self._wake_end = socket.socketpair()
        self._waker.setblocking(False)
        self._epoll.register(self._waker.fileno(), select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="kvstore-answering", daemon=True)
        self._thread.start()

    def answers(self, op: int) -> bool:
        """Whether requests of operation ``op`` are the loop's to answer."""
        return op in _ID_OPS or (self._lookups and op in _LOOKUP_OPS)

    def park(self, parked: Parked) -> Outcome:
        """Hand the connection to the loop until a request needs its thread (or it ends);
        blocks the calling thread until then."""
        parked._handed.acquire()
        parked.outcome, parked.unsent, parked.error = Outcome.SERVE, b"", None
        parked.partial_since = 0.0
        parked.stream.held = []
        parked.since = time.monotonic()
        fd = parked.sock.fileno()
        parked.sock.setblocking(False)
        parked.stream.forget_timeout()
        with self._lock:
            if self._closed:
                parked._handed.release()
                parked.outcome = Outcome.CLOSING
                return parked.outcome
            self._parked[fd] = parked
            self._epoll.register(fd, select.EPOLLIN)
        parked._handed.acquire()  # until the loop releases it
        parked._handed.release()
        parked.stream.held = None
        return parked.outcome

    def close(self) -> None:
        """Hand every parked connection back (Outcome.CLOSING) and stop; later parks return at once."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_end.send(b"x")
        self._thread.join(5.0)

    # ---------------------------------------------------------------- the loop's thread

    def _run(self) -> None:
        next_idle_check = time.monotonic() + IDLE_CHECK_S
        try:
            while True:
                events = self._epoll.poll(0 if self._ready or self._again else IDLE_CHECK_S)
                if self._closed:  # set before the waker's byte is sent
                    return
                backlogged = list(dict.fromkeys([*self._ready, *(t for t, _ in self._again)]))
                for fd, _ in events:
                    if fd not in self._queued and (parked := self._parked.get(fd)) is not None:
                        self._ready.setdefault(parked.tenant, deque()).append(fd)
                        self._queued.add(fd)
                for tenant, fd in self._again:
                    self._ready.setdefault(tenant, deque()).append(fd)
                self._again = []
                # Tenants that had nothing waiting go first (as in fair queuing, where a flow
                # that starts anew is next): a quiet tenant's lookup skips the flood's turn.
                self._round([t for t in self._ready if t not in backlogged] + backlogged)
                if (now := time.monotonic()) >= next_idle_check:
                    next_idle_check = now + IDLE_CHECK_S
                    self._hand_back_idle(now)
        finally:
            with self._lock:
                self._closed = True
                left = list(self._parked.items())
            for fd, parked in left:
                self._hand_back(fd, parked, Outcome.CLOSING)
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
            if (parked := self._parked.get(fd)) is not None and self._answer(fd, parked):
                self._again.append((tenant, fd))
            else:
                self._queued.discard(fd)
            if not waiting:
                del self._ready[tenant]

    def _answer(self, fd: int, parked: Parked) -> bool:
        """Answer the complete small requests buffered (ANSWERS_PER_TURN at most), then keep
        watching, or hand the connection back; whether requests are left for its next turn."""
        stream = parked.stream
        if not self._whole_at_front(stream.buffered()):  # else those left from its last turn first
            try:
                got = stream.fill_nowait()
            except OSError:
                self._hand_back(fd, parked, Outcome.CLOSED)
                return False
            if got == 0:
                self._hand_back(fd, parked, Outcome.CLOSED)
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
                parked.answer()
        except Exception as exc:  # noqa: BLE001 (re-raised by the connection's thread, which reports it)
            parked.error, outcome = exc, Outcome.FAILED
        held, stream.held = stream.held or [], []
        if held:
            data = b"".join(held)
            try:
                sent = parked.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._hand_back(fd, parked, Outcome.CLOSED)
                return False
            if sent < len(data):
                parked.unsent = data[sent:]
                outcome = outcome or Outcome.SERVE
        if not stream.buffered() or more:
            parked.partial_since = 0.0
        elif outcome is None and self._rest_comes_here(parked, answered):
            parked.partial_since = parked.partial_since if answered == 0 else time.monotonic()
        elif outcome is None:
            outcome = Outcome.SERVE  # another kind, or not all here yet: its thread reads the rest
        if outcome is None:
            parked.since = time.monotonic()  # watched still: no system call to stay parked
            return more
        self._hand_back(fd, parked, outcome)
        return False

    def _whole_at_front(self, buffered: memoryview) -> bool:
        """Whether ``buffered`` starts with a whole request of the loop's."""
        return (
            bool(buffered) and self.answers(buffered[0]) and 0 < small_request_size(buffered) <= len(buffered)
        )

    def _rest_comes_here(self, parked: Parked, answered: int) -> bool:
        """Whether the loop waits for the rest of the request begun at the front of the buffer:
        one of its own that fits the buffer, begun behind requests answered in this turn (a
        client pipelining; else its thread reads the rest), and not begun over PARTIAL_S ago.
        Handed to its thread each time, every 500-key lookup pipelined woke a thread of its
        own, and a tenant's 250 of them wanted the GIL together."""
        buffered = parked.stream.buffered()
        size = small_request_size(buffered) if self.answers(buffered[0]) else 0
        return (size == -1 or 0 < size <= parked.stream.capacity_bytes) and (
            answered > 0 or parked.partial_since > 0.0
        )

    def _hand_back_idle(self, now: float) -> None:
        with self._lock:
            idle = [(fd, p) for fd, p in self._parked.items() if now - p.since > IDLE_S]
            slow = [
                (fd, p)
                for fd, p in self._parked.items()
                if p.partial_since and now - p.partial_since > PARTIAL_S
            ]
        for fd, parked in idle:
            self._hand_back(fd, parked, Outcome.IDLE)
        for fd, parked in slow:  # its thread reads the rest under the request's deadline
            self._hand_back(fd, parked, Outcome.SERVE)

    def _hand_back(self, fd: int, parked: Parked, outcome: Outcome) -> None:
        with self._lock:
            if self._parked.pop(fd, None) is None:
                return
            self._epoll.unregister(fd)  # before its thread may close it
        parked.outcome = outcome
        parked._handed.release()
