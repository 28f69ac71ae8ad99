"""The data port's wire protocol, spoken by both ends (``kvstore.server.dataport`` serves it,
``kvstore.client.dataport`` speaks it): the opcodes, the frames and the socket helpers that read
and write them under a deadline.

Framing (little-endian), one request at a time per connection:

    hello    client: b"KVD1" u16 len + bearer token, u16 len + scope   server: status
    resolve  client: u8 4, fingerprint[32], u32 n, n x key[32], f64 ttl_s      (Unix socket only)
             server: status, u16 len + arena name, u32 hit, hit x (u64 offset, u64 size, u8 tier),
                     u64 lease id
    release  client: u8 5, u64 lease id                                       server: status
    lookup   client: u8 3, fingerprint[32], u32 n, n x key[32], f64 pin_ttl_s
             server: status, u32 hit, hit x u8 tier (1 hbm, 2 dram, 3 nvme, 4 remote), u64 lease id
    get      client: u8 1, fingerprint[32], u32 n, n x key[32]
             server: status; per block of the present prefix: u64 size + bytes; u64 END; status
    put      client: u8 2, fingerprint[32], u8 has_parent, parent[32], u32 n, n x (key[32], u64 size),
                     then the n payloads back to back
             server: status, u32 stored
    status   u8 gRPC status code (0 = OK, ``kvstore.status.Status``), u32 len + UTF-8 message

A request that fails is answered with its status and the connection closes. The message of a
failure starts with its detail in brackets, ``[LeaseExpired] lease 7 expired ...``: the name of
the error class the server raised (``kvstore.status``), which the client raises again. A client
that knows no details reads the code alone, as before, and shows the bracket as part of the text.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

from kvstore.errors import KvStoreError
from kvstore.status import error_for, status_of

MAGIC = b"KVD1"
OP_GET, OP_PUT, OP_LOOKUP, OP_RESOLVE, OP_RELEASE = 1, 2, 3, 4, 5
OP_NAMES = {OP_GET: "Get", OP_PUT: "Put", OP_LOOKUP: "Lookup", OP_RESOLVE: "Resolve", OP_RELEASE: "Release"}
TIER_CODES = {"hbm": 1, "dram": 2, "nvme": 3, "remote": 4}  # the Tier enum of the proto
TIER_NAMES = {v: k for k, v in TIER_CODES.items()}
END = (1 << 64) - 1  # the size that ends a get's blocks
IDLE_S = 600.0  # the server closes a connection idle between requests longer than this


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


REARM_S = 0.25


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; ``deadline`` (``time.monotonic()``) bounds the whole read, not each recv,
    so a peer trickling bytes cannot stretch it. Without one the socket's own timeout applies."""
    got = 0
    armed_at = -REARM_S
    while got < len(view):
        if deadline is not None:
            # A timeout armed at ``armed_at`` can end a recv at most (now - armed_at) past the
            # deadline: re-arm once that passes REARM_S, not per recv (a TLS socket returns
            # one 16 KiB record per recv, and a settimeout per record costs).
            now = time.monotonic()
            if now - armed_at > REARM_S:
                sock.settimeout(time_left_s(deadline))
                armed_at = now
        n = sock.recv_into(view[got:], len(view) - got)
        if not n:
            raise ConnectionError("peer closed the data connection mid-message")
        got += n


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
