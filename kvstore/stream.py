"""One end of a data connection (``kvstore.wire`` is what travels on it): reads through one
reused buffer, and timeouts armed per operation rather than per recv.

Both ends of the data port send each message in one send and read through a ``Stream``, so a
small message costs one recv, and a lookup's round trip is a send and a recv on each side.
This module knows sockets, buffers and deadlines, nothing of the messages.
"""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
import time


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


REARM_S = 0.25


def _rearm(sock: socket.socket, deadline: float | None, armed_at: float) -> float:
    """Bound the next socket operation by ``deadline``; returns when the timeout was armed.

    A timeout armed at ``armed_at`` can end an operation at most (now - armed_at) past the
    deadline: re-arm once that passes REARM_S, not per operation (a TLS socket returns one
    16 KiB record per recv, and a settimeout per record costs). Without a deadline the socket's
    own timeout applies."""
    if deadline is None:
        return armed_at
    now = time.monotonic()
    if now - armed_at > REARM_S:
        sock.settimeout(time_left_s(deadline))
        return now
    return armed_at


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; ``deadline`` (``time.monotonic()``) bounds the whole read, not each recv,
    so a peer trickling bytes cannot stretch it. Without one the socket's own timeout applies."""
    got = 0
    armed_at = -math.inf
    while got < len(view):
        armed_at = _rearm(sock, deadline, armed_at)
        n = sock.recv_into(view[got:], len(view) - got)
        if not n:
            raise ConnectionError("peer closed the data connection mid-message")
        got += n


# A yield that took longer than this gave the CPU to another thread: the spinning one shares its
# CPU with a busy thread (often the very peer it waits for) and sleeps instead.
SHARED_CPU_S = 0.00002


class Stream:
    """One end of a data connection: its reads through one reused buffer, its timeouts.

    ``read(n)`` asks the socket for as much as the buffer holds, so a small message costs one
    recv however many fields it has; what arrived past it stays buffered for the next read.
    ``read_into(view)`` drains the buffer first, then reads straight into ``view`` (a block's
    bytes never pass through the buffer beyond what one read brought along).

    Timeouts: ``begin(deadline)`` starts an operation that must end by ``deadline`` (a
    ``time.monotonic()`` value, or None: ``default_timeout_s`` per socket operation); every
    read and every ``send`` until the next ``begin`` is bounded by it, re-armed as
    ``recv_into_exact`` does. ``wait(timeout_s)`` waits that long for a next message to start.
    A timeout raises TimeoutError and leaves the stream mid-message: close it, never reuse it.
    Not for use from several threads at once.
    """

    def __init__(self, sock: socket.socket, default_timeout_s: float, buffer_bytes: int = 16 << 10) -> None:
        self.sock = sock
        self.deadline: float | None = None
        self._default_timeout_s = default_timeout_s
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the buffered bytes not read yet
        self._armed_at = -math.inf
        self._timeout_s: float | None = sock.gettimeout()  # what the socket has, when known
        self._poller: select.poll | None = None  # for ``spin``, made on its first call
        self.peer_closed = False  # ``wait`` found the peer gone
        # While a list, ``send`` keeps what it is given there instead (to be sent together later).
        self.held: list[bytes | bytearray | memoryview] | None = None

    def begin(self, deadline: float | None) -> None:
        self.deadline = deadline
        self._armed_at = -math.inf

    def _arm(self) -> None:
        if self.deadline is not None:
            self._armed_at = _rearm(self.sock, self.deadline, self._armed_at)
            self._timeout_s = None
        elif self._timeout_s != self._default_timeout_s:  # a syscall saved on the hot path
            self.sock.settimeout(self._default_timeout_s)
            self._timeout_s = self._default_timeout_s

    def spin(self, seconds: float, yielding: bool = False) -> bool:
        """Poll up to ``seconds`` for a next message without sleeping (the GIL free between
        polls), so one that comes soon finds this thread awake, and its sender wakes nobody;
        whether one came. ``yielding``: give the CPU to any other runnable thread between polls
        (the peer, on a machine with fewer CPUs than busy threads)."""
        if self._end > self._start:
            return True
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        poll, now = self._poller.poll, time.monotonic
        end = now() + seconds
        while not poll(0):
            before = now()
            if before >= end:
                return False
            if yielding:
                os.sched_yield()
                if now() - before > SHARED_CPU_S:  # another thread ran here: let it have the CPU
                    return bool(poll(0))  # (unless it was the peer, and its message is here)
        return True

    def wait(self, timeout_s: float) -> bool:
        """Whether a next message starts within ``timeout_s`` (False: timed out, or the peer
        closed between messages: ``peer_closed``)."""
        if self._end > self._start:
            return True
        self._start = self._end = 0
        if self._timeout_s != timeout_s:
            self.sock.settimeout(timeout_s)
            self._timeout_s = timeout_s
        self._armed_at = -math.inf
        try:
            self._end = self.sock.recv_into(self._view)
        except TimeoutError:
            return False
        self.peer_closed = self._end == 0
        return not self.peer_closed

    def buffered(self) -> memoryview:
        """The bytes read and not consumed yet (valid until the next read)."""
        return self._view[self._start : self._end]

    @property
    def capacity_bytes(self) -> int:
        """The most a message may hold to be buffered whole."""
        return len(self._buf)

    def fill_nowait(self) -> int | None:
        """Read what a non-blocking socket holds into the buffer, after the bytes still buffered
        (moved to its front: the start of a message whose rest comes now), without waiting: how
        many bytes (0: the peer closed), None when it held none (or the buffer is full)."""
        left = bytes(self._view[self._start : self._end])
        self._buf[: len(left)] = left
        self._start, self._end = 0, len(left)
        if self._end == len(self._buf):
            return None
        try:
            got = self.sock.recv_into(self._view[self._end :])
        except BlockingIOError:
            return None
        self._end += got
        return got

    def forget_timeout(self) -> None:
        """Someone else set the socket's timeout (or made it non-blocking): set ours again."""
        self._timeout_s = 0.0
        self._armed_at = -math.inf

    def read(self, n: int) -> bytes:
        if n > len(self._buf):  # larger than the buffer: a buffer of its own
            out = bytearray(n)
            self.read_into(memoryview(out))
            return bytes(out)
        if self._end - self._start < n:
            self._fill(n)
        start = self._start
        self._start += n
        return bytes(self._view[start : start + n])

    def _fill(self, n: int) -> None:
        """Buffer at least ``n`` bytes (``n`` at most the buffer's size)."""
        if self._start + n > len(self._buf):  # no room past the leftover: move it to the front
            left = bytes(self._view[self._start : self._end])
            self._buf[: len(left)] = left
            self._start, self._end = 0, len(left)
        while self._end - self._start < n:
            self._arm()
            got = self.sock.recv_into(self._view[self._end :])
            if not got:
                raise ConnectionError("peer closed the data connection mid-message")
            self._end += got

    def read_into(self, view: memoryview) -> None:
        have = min(self._end - self._start, len(view))
        if have:
            view[:have] = self._view[self._start : self._start + have]
            self._start += have
        if have < len(view):
            if self.deadline is None:
                self._arm()  # the default timeout; recv_into_exact arms a deadline itself
            else:
                self._timeout_s = None
            recv_into_exact(self.sock, view[have:], self.deadline)

    def send(self, data: bytes | bytearray | memoryview) -> None:
        if self.held is not None:
            self.held.append(data)
            return
        self._arm()
        self.sock.sendall(data)

    def send_parts(self, head: bytes, body: memoryview) -> None:
        self._arm()
        send_parts(self.sock, head, body)


def send_parts(sock: socket.socket, head: bytes, body: memoryview) -> None:
    """Header and payload in one gathered send (fewer syscalls than two sendall calls)."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS: two records
        sock.sendall(head)
        sock.sendall(body)
        return
    sent = sock.sendmsg([head, body])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent - len(head) < len(body):
        sock.sendall(body[sent - len(head) :])


def time_left_s(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError once it has passed (a zero socket timeout would
    mean non-blocking, not "no time left")."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left
