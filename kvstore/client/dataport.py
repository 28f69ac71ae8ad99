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
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import NamedTuple

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.status import Status
from kvstore.wire import (
    END,
    MAGIC,
    OP_ABORT,
    OP_COMMIT,
    OP_GET,
    OP_LEASE_HELD,
    OP_LOOKUP,
    OP_LOOKUP_SLOTS,
    OP_PUT,
    OP_RELEASE,
    OP_RELEASE_NOWAIT,
    OP_RESERVE,
    OP_RESOLVE,
    TIER_NAMES,
    Stream,
    status_error,
)

IO_TIMEOUT_S = 30.0  # the per-operation default when the caller sets no deadline


class DataPortClient:
    """One connection to a data port; not for use from several threads at once.

    Timeouts: connecting and the hello take at most ``connect_timeout_s`` (default IO_TIMEOUT_S)
    together. Each operation then ends by the deadline given to ``begin`` before it (a
    ``time.monotonic()`` value, or None: IO_TIMEOUT_S per socket operation). A timeout raises
    TimeoutError and leaves the stream mid-message: the connection must be closed, never reused.

    Each request goes out in one send; replies are read through one reused buffer
    (``kvstore.wire.Stream``), so a lookup's status and answer cost one recv.

    A get checks each block it receives against the checksum the server sent with it: a block
    that fails (changed on the way) ends the prefix there, the rest of the answer is read and
    dropped, and ``checksum_failures`` counts it.
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
        hello_deadline = time.monotonic() + timeout_s
        self.last_used = time.monotonic()  # the owner's note, against the server's IDLE_S
        self.checksum_failures = 0
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
        self._stream = Stream(self.sock, IO_TIMEOUT_S)
        try:
            self._stream.begin(hello_deadline)
            self._stream.send(
                MAGIC + struct.pack("<H", len(token_b)) + token_b + struct.pack("<H", len(scope_b)) + scope_b
            )
            self._check()
        except OSError:
            self.sock.close()
            raise
        self._stream.begin(None)

    def begin(self, deadline: float | None) -> None:
        """The next operation ends by ``deadline`` (``time.monotonic()``; None: IO_TIMEOUT_S
        per socket operation)."""
        self._stream.begin(deadline)

    def _check(self) -> None:
        code, message = self._stream.read_status()
        if code != Status.OK:
            self.sock.close()
            raise status_error(code, message)

    def _request(self, op: int, fingerprint: bytes, keys: Sequence[bytes], tail: bytes = b"") -> None:
        """Send a request on keys (one send: header, keys, ``tail``) and read its status."""
        _check_ids(fingerprint, keys)
        self._stream.send(b"".join([_OP_KEYS.pack(op, fingerprint, len(keys)), *keys, tail]))
        self._check()

    def resolve(
        self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float
    ) -> tuple[str, list[tuple[int, int]], tuple[str, ...], int]:
        """(arena name, (offset, size) of each block of the present prefix, their tiers, lease id)."""
        self._request(OP_RESOLVE, fingerprint, keys, struct.pack("<d", ttl_s))
        read = self._stream.read
        (name_len,) = struct.unpack("<H", read(2))
        arena_name = read(name_len).decode()
        (hit,) = struct.unpack("<I", read(4))
        raw = read(17 * hit + 8)
        slots, tiers = [], []
        for offset, size, tier in struct.iter_unpack("<QQB", raw[: 17 * hit]):
            slots.append((offset, size))
            tiers.append(TIER_NAMES.get(tier, "unknown"))
        (lease_id,) = struct.unpack_from("<Q", raw, 17 * hit)
        return arena_name, slots, tuple(tiers), int(lease_id)

    def release(self, lease_id: int, wait: bool = True) -> None:
        if not wait:  # no answer comes: the next request's status is the next thing to read
            self._stream.send(release_request(lease_id))
            return
        self._stream.send(struct.pack("<BQ", OP_RELEASE, lease_id))
        self._check()

    def reserve(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None,
        ttl_s: float,
    ) -> tuple[str, int, list[tuple[int, int] | None]]:
        """(arena name, reservation id, (offset, size) of each key's slot or None: nothing to write)."""
        self.send_reserve(fingerprint, keys, sizes, parent, ttl_s)
        return self.read_reserve(len(keys))

    # A request may go out before the answers of earlier ones are read (the server answers in
    # order, one request at a time): ``send_*`` then ``read_*`` in the order they were sent.

    def send_reserve(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None,
        ttl_s: float,
    ) -> None:
        self._stream.send(reserve_request(fingerprint, keys, sizes, parent, ttl_s))

    def send(self, requests: Sequence[bytes]) -> None:
        """Requests made by the ``*_request`` functions below, in one send; their answers are
        read with ``read_*`` in this order (a ``release_request`` has none)."""
        self._stream.send(b"".join(requests))

    def read_reserve(self, n_keys: int) -> tuple[str, int, list[tuple[int, int] | None]]:
        """The answer of a ``send_reserve`` of ``n_keys`` keys."""
        arena_name, reservation_id, spans = self.read_reserve_spans(n_keys)
        slots: list[tuple[int, int] | None] = [None] * n_keys
        given = iter(zip(spans.offsets, spans.sizes, strict=True))
        for i in spans.given():
            slots[i] = next(given)
        return arena_name, reservation_id, slots

    def read_reserve_spans(self, n_keys: int) -> tuple[str, int, Spans]:
        """``read_reserve`` for a hot loop: the slots as ``Spans`` (no tuple per block)."""
        self._check()
        read = self._stream.read
        (name_len,) = struct.unpack("<H", read(2))
        raw = read(name_len + 8 + _SLOT.size * n_keys)  # name, id and records: one read
        (reservation_id,) = struct.unpack_from("<Q", raw, name_len)
        fields = _records("BQQ", raw, n_keys, name_len + 8)
        return (
            raw[:name_len].decode(),
            int(reservation_id),
            Spans.of(fields[0::3], fields[1::3], fields[2::3]),
        )

    def commit(self, reservation_id: int) -> int:
        self.send_commit(reservation_id)
        return self.read_commit()

    def send_commit(self, reservation_id: int) -> None:
        self._stream.send(commit_request(reservation_id))

    def read_commit(self) -> int:
        """The answer of a ``send_commit``: how many blocks it stored."""
        self._check()
        (stored,) = struct.unpack("<I", self._stream.read(4))
        return int(stored)

    def abort(self, reservation_id: int) -> None:
        self._stream.send(struct.pack("<BQ", OP_ABORT, reservation_id))
        self._check()

    def lookup(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float = 0.0
    ) -> tuple[int, bytes, int]:
        """(hit blocks, the tier code of each hit (``kvstore.wire.TIER_NAMES``), lease id or 0)."""
        self._request(OP_LOOKUP, fingerprint, keys, struct.pack("<d", pin_ttl_s))
        (hit,) = struct.unpack("<I", self._stream.read(4))
        tiers = self._stream.read(hit)
        (lease_id,) = struct.unpack("<Q", self._stream.read(8))
        return hit, tiers, lease_id

    def lookup_slots(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float
    ) -> tuple[int, bytes, int, str, tuple[tuple[int, int] | None, ...]]:
        """``lookup`` pinning, with the arena's name and each hit's (offset, size) in it or None."""
        self.send([lookup_slots_request(fingerprint, keys, pin_ttl_s)])
        return self.read_lookup_slots()

    def read_lookup_slots(self) -> tuple[int, bytes, int, str, tuple[tuple[int, int] | None, ...]]:
        """The answer of a ``lookup_slots_request`` sent with ``send``."""
        hit, tiers, lease_id, name, spans = self.read_lookup_spans()
        places: list[tuple[int, int] | None] = [None] * hit
        in_arena = iter(zip(spans.offsets, spans.sizes, strict=True))
        for i in spans.given():
            places[i] = next(in_arena)
        return hit, tiers, lease_id, name, tuple(places)

    def read_lookup_spans(self) -> tuple[int, bytes, int, str, Spans]:
        """``read_lookup_slots`` for a hot loop: the hits' places as ``Spans`` (``missing``:
        the hits with no arena slot, in a tier below it)."""
        self._check()
        read = self._stream.read
        (hit,) = struct.unpack("<I", read(4))
        tiers = read(hit)
        lease_id, name_len = struct.unpack("<QH", read(10))
        name = read(name_len).decode()
        fields = _records("QQ", read(16 * hit), hit)
        sizes = fields[1::2]
        return hit, tiers, lease_id, name, Spans.of(sizes, fields[0::2], sizes)

    def lease_held(self, lease_id: int) -> bool:
        self._stream.send(struct.pack("<BQ", OP_LEASE_HELD, lease_id))
        self._check()
        return bool(self._stream.read(1)[0])

    def get_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], exact: bool = False
    ) -> int:
        """Copy the present prefix into ``outs`` (each at least as long as its block; with
        ``exact``, each exactly as long)."""
        n = 0

        def into(size: int) -> memoryview:
            if n >= len(outs) or outs[n].nbytes < size or (exact and outs[n].nbytes != size):
                raise InvalidArgument(block_misfit(n, size, exact))
            return outs[n].cast("B")[:size]

        for _ in self._blocks(fingerprint, keys, into):
            n += 1
        return n

    def get(
        self, fingerprint: bytes, keys: Sequence[bytes], take: Callable[[int], memoryview]
    ) -> list[memoryview]:
        """The present prefix's blocks, each received into ``take(its size)``."""
        return list(self._blocks(fingerprint, keys, take))

    def _blocks(
        self, fingerprint: bytes, keys: Sequence[bytes], take: Callable[[int], memoryview]
    ) -> Iterator[memoryview]:
        """Request the blocks; per block of the present prefix, receive it into ``take(size)``
        and yield that view. The stream is whole again once the iterator is exhausted."""
        self._request(OP_GET, fingerprint, keys)
        failed = False
        while True:
            (size,) = struct.unpack("<Q", self._stream.read(8))
            if size == END:
                break
            (checksum,) = struct.unpack("<Q", self._stream.read(8))
            if failed:  # past a block that failed: read to the end of the answer, keep nothing
                self._stream.read_into(memoryview(bytearray(size)))
                continue
            view = take(size)
            self._stream.read_into(view)
            if xxhash.xxh3_64_intdigest(view) != checksum:
                self.checksum_failures += 1
                failed = True
                continue
            yield view
        self._check()

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
        try:
            self._stream.send(b"".join(head))
            for block in blocks:
                self._stream.send(block)
        except OSError:
            pass  # the server refused early and closed: its status says why
        self._check()
        (stored,) = struct.unpack("<I", self._stream.read(4))
        return int(stored)

    def close(self) -> None:
        self.sock.close()


_OP_KEYS = struct.Struct("<B32sI")  # op, fingerprint, key count
_RESERVE_TAIL = struct.Struct("<B32sd")  # has parent, parent, ttl_s
_SLOT = struct.Struct("<BQQ")  # present, offset, size
_OP_ID = struct.Struct("<BQ")  # op, reservation or lease id


class Spans(NamedTuple):
    """Slots of the blocks of a request, as the copies take them: the offsets and sizes of those
    given one, in order, and the indices (in the request) of those that were not."""

    offsets: list[int]
    sizes: list[int]
    missing: list[int]

    @staticmethod
    def of(given: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Spans:
        """From the answer's fields: block i has a slot when ``given[i]`` is not 0."""
        if all(given):  # the usual case: two list copies, nothing per block in Python
            return Spans(list(offsets), list(sizes), [])
        kept = [i for i, g in enumerate(given) if g]
        return Spans(
            [offsets[i] for i in kept], [sizes[i] for i in kept], [i for i, g in enumerate(given) if not g]
        )

    def given(self) -> Iterator[int]:
        """The indices of the blocks given a slot (every one but ``missing``), in order."""
        missing = set(self.missing)
        return (i for i in range(len(self.offsets) + len(missing)) if i not in missing)


RECORDS_PER_STRUCT = 1024  # an answer's records are unpacked by cached structs of up to this many


def _records(fields: str, raw: bytes, count: int, start: int = 0) -> Sequence[int]:
    """The fields of ``count`` little-endian records of ``fields`` in ``raw`` from ``start``, in
    order: one unpack per RECORDS_PER_STRUCT records (~1 us for 32 where ``iter_unpack`` and a
    tuple a record took ~3)."""
    if count <= RECORDS_PER_STRUCT:
        return _repeated(fields, count).unpack_from(raw, start)
    out: list[int] = []
    record = struct.calcsize("<" + fields)
    for first in range(0, count, RECORDS_PER_STRUCT):
        n = min(RECORDS_PER_STRUCT, count - first)
        out.extend(_repeated(fields, n).unpack_from(raw, start + first * record))
    return out


@lru_cache(maxsize=32)  # each at most ~100 KiB
def _repeated(fields: str, count: int) -> struct.Struct:
    return struct.Struct("<" + fields * count)


def _check_ids(fingerprint: bytes, keys: Sequence[bytes]) -> None:
    """The framing has no lengths for ids: refuse a wrong one before it desynchronizes the stream."""
    if len(fingerprint) != 32 or not set(map(len, keys)) <= {32}:
        raise InvalidArgument("keys and fingerprints are 32 bytes")


def reserve_request(
    fingerprint: bytes, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes | None, ttl_s: float
) -> bytes:
    """The bytes of a reserve request (``DataPortClient.send``)."""
    if len(sizes) != len(keys):
        raise InvalidArgument(f"{len(sizes)} sizes for {len(keys)} keys")
    if parent is not None and len(parent) != 32:
        raise InvalidArgument("parent must be a 32-byte key")
    _check_ids(fingerprint, keys)
    tail = _RESERVE_TAIL.pack(parent is not None, parent or bytes(32), ttl_s) + struct.pack(
        f"<{len(sizes)}Q", *sizes
    )
    return b"".join([_OP_KEYS.pack(OP_RESERVE, fingerprint, len(keys)), *keys, tail])


def lookup_slots_request(fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float) -> bytes:
    """The bytes of a pinning lookup that names the arena slots (``DataPortClient.send``)."""
    _check_ids(fingerprint, keys)
    return b"".join(
        [_OP_KEYS.pack(OP_LOOKUP_SLOTS, fingerprint, len(keys)), *keys, struct.pack("<d", pin_ttl_s)]
    )


def release_request(lease_id: int) -> bytes:
    """The bytes of a release that is not answered (``DataPortClient.send``)."""
    return _OP_ID.pack(OP_RELEASE_NOWAIT, lease_id)


def commit_request(reservation_id: int) -> bytes:
    """The bytes of a commit request (``DataPortClient.send``)."""
    return _OP_ID.pack(OP_COMMIT, reservation_id)


def block_misfit(index: int, size: int, exact: bool) -> str:
    """Why block ``index`` of ``size`` B was refused by ``get_into``."""
    return f"block {index} of {size} B does not {'match' if exact else 'fit'} its buffer"
