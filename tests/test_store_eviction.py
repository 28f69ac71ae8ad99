"""Eviction's heaps under restores: a hit raises a block's priority without a new heap entry, and
no block ever falls out of eviction's sight (kvstore/store/eviction.py, invariants 1 and 2).

Blocks here are one-block chains in tier 0 of a two-tier index unless a test moves them.
"""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, Fingerprint
from kvstore.store import Scope, StoreConfig, TieredStore
from kvstore.store.eviction import Eviction
from kvstore.store.index import BlockIndex
from kvstore.store.model import Block, new_block
from tiers.dram import DramConfig, DramTier

FP = Fingerprint(b"\x05" * 32)
A = Scope("tenant-a", FP)
SIZE = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


def setup() -> tuple[BlockIndex, Eviction]:
    index = BlockIndex(lambda: 0.0, lambda namespace: None)
    return index, Eviction(index, tiers=2)


def stored(index: BlockIndex, eviction: Eviction, i: int, tier: int = 0) -> Block:
    """A fresh put: the block joins a tier and the index, and is touched (one heap entry)."""
    block = new_block(StoreConfig(), A, key(i), SIZE, None, 0)
    block.tiers.add(tier)
    index.admit(block)
    eviction.touch(block)
    return block


def victims(eviction: Eviction, t: int) -> list[Block]:
    out = []
    while (block := eviction.pop_victim(t)) is not None:
        block.tiers.discard(t)  # what placement does with a victim: it leaves the tier
        out.append(block)
    return out


def test_a_restore_hit_outranks_an_older_entry_without_a_new_one() -> None:
    index, eviction = setup()
    x, y = stored(index, eviction, 1), stored(index, eviction, 2)  # x's entry is popped first
    eviction.hit_many([x, x])  # x now outranks y, but its heap entry still says otherwise
    assert eviction.stranded() == []
    # pop: x's entry is below x's priority -> pushed back at it; then y is the victim
    assert victims(eviction, 0) == [y, x]


def test_every_block_a_restore_hit_can_still_be_evicted_in_priority_order() -> None:
    index, eviction = setup()
    blocks = [stored(index, eviction, i) for i in range(40)]
    for round_ in range(5):  # restores of overlapping prefixes, some blocks listed twice
        eviction.hit_many(blocks[: 8 * (round_ + 1)] + blocks[:3])
    assert eviction.stranded() == []
    order = victims(eviction, 0)
    assert sorted(order, key=id) == sorted(blocks, key=id)  # each one, once
    priorities = [b.priority for b in order]
    assert priorities == sorted(priorities)


def test_a_priority_that_fell_is_pushed_at_once() -> None:
    index, eviction = setup()
    hot = stored(index, eviction, 1, tier=1)
    eviction.hit_many([hot] * 50)
    assert victims(eviction, 1) == [hot]  # tier 1's aging is now hot's high priority
    moved = stored(index, eviction, 2, tier=1)  # its priority starts above that aging
    # it moves to tier 0 (what a promotion plus a demotion leave), where aging is still 0
    moved.tiers = {0}
    moved.version += 1
    eviction.push(moved)
    middle = stored(index, eviction, 3)
    eviction.hit_many([middle] * 3)
    eviction.hit_many([moved])  # recomputed from tier 0's aging: far lower than its entry
    assert moved.priority < middle.priority
    assert eviction.stranded() == []
    assert victims(eviction, 0) == [moved, middle]


def test_a_restore_misses_deleted_and_expired_blocks_and_serves_the_rest() -> None:
    wall = FakeClock()
    tier = DramTier(DramConfig(capacity_bytes=16 * SIZE, page_bytes=SIZE, prefault=False))
    config = StoreConfig(retention_s={"short": 10.0})
    store = TieredStore([tier], config, clock=FakeClock(), wall_clock=wall)
    short = Scope("short", FP)
    try:
        store.put(A, [key(1), key(2), key(3)], [bytes([i]) * SIZE for i in (1, 2, 3)])
        store.put(short, [key(4)], [b"\x04" * SIZE])
        store.delete(A, [key(2)])
        wall.now += 11  # past the short namespace's retention
        outs = [memoryview(bytearray(SIZE)) for _ in range(4)]
        assert store.get_into_many(A, [key(1), key(2), key(3), key(9)], outs) == [SIZE, None, SIZE, None]
        assert bytes(outs[0]) == b"\x01" * SIZE and bytes(outs[2]) == b"\x03" * SIZE
        assert store.get_into_many(short, [key(4)], outs[:1]) == [None]
        counters = store.stats().counters
        assert (counters["get_hit_blocks"], counters["get_miss_blocks"]) == (2, 3)
        with pytest.raises(InvalidArgument, match="smaller than"):
            store.get_into_many(A, [key(1)], [memoryview(bytearray(SIZE - 1))])
        assert store.stats().leases == 0 and all(b.pins == 0 for b in store._index.blocks.values())
    finally:
        store.close()


def test_the_index_finds_by_scope_exactly_the_blocks_it_holds() -> None:
    """visible_many probes the index by scope, then key: after admits, a replacement, removals
    and another scope's blocks under the same keys, it answers as the index's entries do."""
    index, eviction = setup()
    other = Scope("tenant-b", FP)
    blocks = [stored(index, eviction, i) for i in range(6)]
    theirs = new_block(StoreConfig(), other, key(2), SIZE, None, 0)
    index.admit(theirs)
    assert index.visible_many(A, [key(i) for i in range(6)]) == blocks
    assert index.visible_many(other, [key(1), key(2)]) == [None, theirs]
    replaced = new_block(StoreConfig(), A, key(3), SIZE, None, 0)
    index.admit(replaced)
    index.remove(blocks[3])  # no longer the entry: nothing removed
    index.remove(blocks[4])
    assert index.visible_many(A, [key(i) for i in range(6)]) == [*blocks[:3], replaced, None, blocks[5]]
    assert index.prefix(A, [key(i) for i in range(6)]) == [*blocks[:3], replaced]
    for block in [*blocks[:3], replaced, blocks[5], theirs]:
        index.remove(block)
    assert index.visible_many(A, [key(0)]) == [None] and index.visible_many(other, [key(2)]) == [None]
    assert not index.blocks and not index._by_scope  # nothing left behind for a scope
