"""The client end of the data port (``kvstore.wire`` is the protocol; ``kvstore.server.dataport``
the server): one connection, one request at a time, every operation bounded by a deadline.
``kvstore.client.Client`` owns these connections and translates their failures; nothing else
should need this class.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Sequence

from kvstore.errors import InvalidArgument
from kvstore.status import Status
from kvstore.wire import (
    END,
    MAGIC,
    OP_GET,
    OP_LOOKUP,
    OP_PUT,
    OP_RELEASE,
    OP_RESOLVE,
    TIER_NAMES,
    read_status,
    recv_exact,
    recv_into_exact,
    status_error,
    time_left_s,
)

IO_TIMEOUT_S = 30.0  # the per-operation default when the caller sets no deadline


class DataPortClient:
    """One connection to a data port; not for use from several threads at once.

    Timeouts: connecting and the hello take at most ``connect_timeout_s`` (default IO_TIMEOUT_S)
    together. Each operation then ends by ``deadline`` (a ``time.monotonic()`` value the caller
    sets before it, or None: IO_TIMEOUT_S per socket operation). A timeout raises TimeoutError
    and leaves the stream mid-message: the connection must be closed, never reused.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        scope: str = "",
        unix_path: str = "",
        connect_timeout_s: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str = "",
    ) -> None:
        timeout_s = IO_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s
        self.deadline: float | None = time.monotonic() + timeout_s  # the hello's, until it is done
        self.last_used = time.monotonic()  # the owner's note, against the server's IDLE_S
        self._default_timeout = False  # the socket's timeout is IO_TIMEOUT_S
        if unix_path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            try:
                self.sock.connect(unix_path)
            except OSError:
                self.sock.close()
                raise
        else:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                try:
                    self.sock = ssl_context.wrap_socket(self.sock, server_hostname=server_name or host)
                except OSError:
                    self.sock.close()
                    raise
        token_b, scope_b = (token or "").encode(), scope.encode()
        try:
            self._arm()
            self.sock.sendall(
                MAGIC + struct.pack("<H", len(token_b)) + token_b + struct.pack("<H", len(scope_b)) + scope_b
            )
            self._check()
        except OSError:
            self.sock.close()
            raise
        self.deadline = None

    def _arm(self) -> None:
        """Bound the next send by the deadline (sendall's timeout covers the whole send); without
        one, put back IO_TIMEOUT_S if a deadline changed it (a syscall saved on the hot path)."""
        if self.deadline is not None:
            self.sock.settimeout(time_left_s(self.deadline))
            self._default_timeout = False
        elif not self._default_timeout:
            self.sock.settimeout(IO_TIMEOUT_S)
            self._default_timeout = True

    def _recv(self, n: int) -> bytes:
        return recv_exact(self.sock, n, self.deadline)

    def _check(self) -> None:
        code, message = read_status(self.sock, self.deadline)
        if code != Status.OK:
            self.sock.close()
            raise status_error(code, message)

    def resolve(
        self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float
    ) -> tuple[str, list[tuple[int, int]], tuple[str, ...], int]:
        """(arena name, (offset, size) of each block of the present prefix, their tiers, lease id)."""
        _check_ids(fingerprint, keys)
        self._arm()
        self.sock.sendall(
            struct.pack("<B", OP_RESOLVE)
            + fingerprint
            + struct.pack("<I", len(keys))
            + b"".join(keys)
            + struct.pack("<d", ttl_s)
        )
        self._check()
        (name_len,) = struct.unpack("<H", self._recv(2))
        arena_name = self._recv(name_len).decode()
        (hit,) = struct.unpack("<I", self._recv(4))
        raw = self._recv(17 * hit + 8)
        slots, tiers = [], []
        for i in range(hit):
            offset, size, tier = struct.unpack_from("<QQB", raw, 17 * i)
            slots.append((offset, size))
            tiers.append(TIER_NAMES.get(tier, "unknown"))
        (lease_id,) = struct.unpack_from("<Q", raw, 17 * hit)
        return arena_name, slots, tuple(tiers), int(lease_id)

    def release(self, lease_id: int) -> None:
        self._arm()
        self.sock.sendall(struct.pack("<BQ", OP_RELEASE, lease_id))
        self._check()

    def lookup(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float = 0.0
    ) -> tuple[int, tuple[str, ...], int]:
        """(hit blocks, tier of each hit, lease id or 0)."""
        _check_ids(fingerprint, keys)
        self._arm()
        self.sock.sendall(
            struct.pack("<B", OP_LOOKUP)
            + fingerprint
            + struct.pack("<I", len(keys))
            + b"".join(keys)
            + struct.pack("<d", pin_ttl_s)
        )
        self._check()
        (hit,) = struct.unpack("<I", self._recv(4))
        tiers = tuple(TIER_NAMES.get(code, "unknown") for code in self._recv(hit))
        (lease_id,) = struct.unpack("<Q", self._recv(8))
        return hit, tiers, lease_id

    def _request_get(self, fingerprint: bytes, keys: Sequence[bytes]) -> None:
        _check_ids(fingerprint, keys)
        self._arm()
        self.sock.sendall(
            struct.pack("<B", OP_GET) + fingerprint + struct.pack("<I", len(keys)) + b"".join(keys)
        )
        self._check()

    def get_into(self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        """Copy the present prefix into ``outs`` (each at least as long as its block)."""
        self._request_get(fingerprint, keys)
        n = 0
        while True:
            (size,) = struct.unpack("<Q", self._recv(8))
            if size == END:
                break
            if n >= len(outs) or len(outs[n]) < size:
                raise InvalidArgument(f"block {n} of {size} B does not fit its buffer")
            recv_into_exact(self.sock, outs[n][:size], self.deadline)
            n += 1
        self._check()
        return n

    def get(self, fingerprint: bytes, keys: Sequence[bytes]) -> list[bytes]:
        self._request_get(fingerprint, keys)
        blocks: list[bytes] = []
        while True:
            (size,) = struct.unpack("<Q", self._recv(8))
            if size == END:
                break
            blocks.append(self._recv(size))
        self._check()
        return blocks

    def put(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[bytes | bytearray | memoryview],
        parent: bytes | None = None,
    ) -> int:
        _check_ids(fingerprint, keys if parent is None else [*keys, parent])
        head = [
            struct.pack("<B", OP_PUT),
            fingerprint,
            struct.pack("<B32s", parent is not None, parent or b""),
        ]
        head.append(struct.pack("<I", len(keys)))
        head.extend(key + struct.pack("<Q", len(block)) for key, block in zip(keys, blocks, strict=True))
        self._arm()
        try:
            self.sock.sendall(b"".join(head))
            for block in blocks:
                self.sock.sendall(block)
        except OSError:
            pass  # the server refused early and closed: its status says why
        self._check()
        (stored,) = struct.unpack("<I", self._recv(4))
        return int(stored)

    def close(self) -> None:
        self.sock.close()


def _check_ids(fingerprint: bytes, keys: Sequence[bytes]) -> None:
    """The framing has no lengths for ids: refuse a wrong one before it desynchronizes the stream."""
    if len(fingerprint) != 32 or any(len(k) != 32 for k in keys):
        raise InvalidArgument("keys and fingerprints are 32 bytes")
