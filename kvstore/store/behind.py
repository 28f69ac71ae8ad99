"""Write-behind into the persistent tier: each new block is copied to it (nvme) on a thread
soon after it is stored, so a crash of the volatile arena loses only what is still queued.

    offer(block)    under the store lock, for a new block not yet in the persistent tier: queue
                    it; a full queue (``write_behind_max_bytes``) drops and counts, never blocks
    drain(s) / close()

The copy runs on the queue's thread (``CopyDown``: the bytes taken under the lock, the put
outside it, nothing held); a block deleted while it was copied loses the copy too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvstore.store.counts import Counts
from kvstore.store.index import BlockIndex
from kvstore.store.model import Block, BlockId
from kvstore.store.parts import Locked
from kvstore.store.placement import Placement
from kvstore.store.write_behind import WriteBehind
from tiers import Tier, TierError

log = logging.getLogger("kvstore.store")


class PersistBehind:
    def __init__(self, copy: CopyDown, counts: Counts, max_bytes: int) -> None:
        self._t = copy.t
        self._counts = counts
        self._copy_one = copy  # counting "write_behind_blocks"
        self._queue: WriteBehind[BlockId] = WriteBehind(self._copy, max_bytes)

    def offer(self, block: Block) -> None:
        if self._t in block.tiers:
            return
        if self._queue.offer(block.ident, block.size_bytes):
            self._counts["write_behind_queued_blocks"] += 1
        else:
            self._counts["write_behind_dropped_blocks"] += 1

    def drain(self, timeout_s: float) -> bool:
        return self._queue.drain(timeout_s)

    def close(self) -> None:
        self._queue.close()

    def _copy(self, idents: Sequence[BlockId]) -> None:
        for ident in idents:
            self._copy_one(ident)


class CopyDown:
    """Copies a block into tier ``t`` as well (room made there as eviction would), its faster
    copies kept; ``copy(ident)`` says whether tier ``t`` holds it now (counted under
    ``counter``). Write-behind and the arena's cleaner copy with it.

    It holds no block: under the store lock the block's bytes are copied out of its fastest
    tier into a buffer of the copier's own (one memcpy out of an arena slot), and the put into
    tier ``t`` runs outside the lock. A held block would stand in eviction's way, and with it
    every block above it in its chain (a chain leaves a tier tail first): a restore needing the
    whole arena would find no room while a copy ran. After the put it looks again under the
    lock: a block still current gets its copy counted (unless a demotion put the same bytes
    there meanwhile); a copy whose block was deleted or dropped meanwhile is deleted, unless a
    block stored since under the same key holds it.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        t: int,
        lock: Locked,
        index: BlockIndex,
        placement: Placement,
        counts: Counts,
        counter: str,
        closed: Callable[[], bool],
    ) -> None:
        self._tiers = tiers
        self.t = t
        self.tier = tiers[t]
        self._lock = lock
        self._index = index
        self._placement = placement
        self._counts = counts
        self._closed = closed
        self._counter = counter
        self._buffer = bytearray()  # reused: one caller thread copies at a time

    def __call__(self, ident: BlockId) -> bool:
        t, index, placement = self.t, self._index, self._placement
        tier = self.tier
        with self._lock:
            block = index.visible(ident)
            if (
                self._closed()
                or block is None
                or t in block.tiers
                or not placement.make_room(t, block.size_bytes)
            ):
                return False
            source = block.fastest
            view = placement.bytes_of(block, source)
            if view is None:
                return False
            if self._tiers[source].as_arena() is not None:  # the slot itself: copied before the lock goes
                if len(self._buffer) < len(view):
                    self._buffer = bytearray(len(view))
                copy = memoryview(self._buffer)[: len(view)]
                copy[:] = view
                view = copy
        try:
            tier.put(block.tkey, view, block.scope.fingerprint, block.meta)
        except TierError as exc:  # full after all, or closing: the block stays volatile
            log.debug("copying a %d B block into %s: %s", block.size_bytes, tier.name, exc)
            return False
        with self._lock:
            if index.is_current(block):
                if t not in block.tiers:  # else a demotion put these same bytes there meanwhile
                    placement.added(block, t)
                self._counts[self._counter] += 1
                return True
            now = index.get(ident)
            if now is None or t not in now.tiers:  # deleted or dropped meanwhile: the copy goes
                tier.delete(block.tkey)
        return False
