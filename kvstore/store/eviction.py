"""Which block leaves a tier when room is needed: prefix-aware GreedyDual-Size-Frequency.

A block is never evicted from a tier while a child of it sits in that tier or a faster one,
because a child without its parent is unreachable. Among the eligible blocks the victim is the
one with the lowest priority, aging + hits x recompute cost / bytes, where the recompute cost
grows with the block's depth in its chain (attention over a longer prefix) and aging is the
priority of the tier's last victim (so old hits fade). Pinned blocks are never candidates: a
pinned block popped from a heap is ``parked`` and pushed again on its last release.

One heap per tier of (priority, seq, version, id). Entries go stale whenever a block changes
(its ``version`` moves on); stale entries are skipped when popped and dropped when a heap grows
past four times the index.

Invariants (what keeps a block from being stranded, out of eviction's sight for good):
    1. Each tier holding a block has an entry of the block's current version in its heap:
       whoever adds a tier or bumps ``version`` pushes in the same lock hold. The exceptions
       are due a push: a block popped while pinned (``parked``, pushed on its last release)
       or while a child held it in place (pushed by ``push_parent`` when that child leaves).
    2. Such an entry's priority is at most the block's: ``hit_many`` raises a priority without
       pushing, and pushes (bumping ``version``) only where the priority fell; ``pop_victim``
       puts an entry found below its block's priority back at the block's priority. So the
       victim is still the eligible block of lowest priority, and a hit costs no heap entry.

Calls (store lock held): touch(block) on a fresh put or a single hit (pushes at once;
touch_many(blocks) for the fresh blocks of one commit);
hit_many(blocks) for the hits of one restore, blocks already in the heaps; push(block) after
its tiers or pins changed (push_in(block, t) when tier t was added: its other entries stay
current); push_parent(block) when a child left; pop_victim(t); coldest(t, n, nbytes) to look
ahead at the next victims without taking them (the cleaner's);
stranded() for tests: the (block, tier) pairs breaking invariant 1 or 2 (none, ever).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from kvstore.store.index import BlockIndex
from kvstore.store.model import MARK_FINGERPRINT, Block, BlockId


class Eviction:
    """See the module docstring. Not thread-safe: the store calls it under its lock."""

    def __init__(self, index: BlockIndex, tiers: int) -> None:
        self._index = index
        self._heaps: list[list[tuple[float, int, int, BlockId]]] = [[] for _ in range(tiers)]
        self._aging = [0.0] * tiers
        self._seq = 0

    def touch(self, block: Block) -> None:
        """A hit or a fresh put: raise the block's priority in every tier holding it."""
        self.touch_many((block,))

    def touch_many(self, blocks: Sequence[Block]) -> None:
        """``touch`` of each (the fresh blocks of one commit)."""
        for block in blocks:
            block.hits += 1
            block.priority = self._priority(block)
            block.version += 1
            self.push(block)

    def _priority(self, block: Block) -> float:
        """GDSF: the highest aging among the block's tiers (0.0 without one; agings never go
        below it) plus hits x cost / bytes. Plain loops: this runs once per block of a restore."""
        aging = 0.0
        for t in block.tiers:
            if self._aging[t] > aging:
                aging = self._aging[t]
        return aging + block.hits * block.cost / (block.size_bytes or 1)

    def hit_many(self, blocks: Sequence[Block]) -> None:
        """A restore read these blocks (each already in the heaps, see invariant 1): raise
        their priorities; only a priority that fell (its tiers' aging is lower now) is pushed."""
        for block in blocks:
            block.hits += 1
            before = block.priority
            block.priority = self._priority(block)
            if block.priority < before:
                block.version += 1
                self.push(block)

    def push(self, block: Block) -> None:
        for t in block.tiers:
            self.push_in(block, t)

    def push_in(self, block: Block, t: int) -> None:
        """An entry of the block's current version in tier ``t``'s heap."""
        self._seq += 1
        heap = self._heaps[t]
        heapq.heappush(heap, (block.priority, self._seq, block.version, block.ident))
        if len(heap) > 4 * len(self._index.blocks) + 1024:
            self._compact(t)

    def push_parent(self, block: Block) -> None:
        """A child of its parent left a tier: the parent may have become eligible there."""
        parent = self._index.parent_of(block)
        if parent is not None:
            self.push(parent)

    def _compact(self, t: int) -> None:
        """Drop stale entries (every hit pushes a fresh one) so heaps stay O(blocks)."""
        heap = []
        for ident, block in self._index.blocks.items():
            if t in block.tiers:
                self._seq += 1
                heap.append((block.priority, self._seq, block.version, ident))
        heapq.heapify(heap)
        self._heaps[t] = heap

    def evictable_from(self, block: Block, t: int) -> bool:
        if block.scope.fingerprint == MARK_FINGERPRINT and t == len(self._heaps) - 1:
            return False  # the fleet's invalidation marks never leave a shared node's store
        return not block.pins and t in block.tiers and not self._child_holds(block, t)

    def _child_holds(self, block: Block, t: int) -> bool:
        """A child of ``block`` sits in tier ``t`` or a faster one: the parent must stay."""
        for child_key in self._index.children(block.ident):
            child = self._index.get((block.scope, child_key))
            if child is not None and child.tiers and child.fastest <= t:
                return True
        return False

    def pop_victim(self, t: int) -> Block | None:
        """The eligible block of tier ``t`` with the lowest priority, off its heap; None when
        every block there is pinned or holds a child in place."""
        heap = self._heaps[t]
        while heap:
            priority, _, version, ident = heapq.heappop(heap)
            block = self._index.get(ident)
            if block is None or block.version != version:
                continue  # stale entry: the block changed since and has a newer one
            if priority < block.priority:
                # Hit since this entry was pushed (invariant 2): back in at its present priority.
                self._seq += 1
                heapq.heappush(heap, (block.priority, self._seq, version, ident))
                continue
            if not self.evictable_from(block, t):
                # Pushed again when it becomes eligible: on its last release if pinned, when
                # its last child here leaves otherwise.
                block.parked = block.parked or block.pins > 0
                continue
            self._aging[t] = max(self._aging[t], priority)
            return block
        return None

    def coldest(self, t: int, max_blocks: int, max_bytes: int) -> list[Block]:
        """The blocks of tier ``t`` to leave it next, about in the order they will, until they
        hold ``max_bytes`` (at most ``max_blocks``). Eviction takes a leaf at a time, so a block
        leaves only after what hangs below it in the tier: walking the heap's order, each block
        comes after its descendants there (a chain tail first, as eviction takes it). The heap is
        left as it was but for stale entries (which ``pop_victim`` drops too). Pinned blocks
        count: their pins end."""
        heap = self._heaps[t]
        seen: set[BlockId] = set()
        popped: list[tuple[float, int, int, BlockId]] = []
        out: list[Block] = []
        nbytes = 0
        try:
            while heap and len(out) < max_blocks and nbytes < max_bytes:
                entry = heapq.heappop(heap)
                block = self._index.get(entry[3])
                if block is None or block.version != entry[2] or t not in block.tiers:
                    continue  # stale: a newer entry stands for the block
                popped.append(entry)
                for next_out in self._leaving_with(block, t, max_blocks - len(out), seen):
                    seen.add(next_out.ident)
                    if not next_out.doomed:
                        out.append(next_out)
                        nbytes += next_out.size_bytes
        finally:
            for entry in popped:
                heapq.heappush(heap, entry)
        return out

    def _leaving_with(self, block: Block, t: int, limit: int, gone: set[BlockId]) -> list[Block]:
        """In the order eviction would take them out of tier ``t`` (at most ``limit``, none in
        ``gone``): what hangs below ``block`` there, then ``block``, then each ancestor left a
        leaf there by it. The ancestors matter: a block popped while its child held it has no
        entry until that child leaves (invariant 1's exception), so no heap walk finds it."""
        order: list[Block] = []
        stack = [block]
        while stack:
            b = stack.pop()
            if b.ident in gone:
                continue  # taken with an earlier block, and all below it with it
            order.append(b)
            for key in self._index.children(b.ident):
                child = self._index.get((b.scope, key))
                if child is not None and t in child.tiers:
                    stack.append(child)
        order.reverse()  # each block after everything below it
        leaving = {b.ident for b in order} | gone
        up = self._index.parent_of(block)
        while up is not None and t in up.tiers and up.ident not in leaving:
            if any((up.scope, key) not in leaving for key in self._index.children(up.ident)):
                break  # another child stays: so does the parent
            order.append(up)
            leaving.add(up.ident)
            up = self._index.parent_of(up)
        return order[:limit]

    def stranded(self) -> list[tuple[Block, int]]:
        """Every (block, tier) whose heap lacks an entry of the block's current version at or
        below its priority (invariants 1 and 2) with nothing due to push one: such a block
        could never be evicted from there. Always empty; O(heap size), for tests."""
        lowest: dict[tuple[BlockId, int, int], float] = {}
        for t, heap in enumerate(self._heaps):
            for priority, _, version, ident in heap:
                entry = (ident, version, t)
                lowest[entry] = min(priority, lowest.get(entry, priority))
        return [
            (block, t)
            for block in self._index.blocks.values()
            for t in sorted(block.tiers)
            if lowest.get((block.ident, block.version, t), math.inf) > block.priority
            and not (block.parked and block.pins)  # pushed again on its last release
            and not self._child_holds(block, t)  # pushed again when that child leaves
        ]
