"""The seam between the ``Client`` and the way its data calls travel.

A client's data calls go one of three ways, chosen once per client (``Client._transport``):

grpc_transport.py       gRPC unary calls and the Get/Put streams: a server without a data port,
                        or ``data_plane="grpc"``
dataport_transport.py   the server's raw data port over TCP (``kvstore.client.dataport``)
samehost_transport.py   the data port's Unix twin, with the server's arena mapped here
                        (``kvstore.client.mapping``): reads and writes in place

Each implements ``Transport``; the control calls (register, stats, invalidate, ...) are gRPC
whatever the transport. The arena calls (``resolve``, ``reserve``, ``read_into``, ``write``)
are reached only on the same host, the ``Client`` having mapped the arena first: gRPC serves
them too, for a same-host client without a data socket. ``read_resolved`` and
``write_reserved`` are their plain two-phase forms, over any transport.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.client.inplace import copy_hashed, copy_into
from kvstore.client.mapping import ArenaMapping
from kvstore.client.pool import ReceivePool
from kvstore.client.results import Lookup
from kvstore.errors import StoreFull

READ_TTL_S = 30.0  # the pin of a read_into: the copy must end inside it
READ_MARGIN_S = 5.0
WRITE_TTL_S = 30.0  # a pipelined write's reservations, should it die before committing them
RESERVE_TTL_S = 30.0  # a two-phase write's reservation

Blocks = Sequence[bytes | bytearray | memoryview]
# (arena name, (offset, size) of each block, tier of each, lease id)
Resolved = tuple[str, list[tuple[int, int]], tuple[str, ...], int]
# (arena name, reservation id, (offset, size) of each block to write, None: nothing to write)
Reserved = tuple[str, int, list[tuple[int, int] | None]]


class Transport(Protocol):
    """The client's data calls. ``scope`` is the caller's scope within its tenant."""

    def lookup(self, fingerprint: bytes, keys: Sequence[bytes], scope: str) -> int: ...

    def lookup_tiers(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float, scope: str, slots: bool
    ) -> Lookup: ...

    def release(self, lease_id: int, wait: bool) -> None: ...

    def lease_held(self, lease_id: int) -> bool: ...

    def get(
        self, fingerprint: bytes, keys: Sequence[bytes], scope: str, pool: ReceivePool
    ) -> list[memoryview]: ...

    def get_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str, exact: bool
    ) -> int: ...

    def heads(
        self, fingerprint: bytes, keys: Sequence[bytes], head_bytes: int, scope: str
    ) -> list[bytes]: ...

    def put(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> int: ...

    def resolve(self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float, scope: str) -> Resolved: ...

    def reserve(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None,
        ttl_s: float,
        scope: str,
    ) -> Reserved: ...

    def commit(self, reservation_id: int, scope: str, checksums: Sequence[int] = ()) -> int:
        """Publish a reservation's written slots; ``checksums``: the xxh3-64 of each given
        slot's block as written, in order, or none (the server's hasher takes them)."""
        ...

    def abort(self, reservation_id: int, scope: str) -> None: ...

    def read_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str
    ) -> int:
        """The present prefix copied out of the mapped arena into ``outs``; blocks copied."""
        ...

    def write(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> tuple[int, list[int]]:
        """The chain written into the mapped arena in place: (blocks new, indexes of the blocks
        not written: present already, or no room)."""
        ...


def read_resolved(
    transport: Transport,
    mapping: ArenaMapping,
    fingerprint: bytes,
    keys: Sequence[bytes],
    outs: Sequence[memoryview],
    scope: str,
) -> int:
    """``read_into`` in two phases: a resolve (which brings blocks of slower tiers up into the
    arena), the copies, the release."""
    name, slots, _, lease_id = transport.resolve(fingerprint, keys, READ_TTL_S, scope)
    views = mapping.views(name, slots)
    try:
        for view, out in zip(views, outs, strict=False):
            copy_into(out, view)
    finally:
        if lease_id:
            transport.release(lease_id, True)
    return len(views)


def write_reserved(
    transport: Transport,
    mapping: ArenaMapping,
    fingerprint: bytes,
    keys: Sequence[bytes],
    blocks: Blocks,
    parent: bytes | None,
    scope: str,
) -> tuple[int, list[int]]:
    """``write`` in two phases: a reserve, the copies, the commit (an abort on a failure)."""
    name, reservation_id, slots = transport.reserve(
        fingerprint, keys, [len(b) for b in blocks], parent, RESERVE_TTL_S, scope
    )
    views = mapping.slot_views(name, slots)
    try:
        checksums = [
            copy_hashed(view, block) for view, block in zip(views, blocks, strict=True) if view is not None
        ]
    except BaseException:
        transport.abort(reservation_id, "")
        raise
    stored = transport.commit(reservation_id, "", checksums)
    return stored, [i for i, view in enumerate(views) if view is None]


def check_stored(
    stored: int, keys: Sequence[bytes], gaps: Sequence[int], exists: Callable[[list[bytes]], list[bool]]
) -> None:
    """Raise ``StoreFull`` (with ``.stored``) when blocks a write skipped (``gaps``: present
    already, or no room) are not in the store: only the second is a failure."""
    if not gaps:
        return
    missing = sum(not present for present in exists([keys[i] for i in gaps]))
    if missing:
        error = StoreFull(
            f"stored {stored} of {len(keys)} blocks; {missing} found no room in the arena "
            "(full of pinned or reserved blocks) and were not stored"
        )
        error.stored = stored
        raise error
