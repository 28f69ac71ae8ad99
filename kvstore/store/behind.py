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

from kvstore.store.model import Block, BlockId
from kvstore.store.parts import StoreParts
from kvstore.store.write_behind import WriteBehind
from tiers import TierError

log = logging.getLogger("kvstore.store")


class PersistBehind:
    def __init__(self, parts: StoreParts, tier: int, max_bytes: int, closed: Callable[[], bool]) -> None:
        self._p = parts
        self._t = tier
        self._closed = closed
        self._copy_one = CopyDown(parts, tier, closed, "write_behind_blocks")
        self._queue: WriteBehind[BlockId] = WriteBehind(self._copy, max_bytes)

    def offer(self, block: Block) -> None:
        if self._t in block.tiers:
            return
        if self._queue.offer(block.ident, block.size_bytes):
            self._p.counters["write_behind_queued_blocks"] += 1
        else:
            self._p.counters["write_behind_dropped_blocks"] += 1

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

    def __init__(self, parts: StoreParts, t: int, closed: Callable[[], bool], counter: str) -> None:
        self._p = parts
        self._t = t
        self._closed = closed
        self._counter = counter
        self._buffer = bytearray()  # reused: one caller thread copies at a time

    def __call__(self, ident: BlockId) -> bool:
        p, t = self._p, self._t
        tier = p.tiers[t]
        with p.locked():
            block = p.index.visible(ident)
            if (
                self._closed()
                or block is None
                or t in block.tiers
                or not p.placement.make_room(t, block.size_bytes)
            ):
                return False
            source = block.fastest
            view = p.placement.bytes_of(block, source)
            if view is None:
                return False
            if p.tiers[source].as_arena() is not None:  # the slot itself: copied before the lock goes
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
        with p.locked():
            if p.index.is_current(block):
                if t not in block.tiers:  # else a demotion put these same bytes there meanwhile
                    p.placement.added(block, t)
                p.counters[self._counter] += 1
                return True
            now = p.index.get(ident)
            if now is None or t not in now.tiers:  # deleted or dropped meanwhile: the copy goes
                tier.delete(block.tkey)
        return False
