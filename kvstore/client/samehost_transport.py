"""The same-host transport: the data port's Unix twin, with the server's arena mapped here.

Blocks move through the arena, not the socket: ``get`` and ``read_into`` copy a prefix held in
the arena straight out of it, ``put`` and ``write`` copy into it in place, the socket carrying
only the lookups, reservations and commits that name the slots, pipelined with the copies
(``kvstore.client.inplace``). What the arena cannot serve goes through the socket as over TCP:
a prefix with a block in a slower tier, blocks that find no room, a client that cannot map the
arena (another container without the server's ``/dev/shm``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.client import transport
from kvstore.client.connections import DataConnections
from kvstore.client.dataport_transport import DataPortTransport
from kvstore.client.inplace import Buffers, read_pipelined, write_pipelined
from kvstore.client.mapping import ArenaMapping
from kvstore.client.pool import ReceivePool
from kvstore.client.results import Lookup
from kvstore.client.transport import Blocks, check_stored, read_resolved
from kvstore.errors import FailedPrecondition, KvStoreError, StoreFull, Unavailable
from kvstore.wire import TIER_NAMES

Exists = Callable[[bytes, Sequence[bytes], str], list[bool]]  # the client's Exists call


class SameHostTransport(DataPortTransport):
    def __init__(self, connections: DataConnections, mapping: ArenaMapping, exists: Exists) -> None:
        super().__init__(connections, mapping)
        self._exists = exists

    def lookup_tiers(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float, scope: str, slots: bool
    ) -> Lookup:
        if not (slots and pin_ttl_s > 0):
            return super().lookup_tiers(fingerprint, keys, pin_ttl_s, scope, slots)
        hit, codes, lease_id, name, places = self._data.call(
            scope, lambda c: c.lookup_slots(fingerprint, keys, pin_ttl_s)
        )
        return Lookup(hit, tuple(TIER_NAMES.get(code, "unknown") for code in codes), lease_id, name, places)

    def get(
        self, fingerprint: bytes, keys: Sequence[bytes], scope: str, pool: ReceivePool
    ) -> list[memoryview]:
        if self._mapping.mapped():
            views: list[memoryview] = []

            def taken(_: int, sizes: list[int]) -> list[memoryview]:
                part = pool.take_many(sizes)
                views.extend(part)
                return part

            # the pool's look at which buffers are free, and the views of them, made while the
            # first lookup is answered
            got = self._from_arena(fingerprint, keys, scope, taken, lambda: pool.begin(expect=len(keys)))
            if got is not None:
                return views
        return super().get(fingerprint, keys, scope, pool)

    def put(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> int:
        stored = 0
        if self._mapping.mapped():
            try:
                new, gaps = self.write(fingerprint, keys, blocks, parent, scope)
                check_stored(new, keys, gaps, lambda skipped: self._exists(fingerprint, skipped, scope))
                return new
            except StoreFull as exc:  # the rest through the socket: the blocks in are skipped
                stored = exc.stored
            except FailedPrecondition:  # no arena to write in place (or a throttled one)
                pass
        return stored + super().put(fingerprint, keys, blocks, parent, scope)

    def read_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str
    ) -> int:
        """When the arena holds every block of the prefix (the usual case), pinning lookups name
        the slots and each release goes out without waiting for its answer; otherwise a
        ``resolve`` first copies the others into the arena."""
        hit = self._from_arena(
            fingerprint, keys, scope, lambda first, sizes: outs[first : first + len(sizes)]
        )
        if hit is not None:
            return hit
        return read_resolved(self, self._mapping, fingerprint, keys, outs, scope)

    def write(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> tuple[int, list[int]]:
        """In chunks, pipelined: the server reserves and commits chunks while this thread
        copies others."""
        unconfirmed: list[int] = []
        try:
            return self._data.call(
                scope,
                lambda c: write_pipelined(
                    c,
                    self._mapping.region,
                    fingerprint,
                    keys,
                    blocks,
                    parent,
                    transport.WRITE_TTL_S,
                    unconfirmed,
                ),
            )
        except BaseException:
            self._abort_quietly(unconfirmed, scope)
            raise

    def _from_arena(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        scope: str,
        buffers: Buffers,
        meanwhile: Callable[[], object] | None = None,
    ) -> int | None:
        """The present prefix copied straight out of the arena into ``buffers(first, sizes)``;
        how many blocks are present (``kvstore.client.inplace.read_pipelined``). None when a
        block of the prefix is in a tier below the arena: the caller reads the way that brings
        it up."""
        # the TTLs are read here, at each call (a test shortens them)
        pin_s, margin_s = transport.READ_TTL_S, transport.READ_MARGIN_S
        return self._data.call(
            scope,
            lambda c: read_pipelined(
                c, self._mapping.region, fingerprint, keys, pin_s, margin_s, buffers, meanwhile
            ),
        )

    def _abort_quietly(self, reservation_ids: Sequence[int], scope: str) -> None:
        """Hand back what a failed write reserved; a server that is gone lets them expire."""
        for reservation_id in reservation_ids:
            try:
                self.abort(reservation_id, scope)
            except Unavailable:
                return
            except KvStoreError:  # committed after all, or expired: nothing to give back
                continue
