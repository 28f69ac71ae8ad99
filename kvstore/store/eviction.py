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

Calls (store lock held): touch(block) on a hit or a fresh put; push(block) after its tiers or
pins changed; push_parent(block) when a child left; pop_victim(t).
"""

from __future__ import annotations

import heapq

from kvstore.store.index import BlockIndex
from kvstore.store.model import Block, BlockId


class Eviction:
    """See the module docstring. Not thread-safe: the store calls it under its lock."""

    def __init__(self, index: BlockIndex, tiers: int) -> None:
        self._index = index
        self._heaps: list[list[tuple[float, int, int, BlockId]]] = [[] for _ in range(tiers)]
        self._aging = [0.0] * tiers
        self._seq = 0

    def touch(self, block: Block) -> None:
        """A hit or a fresh put: raise the block's priority in every tier holding it."""
        block.hits += 1
        aging = max((self._aging[t] for t in block.tiers), default=0.0)
        block.priority = aging + block.hits * block.cost / max(block.size_bytes, 1)
        block.version += 1
        self.push(block)

    def push(self, block: Block) -> None:
        for t in block.tiers:
            self._seq += 1
            heap = self._heaps[t]
            heapq.heappush(heap, (block.priority, self._seq, block.version, block.ident))
            if len(heap) > 4 * len(self._index) + 1024:
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
        if block.pins or t not in block.tiers:
            return False
        for child_key in self._index.children(block.ident):
            child = self._index.get((block.scope, child_key))
            if child is not None and child.tiers and child.fastest <= t:
                return False
        return True

    def pop_victim(self, t: int) -> Block | None:
        """The eligible block of tier ``t`` with the lowest priority, off its heap; None when
        every block there is pinned or holds a child in place."""
        heap = self._heaps[t]
        while heap:
            priority, _, version, ident = heapq.heappop(heap)
            block = self._index.get(ident)
            if block is None or block.version != version:
                continue  # stale entry: the block changed since and has a newer one
            if not self.evictable_from(block, t):
                # Pushed again when it becomes eligible: on its last release if pinned, when
                # its last child here leaves otherwise.
                block.parked = block.parked or block.pins > 0
                continue
            self._aging[t] = max(self._aging[t], priority)
            return block
        return None
