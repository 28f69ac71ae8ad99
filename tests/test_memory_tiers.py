"""The slab allocator and what the memory tiers add to the contract: two-phase writes and a
shared-memory arena another process can map by name."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from tiers import TierKey
from tiers.dram import Arena, DramConfig, DramTier
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
