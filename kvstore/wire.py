"""The data port's wire protocol, spoken by both ends (``kvstore.server.dataport`` serves it,
``kvstore.client.dataport`` speaks it): the opcodes, the frames and the socket helpers that read
and write them under a deadline.

Framing (little-endian), one request at a time per connection:

    hello    client: b"KVD2" u16 len + bearer token, u16 len + scope   server: status
    resolve  client: u8 4, fingerprint[32], u32 n, n x key[32], f64 ttl_s      (Unix socket only)
             server: status, u16 len + arena name, u32 hit, hit x (u64 offset, u64 size, u8 tier),
                     u64 lease id
    release  client: u8 5, u64 lease id                                       server: status
             (u8 9, u64 lease id: the same without an answer; a lease the server cannot
             release, expired or unknown, is ignored)
    reserve  client: u8 6, fingerprint[32], u32 n, n x key[32], u8 has_parent, parent[32],
                     f64 ttl_s, n x u64 size                                  (Unix socket only)
             server: status, u16 len + arena name, u64 reservation id,
                     n x (u8 present, u64 offset, u64 size)
    commit   client: u8 7, u64 reservation id                         server: status, u32 stored
    abort    client: u8 8, u64 reservation id                                 server: status
    lookup   client: u8 3, fingerprint[32], u32 n, n x key[32], f64 pin_ttl_s
             server: status, u32 hit, hit x u8 tier (1 hbm, 2 dram, 3 nvme, 4 remote), u64 lease id
    lookup with slots (Unix socket only): client as lookup, with u8 10
             server: status, u32 hit, hit x u8 tier, u64 lease id, u16 len + arena name,
                     hit x (u64 offset, u64 size): the slot of each pinned hit the arena holds
                     (size 0: none; the reader copies the rest through resolve)
    lease held  client: u8 11, u64 lease id             server: status, u8 1 held / 0 not
    get      client: u8 1, fingerprint[32], u32 n, n x key[32]
             server: status; per block of the present prefix: u64 size, u64 xxh3-64 of the
                     bytes (checked by the server before it sends them, by the client after it
                     receives them), the bytes; u64 END; status
    put      client: u8 2, fingerprint[32], u8 has_parent, parent[32], u32 n, n x (key[32], u64 size),
                     then the n payloads back to back
             server: status, u32 stored
    status   u8 gRPC status code (0 = OK, ``kvstore.status.Status``), u32 len + UTF-8 message

A request that fails is answered with its status and the connection closes. The message of a
failure starts with its detail in brackets, ``[LeaseExpired] lease 7 expired ...``: the name of
the error class the server raised (``kvstore.status``), which the client raises again. A client
that knows no details reads the code alone, as before, and shows the bracket as part of the text.

Both ends send each message in one send (a reply's status with its body) and read through a
``Stream``: one reused buffer, so a small message costs one recv, and a timeout armed per
operation rather than per recv. A lookup's round trip is then a send and a recv on each side.
"""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
import struct
import time

from kvstore.errors import KvStoreError
from kvstore.status import Status, error_for, status_of

MAGIC = b"KVD2"  # 2: a get's blocks carry their checksum
OK_FRAME = struct.pack("<BI", Status.OK, 0)  # a status frame: OK, no message
OP_GET, OP_PUT, OP_LOOKUP, OP_RESOLVE, OP_RELEASE = 1, 2, 3, 4, 5
OP_RESERVE, OP_COMMIT, OP_ABORT, OP_RELEASE_NOWAIT = 6, 7, 8, 9
OP_LOOKUP_SLOTS, OP_LEASE_HELD = 10, 11
OP_NAMES = {
    OP_GET: "Get",
    OP_PUT: "Put",
    OP_LOOKUP: "Lookup",
    OP_LOOKUP_SLOTS: "Lookup",
    OP_LEASE_HELD: "LeaseHeld",
    OP_RESOLVE: "Resolve",
    OP_RELEASE: "Release",
    OP_RELEASE_NOWAIT: "Release",
    OP_RESERVE: "Reserve",
    OP_COMMIT: "Commit",
    OP_ABORT: "Abort",
}
TIER_CODES = {"hbm": 1, "dram": 2, "nvme": 3, "remote": 4}  # the Tier enum of the proto
TIER_NAMES = {v: k for k, v in TIER_CODES.items()}
END = (1 << 64) - 1  # the size that ends a get's blocks
IDLE_S = 600.0  # the server closes a connection idle between requests longer than this


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
        closed between messages)."""
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
        return self._end > 0

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

    def read_status(self) -> tuple[int, str]:
        """The code (a ``Status`` number) and message of a status frame, the detail left in."""
        frame = self.read(5)
        if frame == OK_FRAME:  # the usual answer: one compare, nothing unpacked
            return Status.OK, ""
        code, length = struct.unpack("<BI", frame)
        return code, self.read(length).decode(errors="replace") if length else ""

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


def send_error(sock: socket.socket, error: KvStoreError) -> None:
    """The status frame of a failure: its code and, before its message, its detail."""
    code, detail = status_of(error)
    body = f"[{detail}] {error}".encode()
    sock.sendall(struct.pack("<BI", code, len(body)) + body)


def read_status(sock: socket.socket, deadline: float | None = None) -> tuple[int, str]:
    """The code (a ``Status`` number) and message of a status frame, the detail left in."""
    code, length = struct.unpack("<BI", recv_exact(sock, 5, deadline))
    return code, recv_exact(sock, length, deadline).decode(errors="replace")


def status_error(code: int, message: str) -> KvStoreError:
    """The exception for a failed status frame: the detail taken off the message."""
    detail, sep, rest = message[1:].partition("] ") if message.startswith("[") else ("", "", "")
    if sep and detail.isidentifier():
        return error_for(code, rest, detail)
    return error_for(code, message)


def time_left_s(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError once it has passed (a zero socket timeout would
    mean non-blocking, not "no time left")."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left
