"""The store's remote tier (``tiers/remote.py``): a store the whole fleet shares, under the
local tiers. Every remote call runs outside the store lock, bounded by the backend's timeout,
and a failing remote reads as misses: a dead shared store costs recomputation, never an error.

Calls (from the facade):
    more(scope, keys)        -> how many leading ``keys`` the remote holds that a read-through
                                would take (asked after the local prefix ends; ``lookup``
                                reports them as tier ``remote``): the tier's ``heads``, asked
                                with the read-through's ``not_before_s``, so no copy past its
                                retention, older than the scope's last invalidation or sealed
                                under a key this sidecar lacks is promised
    read_through(scope, keys)
                             before a restore: fetch the remote blocks that continue the local
                                prefix and store them locally (``put``, into the first tier
                                with room, as any new block, keeping the remote copy's birth
                                time: retention counts from it), so the restore reads them like
                                any other; they are not written back to the remote. A remote
                                copy past the scope's retention is a miss (deleted there)
    offer(block)             under the lock: queue a new local block for the remote
                                (write-behind, bounded by ``max_queue_bytes``: a full queue drops
                                and counts, never blocks a put or the engine)
    forget(scope, keys) / forget_namespace(namespace, fingerprint)
                             deletion and invalidation reach the remote too
    close()                  drain the queue (bounded), stop its thread, close the backend

Counters: ``remote_lookup_hit_blocks``, ``remote_filled_blocks``, ``remote_queued_blocks``,
``remote_dropped_blocks`` (queue full), ``remote_stored_blocks`` (new on the remote),
``remote_handled_blocks`` (taken off the queue: queued = handled once it is empty); the
backend's own figures are in ``usage()``.

Remote copies carry no pin: a block a lookup reported as ``remote`` may be gone when the restore
asks for it, and the restore then gets a shorter prefix (and recomputes the rest), as a
client's contract already allows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from kvstore.errors import StoreFull
from kvstore.keys import BlockKey, Fingerprint
from kvstore.store.counts import Counts
from kvstore.store.governance import Governance
from kvstore.store.index import BlockIndex
from kvstore.store.invalidations import FleetInvalidations
from kvstore.store.model import MARK_FINGERPRINT, Block, BlockId, Scope, tier_key
from kvstore.store.parts import Locked
from kvstore.store.pins import Pins
from kvstore.store.placement import Placement
from kvstore.store.write_behind import WriteBehind
from tiers import BytesLike
from tiers.remote import RemoteBlock, RemoteTier, RemoteUsage

log = logging.getLogger("kvstore.store")

Put = Callable[[Scope, Sequence[BlockKey], Sequence[BytesLike], BlockKey | None, int, Sequence[float]], int]


class RemoteCalls:
    def __init__(
        self,
        remote: RemoteTier,
        lock: Locked,
        counts: Counts,
        index: BlockIndex,
        pins: Pins,
        placement: Placement,
        governance: Governance,
        wall_clock: Callable[[], float],
        put: Put,
        max_queue_bytes: int,
        poll_s: float = 0.5,
        record: Path | None = None,
    ) -> None:
        self.tier = remote
        self._lock = lock
        self._counts = counts
        self._index = index
        self._pins = pins
        self._placement = placement
        self._governance = governance
        self._wall = wall_clock
        self._put = put  # the store's put, not written back to the remote
        self._queue: WriteBehind[BlockId] = WriteBehind(
            self._copy, max_queue_bytes, name="kvstore-remote-behind"
        )
        # the fleet's invalidations: caught up with here, before the store serves
        self.marks = FleetInvalidations(remote, lock, counts, index, pins, poll_s, record)
        self.marks.start()

    def more(self, scope: Scope, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        heads = self.tier.heads(
            [tier_key(scope, k) for k in keys], scope.fingerprint, self._not_before(scope)
        )
        n = _leading([h is not None for h in heads])
        if n:
            with self._lock:
                self._counts.count(scope, "remote_lookup_hit_blocks", n)
        return n

    def read_through(self, scope: Scope, keys: Sequence[BlockKey]) -> int:
        """Before a restore: the remote blocks that continue the local prefix of ``keys`` are
        stored here (none when there is no local room for them: the restore gets the local
        prefix). Returns how many."""
        index = self._index
        with self._lock:
            scope = index.intern(scope)
            local = 0
            while local < len(keys) and index.visible((scope, keys[local])) is not None:
                local += 1
        try:
            return self.fill(scope, keys, local)
        except StoreFull as exc:
            log.debug("read-through from the remote tier: %s", exc)
            return 0

    def fill(self, scope: Scope, keys: Sequence[BlockKey], start: int) -> int:
        """Store locally the remote blocks continuing the local prefix ``keys[:start]``."""
        rest = keys[start:]
        if not rest:
            return 0
        born: list[float] = []
        payloads = self.tier.get_many(
            [tier_key(scope, k) for k in rest], scope.fingerprint, self._not_before(scope), born
        )
        n = _leading([b is not None for b in payloads])
        if not n:
            return 0
        blocks = [b for b in payloads[:n] if b is not None]
        parent = keys[start - 1] if start else None
        stored = self._put(scope, rest[:n], blocks, parent, start, born[:n])  # the clock goes on
        with self._lock:
            self._counts.count(scope, "remote_filled_blocks", stored)
        return stored

    def _not_before(self, scope: Scope) -> float:
        """The oldest birth a remote copy of ``scope`` may have to be served: its retention's,
        or the scope's last invalidation (a copy born before it, sent late by a lagging sidecar)."""
        retention = self._governance.retention_of(scope.namespace)
        not_before_s = 0.0 if retention is None else self._wall() - retention
        return max(not_before_s, self.marks.dead_before(scope))

    def offer(self, block: Block) -> None:
        """Queue a new block for the remote (under the lock; never blocks)."""
        if self._queue.offer(block.ident, block.size_bytes):
            self._counts["remote_queued_blocks"] += 1
        else:
            self._counts["remote_dropped_blocks"] += 1

    def forget(self, scope: Scope, keys: Sequence[BlockKey]) -> int:
        return self.tier.delete_many([tier_key(scope, k) for k in keys]) if keys else 0

    def forget_namespace(
        self, namespace: str | None, fingerprint: Fingerprint | None, known: Iterable[str]
    ) -> int:
        """Invalidation: a namespace (all of it, or one fingerprint in it), one fingerprint in
        every namespace (those in ``known``: a remote key begins with its namespace), or, with
        neither, everything under this store's remote keys; then the marks that carry it to
        the other sidecars (``kvstore.store.invalidations``)."""
        at_s = self._wall()  # after the local blocks went: every one was born before it
        namespaces = [namespace] if namespace is not None else sorted(known)
        # the marks and ledgers stay: they are the record of this and every earlier invalidation
        if namespace is None and fingerprint is None:
            removed = self.tier.delete_matching(b"", MARK_FINGERPRINT)
        else:
            removed = sum(
                self.tier.delete_matching(_prefix(ns) + (fingerprint or b""), MARK_FINGERPRINT)
                for ns in namespaces
            )
        self.marks.post(namespace, fingerprint, namespaces, at_s)
        return removed

    def usage(self) -> RemoteUsage:
        return self.tier.usage()

    def drain(self, timeout_s: float) -> bool:
        return self._queue.drain(timeout_s)

    def close(self) -> None:
        self.marks.close()
        self._queue.close()
        self.tier.close()

    def _copy(self, idents: Sequence[BlockId]) -> None:
        """The queue's thread: send a batch of new blocks, each held for the send."""
        held: list[tuple[Block, memoryview]] = []
        with self._lock:
            for ident in idents:
                block = self._index.visible(ident)
                if block is None or block.stored_at_s <= self.marks.dead_before(block.scope):
                    continue  # deleted, evicted or invalidated meanwhile: nothing to send
                view = self._placement.bytes_of(block, block.fastest)
                if view is not None:
                    self._pins.hold(block)
                    held.append((block, view))
        try:
            stored = self.tier.put_many(
                [
                    RemoteBlock(
                        block.tkey, block.scope.fingerprint, view, block.stored_at_s, block.expires_at_s
                    )
                    for block, view in held
                ]
            )
        finally:
            with self._lock:
                for block, _ in held:
                    self._pins.unhold(block)
        with self._lock:
            self._counts["remote_stored_blocks"] += stored
            self._counts["remote_handled_blocks"] += len(idents)  # sent, or gone before their turn


def _prefix(namespace: str) -> bytes:
    """How the tier keys of a namespace begin (``kvstore.store.model.tier_key``)."""
    ns = namespace.encode()
    return bytes([len(ns)]) + ns


def _leading(flags: Sequence[bool]) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
