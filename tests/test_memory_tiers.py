"""The slab allocator and what the memory tiers add to the contract: two-phase writes and a
shared-memory arena another process can map by name."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import time
from multiprocessing.queues import Queue

import pytest

from tiers import TierKey
from tiers.dram import UNNAMED_GRACE_S, Arena, DramConfig, DramTier, sweep_unnamed
from tiers.slab import SLOT_ALIGN_BYTES, SlabAllocator, Slot

FP = b"\x01" * 32
MIB = 1 << 20


def test_slots_of_one_size_share_an_extent_and_free_pages_return() -> None:
    alloc = SlabAllocator(capacity_bytes=4 * MIB, page_bytes=MIB)
    slots = [alloc.alloc(256 * 1024) for _ in range(4)]  # 4 slots fill page 0
    assert all(s is not None for s in slots)
    assert {s.offset // MIB for s in slots if s} == {0}
    big = alloc.alloc(2 * MIB)  # needs two contiguous pages: 1 and 2
    assert big is not None and big.offset == MIB
    assert alloc.alloc(2 * MIB) is None  # only page 3 is left
    for s in slots:
        assert s is not None
        alloc.free(s)
    # page 0 went back to the pool, but pages 0 and 3 are not contiguous
    assert not alloc.can_alloc(2 * MIB)
    assert alloc.can_alloc(MIB)
    assert big is not None
    alloc.free(big)
    again = alloc.alloc(2 * MIB)
    assert again is not None and again.offset == 0


def test_sizes_round_up_to_aligned_slots() -> None:
    alloc = SlabAllocator(capacity_bytes=2 * MIB, page_bytes=MIB)  # each size class claims a page
    a = alloc.alloc(1)
    b = alloc.alloc(SLOT_ALIGN_BYTES + 1)
    assert a is not None and b is not None
    assert alloc.used_slot_bytes == SLOT_ALIGN_BYTES + 2 * SLOT_ALIGN_BYTES


def test_double_free_raises() -> None:
    alloc = SlabAllocator(capacity_bytes=MIB, page_bytes=MIB)
    slot = alloc.alloc(100)
    assert slot is not None
    alloc.free(slot)
    with pytest.raises(ValueError):
        alloc.free(slot)
    with pytest.raises(ValueError):
        alloc.free(Slot(0, 100))


def test_reserve_is_invisible_until_commit_and_abort_frees() -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MIB, page_bytes=MIB, prefault=False))
    try:
        slot = tier.reserve(TierKey(b"k"), 1000, FP)
        assert tier.locate(TierKey(b"k")) is None
        tier.slot_view(slot)[:] = b"a" * 1000
        tier.commit(TierKey(b"k"))
        assert tier.locate(TierKey(b"k")) == slot
        assert tier.locate_many([TierKey(b"k"), TierKey(b"other")]) == [slot, None]
        out = bytearray(1000)
        assert tier.get_into(TierKey(b"k"), memoryview(out)) == 1000 and out == b"a" * 1000
        tier.reserve(TierKey(b"j"), 1000, FP)
        assert tier.abort(TierKey(b"j")) is True
        assert tier.abort(TierKey(b"j")) is False
        with pytest.raises(KeyError):
            tier.commit(TierKey(b"j"))
        assert tier.usage().stored_bytes == SLOT_ALIGN_BYTES
    finally:
        tier.close()


def _write_through_attached_arena(name: str, offset: int, data: bytes) -> None:
    arena = Arena.attach(name)
    arena.view[offset : offset + len(data)] = data
    arena.close()


def test_another_process_writes_a_slot_in_place() -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MIB, page_bytes=MIB))
    try:
        data = os.urandom(MIB)
        slot = tier.reserve(TierKey(b"k"), len(data), FP)
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=_write_through_attached_arena, args=(tier.arena.name, slot.offset, data))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        tier.commit(TierKey(b"k"))
        out = bytearray(MIB)
        assert tier.get_into(TierKey(b"k"), memoryview(out)) == MIB
        assert out == data
        assert os.stat(Arena.path_of(tier.arena.name)).st_mode & 0o777 == 0o600
    finally:
        tier.close()
    assert not os.path.exists(Arena.path_of(tier.arena.name))


def test_commit_many_publishes_all_or_none() -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MIB, page_bytes=MIB))
    try:
        keys = [TierKey(b"a"), TierKey(b"b")]
        for key in keys:
            tier.reserve(key, MIB, FP)
        with pytest.raises(KeyError):
            tier.commit_many([(keys[0], None), (TierKey(b"never reserved"), None)])
        assert tier.locate(keys[0]) is None  # nothing published by the failed batch
        tier.commit_many([(keys[0], b"meta-a"), (keys[1], None)])
        assert [tier.locate(k) is not None for k in keys] == [True, True]
        assert {b.key: b.meta for b in tier.scan()} == {b"a": b"meta-a", b"b": b""}
        assert tier.usage().used_bytes == 2 * MIB
    finally:
        tier.close()


def _own_unnamed_arena_then_die(ready: multiprocessing.synchronize.Event, name: Queue[str]) -> None:
    arena = Arena.create_unnamed(1 << 20)
    name.put(arena.name)
    ready.wait()
    os._exit(0)  # killed in effect: no close(), the file stays in /dev/shm


def test_a_dead_processs_unnamed_arena_is_swept_and_a_live_ones_kept() -> None:
    """A tier without a data folder leaves nothing behind once its process has died, whatever
    killed it: the next arena created on the host removes it. A live owner's arena, and a dead
    one's still inside the grace period, stay."""
    ctx = multiprocessing.get_context("fork")
    ready, names = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_own_unnamed_arena_then_die, args=(ready, names))
    child.start()
    dead_name = names.get(timeout=30)
    live = Arena.create_unnamed(1 << 20)  # this process's, alive throughout
    try:
        later = time.time() + 2 * UNNAMED_GRACE_S
        assert dead_name not in sweep_unnamed(later)  # its owner still holds the lock
        ready.set()
        child.join(timeout=30)
        assert os.path.exists(Arena.path_of(dead_name))
        assert dead_name not in sweep_unnamed()  # died just now: inside the grace period
        assert dead_name in sweep_unnamed(later)  # other dead processes' arenas may go too
        assert not os.path.exists(Arena.path_of(dead_name))
        assert os.path.exists(Arena.path_of(live.name))  # locked by its live owner: kept
        assert live.name not in sweep_unnamed(later)
    finally:
        live.close()
    assert not os.path.exists(Arena.path_of(live.name))
