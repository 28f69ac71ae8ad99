"""Placement: which tier gets a copy, room made by demoting down the tiers, spill on close.

Calls (store lock held):
    place(block, data, lowest, highest, evict)  a copy into the first tier in [lowest, highest]
                                                that has room or (``evict``) can make it
    make_room(t, size)     evict from tier t until size fits; whether it does
    demote(block, t)       move a block's only copy out of t into the next tier with free room
                           (nothing evicted for it); whether it left t
    forget_tier(block, t)  the copy in t goes; a block left with no copy leaves the index
    drop(block)            every copy and the entry go (a freed doomed block, a quota victim)
    bytes_of(block, t)     the bytes to copy from tier t: the arena slot itself, or a scratch
                           copy read from a slower medium
    read(block, t, out)    a verified read, or None (a failed checksum or a dead medium)
    spill(target)          copy every volatile-only block to ``target``, parents first
    copy_down(blocks, target, data_of)   what spill does, for any blocks (salvage uses it)
    settle(t)              free arena tier t's retired slots whose copies below are written;
                           the paced writes' line (``kvstore.store.held``) holds them first
    queue_below(t)         the write queue arena tier t's victims retire for, or None
    queued_only(block)     the write queue holding a new block that no arena slot holds, and
                           its mark there: what an acknowledged put waits for (``Writes.put``)

Retired slots: an arena block evicted while its copy below is still in the disk's write queue
keeps its slot (and its journal record) until the disk has written that copy, so a kill -9
never loses it with the queue; the write that wanted the room waits for the disk outside the
lock (``kvstore.store.pacing``).

Eviction demotes a block to the next tier while there is one and drops it from the last; a
block whose only copy cannot move and whose removal would strand a resident child stays.

What runs under the lock here: copies between memory tiers and into a tier's write queue (a
bounded memcpy; a queue that is full is never waited for, except by ``spill`` at close, by
write-through and by an operator's ``demote``, which promise the copy); reads from a slower medium happen only for demotions out
of a tier that is not an arena, which the default tiers never need.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

from kvstore.store.changes import BlockChanges
from kvstore.store.eviction import Eviction
from kvstore.store.held import RoomLine
from kvstore.store.index import BlockIndex
from kvstore.store.model import Block
from kvstore.store.pins import Pins
from tiers import BytesLike, Tier, TierBusy, TierError, TierFull, WriteQueue

log = logging.getLogger("kvstore.store")


class Placement:
    """See the module docstring."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        index: BlockIndex,
        eviction: Eviction,
        pins: Pins,
        counters: Counter[str],
        line: RoomLine,
        before_evicting: Callable[[], None],
    ) -> None:
        """``line``: the paced writes waiting for arena room (``kvstore.store.pacing``)."""
        self.tiers = tiers
        self._queues = [tier.write_queue() for tier in tiers]
        self._index = index
        self._eviction = eviction
        self._pins = pins
        self._counters = counters
        self._before_evicting = before_evicting  # expired leases and reservations go first
        # Each arena tier's first tier below it that queues its writes, and its queue: a slot
        # whose block's copy there is still queued retires instead of being freed (``_let_go``).
        self._queued_below: dict[int, tuple[int, WriteQueue]] = {}
        for t, tier in enumerate(tiers):
            below = [(u, q) for u, q in enumerate(self._queues) if u > t and q is not None]
            if tier.as_arena() is not None and below:
                self._queued_below[t] = below[0]
        # The tiers whose copies salvage brings back after a kill -9 (an arena's journaled slots)
        self._arenas = {t for t, tier in enumerate(tiers) if tier.as_arena() is not None}
        self.retired_bytes = 0  # bytes of arena slots retired so far, all told
        self._line = line
        self.changes: BlockChanges | None = None  # told of every copy added or gone (events)

    def make_room(
        self, t: int, size_bytes: int, room: Callable[[], bool] | None = None, room_bytes: int = 0
    ) -> bool:
        """Evict from tier ``t`` until it can take a block of ``size_bytes``, or until ``room()``
        when given (room for a whole chunk of a write of ``room_bytes``: one pass of eviction,
        not one a block); whether it got there. In an arena, victims whose copy below is still
        queued leave their slots retired (``_let_go``): once they add up to what is wanted the
        pass stops short, the room on its way (``Pacing.pace`` waits for it outside the lock)."""
        tier = self.tiers[t]
        enough = room or (lambda: tier.can_store(size_bytes))
        if enough():  # the usual case: nothing to collect or evict
            return True
        if size_bytes > tier.usage().capacity_bytes:
            return False  # it would not fit an empty tier: evicting everything would not help
        if self.settle(t) and enough():
            return True
        self._before_evicting()
        stuck: list[Block] = []  # could neither move down nor go: back in the heap afterwards
        coming_until = self.retired_bytes + max(size_bytes, room_bytes)
        try:
            with _frees_batched(tier):  # the victims' frees recorded in one write at the end
                while not enough():
                    if self.retired_bytes >= coming_until:
                        return False  # enough retired: the room comes when the disk has written it
                    victim = self._eviction.pop_victim(t)
                    if victim is None:
                        return False
                    if not self._evict(victim, t):
                        stuck.append(victim)
            return True
        finally:
            for block in stuck:
                self._eviction.push(block)

    def settle(self, t: int) -> int:
        """Free the retired slots of arena tier ``t`` whose copies below are written; how many.
        The paced writes waiting in line hold what came free first (``RoomLine.hold``)."""
        below = self._queued_below.get(t)
        if below is None:
            return 0
        arena = self.tiers[t].as_arena()
        assert arena is not None
        freed = arena.settle(below[1].written_mark())
        if freed:
            self._line.hold(t, arena)
        return freed

    def queue_below(self, t: int) -> WriteQueue | None:
        """The write queue whose marks settle arena tier ``t``'s retired slots; None when its
        slots never retire (no arena, or no tier below it queues its writes)."""
        below = self._queued_below.get(t)
        return None if below is None else below[1]

    def queued_only(self, block: Block) -> tuple[int, WriteQueue, int] | None:
        """(tier, its write queue, the block's mark there) when no arena slot holds ``block``
        and a tier's write queue still does: a kill -9 now would lose it, salvage having no
        slot to bring back. None otherwise (the usual case: the block is in the arena)."""
        if not block.tiers.isdisjoint(self._arenas):
            return None
        for t in sorted(block.tiers):
            queue = self._queues[t]
            if queue is not None and (mark := queue.unwritten_mark(block.tkey)):
                return t, queue, mark
        return None

    def _unretire(self, block: Block) -> None:
        """A block leaving the store (dropped, deleted) takes any arena slot it retired with it:
        salvage after a crash must not bring back what was deleted."""
        if self.retired_bytes:
            for t in self._queued_below:
                self.tiers[t].delete(block.tkey)

    def _let_go(self, block: Block, t: int) -> None:
        """Tier ``t``'s copy of ``block`` goes. An arena slot whose block keeps a copy below
        that is still in a write queue is retired, not freed: its bytes and its journal record
        stay until the disk has written that copy (``settle``), so a kill -9 meanwhile finds the
        block in the arena and salvage copies it, where a freed slot would have lost it with
        the queue. A copy written already (the cleaner's, long since) frees the slot at once."""
        below = self._queued_below.get(t)
        if below is not None and below[0] in block.tiers:
            mark = below[1].unwritten_mark(block.tkey)
            if mark:
                arena = self.tiers[t].as_arena()
                assert arena is not None
                if arena.retire(block.tkey, mark):
                    self.retired_bytes += block.size_bytes
                    self._counters["retired_slots"] += 1
                    return
        self.tiers[t].delete(block.tkey)

    def _evict(self, block: Block, t: int) -> bool:
        """Demote ``block`` from tier ``t`` to the next tier with room, or drop it; False when
        it can do neither (no room below, and dropping it would strand a resident child)."""
        if len(block.tiers) == 1 and t + 1 < len(self.tiers):
            data = self.bytes_of(block, t)
            if data is not None:
                self.place(block, data, lowest=t + 1, highest=len(self.tiers) - 1)
                if len(block.tiers) > 1:
                    self._counters["demotions"] += 1
                elif self._index.children(block.ident) and not _degraded(self.tiers[t + 1 :]):
                    return False  # a disk behind takes it soon; a degraded one not: drop it, as the last tier does
        self._counters[f"evicted_{self.tiers[t].name}_blocks"] += 1
        self.forget_tier(block, t)
        return True

    def place(
        self, block: Block, data: BytesLike, lowest: int, highest: int, evict: bool = True, wait: bool = False
    ) -> None:
        """``wait``: wait for room in a tier's write queue (spill at close, write-through);
        otherwise a tier whose medium is behind is passed over (counted), so the store lock is
        never held waiting on a disk: an eviction then drops its victim instead of demoting it."""
        for t in range(lowest, highest + 1):
            if t in block.tiers:
                return
            if not (
                self.make_room(t, block.size_bytes) if evict else self.tiers[t].can_store(block.size_bytes)
            ):
                continue
            tier, queue = self.tiers[t], self._queues[t]
            try:
                if wait or queue is None:
                    tier.put(block.tkey, data, block.scope.fingerprint, block.meta)
                else:
                    queue.put_nowait(block.tkey, data, block.scope.fingerprint, block.meta)
            except TierBusy:
                self._counters[f"{tier.name}_busy_skipped_blocks"] += 1
                continue
            except TierFull:
                self._counters[f"{tier.name}_refused_blocks"] += 1  # room made, then not there
                continue
            except TierError as exc:
                log.warning("tier %s refused a %d B block: %s", self.tiers[t].name, block.size_bytes, exc)
                self._counters[f"{tier.name}_refused_blocks"] += 1
                continue
            self.added(block, t)
            return

    def added(self, block: Block, t: int) -> None:
        """Tier ``t`` now holds a copy of ``block``: an entry in that tier's heap. Its entries in
        the other tiers stay current (no new version), so a copy made below, say by the cleaner,
        does not move the block back in its tier's line of victims."""
        block.tiers.add(t)
        self._eviction.push_in(block, t)
        if self.changes is not None:
            self.changes.stored((block,), t)

    def demote(self, block: Block, t: int) -> bool:
        if not self._eviction.evictable_from(block, t):
            return False  # pinned, or a child stays here
        if len(block.tiers) == 1:
            data = self.bytes_of(block, t)
            if data is None:
                return False
            # An operator's demote promises the move: it waits for a full write queue, under the
            # lock as spill does (``TieredStore.demote`` waits outside it first, block by block).
            self.place(block, data, lowest=t + 1, highest=len(self.tiers) - 1, evict=False, wait=True)
            if len(block.tiers) == 1:
                return False
            self._counters["demotions"] += 1
        self.forget_tier(block, t)
        return True

    def bytes_of(self, block: Block, t: int) -> memoryview | None:
        """From the arena this is the slot itself (the copy into the next tier is then the only
        one); it stays valid while the caller holds the store lock or a pin on the block."""
        arena = self.tiers[t].as_arena()
        if arena is not None:
            slot = arena.locate(block.tkey)
            if slot is not None:
                return arena.slot_view(slot)
        scratch = memoryview(bytearray(block.size_bytes))
        n = self.read(block, t, scratch)
        return None if n is None else scratch[:n]

    def read(self, block: Block, t: int, out: memoryview) -> int | None:
        sizes: list[int | None] = []
        self.read_many([block], [t], [out], sizes)
        return sizes[0]

    def read_many(
        self,
        blocks: Sequence[Block],
        sources: Sequence[int],
        outs: Sequence[memoryview],
        sizes: list[int | None],
    ) -> None:
        """Copy each block from tier ``sources[i]`` into ``outs[i]``, appending its length (None
        where the tier misses or fails) to ``sizes`` as each copy ends: a caller whose copies
        stop on an exception knows from ``len(sizes)`` which ones ran."""
        if not len(blocks) == len(sources) == len(outs):
            raise ValueError(f"{len(blocks)} blocks, {len(sources)} sources and {len(outs)} buffers")
        tiers = self.tiers
        base = len(sizes)  # the caller may hand in a list already holding earlier results
        start, n = 0, len(blocks)
        while start < n:  # each run of blocks from one tier is one call into that tier
            t = sources[start]
            end = start + 1
            while end < n and sources[end] == t:
                end += 1
            try:
                tiers[t].get_into_many([b.tkey for b in blocks[start:end]], outs[start:end], sizes)
            except TierError as exc:  # the block it stopped at fails; the run goes on after it
                log.warning("reading a block from %s failed: %s", tiers[t].name, exc)
                sizes.append(None)
                start = len(sizes) - base
                continue
            start = end

    def failed_read(self, block: Block, t: int) -> None:
        """A read from tier ``t`` failed its checks: that copy is gone."""
        self._counters["checksum_failures"] += 1
        self.forget_tier(block, t)

    def forget_tier(self, block: Block, t: int) -> None:
        if t in block.tiers:
            block.tiers.discard(t)
            self._let_go(block, t)
            if self.changes is not None:
                self.changes.removed((block,), t)
            block.version += 1
            self._eviction.push(block)
        if not block.tiers:
            self._unretire(block)
            self._index.remove(block)
        self._eviction.push_parent(block)

    def drop(self, block: Block) -> None:
        for t in sorted(block.tiers):
            self.tiers[t].delete(block.tkey)
            if self.changes is not None:
                self.changes.removed((block,), t)
        block.tiers.clear()
        self._unretire(block)
        self._index.remove(block)
        self._eviction.push_parent(block)

    def spill(self, target: int, persistent: Sequence[bool]) -> None:
        """Copy every block held only by volatile tiers down to ``target``. Parents go first,
        so that if the persistent tier fills up, what it keeps is prefixes."""
        todo = [
            b for b in self._index.blocks.values() if not b.doomed and not any(persistent[t] for t in b.tiers)
        ]
        spilled = self.copy_down(todo, target, lambda b: self.bytes_of(b, b.fastest))
        for tier in self.tiers:
            tier.flush()
        log.info(
            "spilled %d of %d volatile blocks to %s on close", spilled, len(todo), self.tiers[target].name
        )

    def copy_down(
        self,
        blocks: Sequence[Block],
        target: int,
        data_of: Callable[[Block], BytesLike | None],
        fresh: bool = False,
    ) -> int:
        """Copy each block (its bytes ``data_of(block)``; None: skipped) into tier ``target``,
        waiting for its write queue, room made there by eviction under the usual rules; parents
        first, so that if the tier fills up, what it keeps is prefixes. How many it copied. The
        spill on close, and the salvage of a dead server's arena (``kvstore.store.salvage``),
        whose blocks are ``fresh``: each copied one is touched as a new put is."""
        copied = 0
        for block in sorted(blocks, key=lambda b: (b.depth, -b.priority)):
            data = data_of(block)
            if data is None:
                continue
            self._pins.hold(block)  # keep it from being chosen to make room for itself
            try:
                self.place(block, data, lowest=target, highest=target, wait=True)
            finally:
                self._pins.unhold(block)
            if target in block.tiers:
                copied += 1
                if fresh:
                    self._eviction.touch(block)
        return copied


def _frees_batched(tier: Tier) -> AbstractContextManager[None]:
    """An arena's frees batched (``InPlaceTier.frees_batched``); other tiers record none."""
    arena = tier.as_arena()
    return arena.frees_batched() if arena is not None else nullcontext()


def _degraded(below: Sequence[Tier]) -> bool:
    """Whether the tiers below take no writes for now (nvme on a full or read-only disk): a
    victim is then dropped, children or not, as from the last tier, or a full arena of chains
    would refuse every write until the disk has room again."""
    disks = [tier for tier in below if tier.persistent]
    return bool(disks) and all(tier.usage().degraded for tier in disks)
