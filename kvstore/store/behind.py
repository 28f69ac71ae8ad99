"""Write-behind into the persistent tier: each new block is copied to it (nvme) on a thread
soon after it is stored, so a crash of the volatile arena loses only what is still queued.

    offer(block)    under the store lock, for a new block not yet in the persistent tier: queue
                    it; a full queue (``write_behind_max_bytes``) drops and counts, never blocks
    drain(s) / close()

The copy runs on the queue's thread outside the lock, the block held for it (its arena slot
stays put); a block deleted while it was copied loses the copy too.
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

    def _copy_one(self, ident: BlockId) -> None:
        copy_down(self._p, ident, self._t, self._closed, "write_behind_blocks")


def copy_down(parts: StoreParts, ident: BlockId, t: int, closed: Callable[[], bool], counter: str) -> bool:
    """Copy a block into tier ``t`` as well (room made there as eviction would), its faster
    copies kept; the copy runs outside the store lock, the block held so its slot stays put.
    Whether tier ``t`` holds it now (counted under ``counter``). A block deleted while copied
    loses the copy too."""
    p = parts
    with p.locked():
        block = p.index.visible(ident)
        if closed() or block is None or t in block.tiers or not p.placement.make_room(t, block.size_bytes):
            return False
        view = p.placement.bytes_of(block, block.fastest)
        if view is None:
            return False
        p.pins.hold(block)  # its slot stays put (and allocated) until the copy is done
    copied = False
    try:
        p.tiers[t].put(block.tkey, view, block.scope.fingerprint, block.meta)
        copied = True
    except TierError as exc:  # full after all, or closing: the block stays volatile
        log.debug("copying a %d B block into %s: %s", block.size_bytes, p.tiers[t].name, exc)
    finally:
        with p.locked():
            if copied and block.doomed:
                p.tiers[t].delete(block.tkey)  # deleted while copying: the copy goes too
                copied = False
            elif copied:
                p.placement.added(block, t)
                p.counters[counter] += 1
            p.pins.unhold(block)
    return copied
