"""The client end of the data port (``kvstore.wire`` is the protocol, every message encoded and
decoded there; ``kvstore.server.dataport`` the server): one connection, one request at a time, every operation bounded by a deadline.
``kvstore.client.Client`` owns these connections and translates their failures; nothing else
should need this class.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import xxhash

from kvstore import wire
from kvstore.errors import InvalidArgument
from kvstore.status import Status
from kvstore.stream import Stream
from kvstore.wire import (
    OP_ABORT,
    OP_GET,
    OP_LEASE_HELD,
    OP_LOOKUP,
    OP_RELEASE,
    OP_RESOLVE,
    id_request,
    keys_request,
    read_stream_status,
    reserve_request,
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
    (``kvstore.stream.Stream``), so a lookup's status and answer cost one recv.

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
            self._stream.send(wire.hello(token_b, scope_b))
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
        code, message = read_stream_status(self._stream)
        if code != Status.OK:
            self.sock.close()
            raise status_error(code, message)

    def _request(self, request: bytes) -> None:
        """Send a request (one send) and read its status."""
        self._stream.send(request)
        self._check()

    def resolve(
        self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float
    ) -> tuple[str, list[tuple[int, int]], tuple[str, ...], int]:
        """(arena name, (offset, size) of each block of the present prefix, their tiers, lease id)."""
        self._request(keys_request(OP_RESOLVE, fingerprint, keys, ttl_s))
        return wire.read_resolve_answer(self._stream.read)

    def release(self, lease_id: int, wait: bool = True) -> None:
        if not wait:  # no answer comes: the next request's status is the next thing to read
            self._stream.send(wire.release_request(lease_id))
            return
        self._request(id_request(OP_RELEASE, lease_id))

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
        """Requests made by ``kvstore.wire``'s ``*_request`` functions, in one send; their answers
        are read with ``read_*`` in this order (a ``release_request`` has none)."""
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
        name, reservation_id, given, offsets, sizes = wire.read_reserve_answer(self._stream.read, n_keys)
        return name, reservation_id, Spans.of(given, offsets, sizes)

    def commit(self, reservation_id: int, checksums: Sequence[int] = ()) -> int:
        self.send_commit(reservation_id, checksums)
        return self.read_commit()

    def send_commit(self, reservation_id: int, checksums: Sequence[int] = ()) -> None:
        self._stream.send(wire.commit_request(reservation_id, checksums))

    def read_commit(self) -> int:
        """The answer of a ``send_commit``: how many blocks it stored."""
        self._check()
        return wire.read_stored(self._stream.read)

    def abort(self, reservation_id: int) -> None:
        self._request(id_request(OP_ABORT, reservation_id))

    def lookup(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float = 0.0
    ) -> tuple[int, bytes, int]:
        """(hit blocks, the tier code of each hit (``kvstore.wire.TIER_NAMES``), lease id or 0)."""
        self._request(keys_request(OP_LOOKUP, fingerprint, keys, pin_ttl_s))
        return wire.read_lookup_answer(self._stream.read)

    def lookup_slots(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float
    ) -> tuple[int, bytes, int, str, tuple[tuple[int, int] | None, ...]]:
        """``lookup`` pinning, with the arena's name and each hit's (offset, size) in it or None."""
        self.send([wire.lookup_slots_request(fingerprint, keys, pin_ttl_s)])
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
        hit, tiers, lease_id, name, offsets, sizes = wire.read_lookup_slots_answer(self._stream.read)
        return hit, tiers, lease_id, name, Spans.of(sizes, offsets, sizes)

    def heads(self, fingerprint: bytes, keys: Sequence[bytes], head_bytes: int) -> list[bytes]:
        """The first ``head_bytes`` of each block of the present prefix (fewer of a shorter one)."""
        self._request(wire.head_request(fingerprint, keys, head_bytes))
        return wire.read_heads_answer(self._stream.read)

    def lease_held(self, lease_id: int) -> bool:
        self._request(id_request(OP_LEASE_HELD, lease_id))
        return wire.read_held(self._stream.read)

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
        self._request(keys_request(OP_GET, fingerprint, keys))
        failed = False
        while (head := wire.read_block_head(self._stream.read)) is not None:
            size, checksum = head
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
        head = wire.put_head(fingerprint, keys, [len(block) for block in blocks], parent)
        try:
            self._stream.send(head)
            for block in blocks:
                self._stream.send(block)
        except OSError:
            pass  # the server refused early and closed: its status says why
        self._check()
        return wire.read_stored(self._stream.read)

    def close(self) -> None:
        self.sock.close()


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


def block_misfit(index: int, size: int, exact: bool) -> str:
    """Why block ``index`` of ``size`` B was refused by ``get_into``."""
    return f"block {index} of {size} B does not {'match' if exact else 'fit'} its buffer"
