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
from tiers.base import Slot
from tiers.dram import UNNAMED_GRACE_S, Arena, DramConfig, DramTier, sweep_unnamed
from tiers.slab_alloc import SLOT_ALIGN_BYTES, SlabAllocator

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


def test_a_batch_of_slots_is_the_slots_alloc_gives_one_by_one_and_stops_when_full() -> None:
    one, many = (SlabAllocator(capacity_bytes=4 * MIB, page_bytes=MIB) for _ in range(2))
    for alloc in (one, many):  # a partly used extent first: its free slot comes before a new one
        first, second = alloc.alloc(256 * 1024), alloc.alloc(256 * 1024)
        assert first is not None and second is not None
        alloc.free(first)
    singles = [one.alloc(256 * 1024) for _ in range(10)]  # across three extents
    assert many.alloc_many(256 * 1024, 10) == singles
    assert many.used_slot_bytes == one.used_slot_bytes == 11 * 256 * 1024
    assert len(many.alloc_many(256 * 1024, 100)) == 5  # 16 slots in all: fewer when full
    assert many.alloc_many(256 * 1024, 1) == [] and many.alloc(100) is None


def test_free_slots_counts_what_alloc_many_would_give() -> None:
    alloc = SlabAllocator(capacity_bytes=4 * MIB, page_bytes=MIB)
    assert alloc.free_slots(256 * 1024, 100) == 16 and alloc.free_slots(256 * 1024, 5) == 5
    taken = alloc.alloc_many(256 * 1024, 5)  # two extents: 3 slots left in the second
    assert alloc.free_slots(256 * 1024, 100) == 3 + 2 * 4
    big = alloc.alloc(2 * MIB)  # pages 2 and 3, the two left
    assert big is not None
    assert alloc.free_slots(256 * 1024, 100) == 3 and alloc.free_slots(2 * MIB, 9) == 0
    for slot in taken[:4]:  # the first extent empties: its page goes back
        alloc.free(slot)
    assert alloc.free_slots(256 * 1024, 100) == 3 + 4
    assert alloc.free_slots(2 * MIB, 9) == 0  # page 0 alone: a 2 MiB slot needs two side by side
    alloc.free(big)
    assert alloc.free_slots(2 * MIB, 9) == 1  # pages 2-3 again
    assert len(alloc.alloc_many(2 * MIB, 9)) == 1
    assert len(alloc.alloc_many(256 * 1024, 100)) == 3 + 4


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


def test_reserve_many_skips_busy_and_oversize_keys_and_stops_where_the_tier_is_full() -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MIB, page_bytes=MIB, prefault=False))
    try:
        tier.reserve(TierKey(b"busy"), MIB, FP)  # another writer's slot
        items = [(TierKey(b"a"), MIB), (TierKey(b"busy"), MIB), (TierKey(b"huge"), 8 * MIB)]
        items += [(TierKey(b"b"), MIB), (TierKey(b"c"), MIB), (TierKey(b"d"), MIB), (TierKey(b"e"), MIB)]
        slots = tier.reserve_many(items, FP)
        assert [s is not None for s in slots] == [True, False, False, True, True]  # full at "d"
        assert len({s.offset for s in slots if s is not None}) == 3  # distinct slots
        assert tier.usage().stored_bytes == 4 * MIB  # the tier is full: 3 reserved here + "busy"
        assert tier.locate(TierKey(b"a")) is None  # reserved, not visible
        tier.abort(TierKey(b"busy"))
        assert [s is not None for s in tier.reserve_many(items[5:], FP)] == [True]  # room for "d" only
        tier.commit_many([(TierKey(k), None) for k in (b"a", b"b", b"c", b"d")])
        assert all(tier.locate(TierKey(k)) is not None for k in (b"a", b"b", b"c", b"d"))
        with pytest.raises(ValueError):
            tier.reserve_many([(TierKey(b"x"), 10)], b"short fingerprint")
    finally:
        tier.close()


def test_reserve_many_of_mixed_sizes_and_a_key_asked_twice() -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MIB, page_bytes=MIB, prefault=False))
    try:
        items = [(TierKey(b"a"), 4096), (TierKey(b"b"), 4096), (TierKey(b"c"), MIB), (TierKey(b"a"), 4096)]
        items += [(TierKey(b"d"), 4096)]
        slots = tier.reserve_many(items, FP)
        assert [s is not None for s in slots] == [True, True, True, False, True]  # "a" once only
        assert [s.size_bytes for s in slots if s is not None] == [4096, 4096, MIB, 4096]
        assert len({s.offset for s in slots if s is not None}) == 4
        tier.commit_many([(TierKey(k), None) for k in (b"a", b"b", b"c", b"d")])
        assert tier.usage().stored_bytes == MIB + 3 * 4096
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


@pytest.fixture(params=["native", "python"])
def gather_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The dram tier's batched copy both ways: through tiers._gather, and the Python loop a
    build without a C compiler runs."""
    import tiers.dram

    if request.param == "python":
        monkeypatch.setattr(tiers.dram, "_gather", None)
    else:
        assert tiers.dram._gather is not None, "tiers._gather is not built: no C compiler?"
    return str(request.param)


def test_dram_get_into_many_copies_every_block_either_way(gather_path: str) -> None:
    tier = DramTier(DramConfig(capacity_bytes=8 * MIB, page_bytes=MIB, prefault=False))
    try:
        blocks = {TierKey(b"k%d" % i): os.urandom(size) for i, size in enumerate([300_000, 4096, 1, 2 * MIB])}
        for k, data in blocks.items():
            tier.put(k, data, FP)
        keys = list(blocks)
        bufs = [bytearray(len(blocks[k]) + 7) for k in keys]  # larger than needed is fine
        sizes: list[int | None] = []
        tier.get_into_many(keys, [memoryview(b) for b in bufs], sizes)
        assert sizes == [len(blocks[k]) for k in keys]
        assert all(bytes(b[: len(blocks[k])]) == blocks[k] for b, k in zip(bufs, keys, strict=True))
        # one block in and out through buffers at odd offsets within a line (put and get_into)
        odd = bytearray(300_003)
        odd[3:] = os.urandom(300_000)
        tier.put(TierKey(b"odd"), memoryview(odd)[3:], FP)
        out = bytearray(300_000 + 72)
        assert tier.get_into(TierKey(b"odd"), memoryview(out)[5:]) == 300_000
        assert out[5 : 5 + 300_000] == odd[3:] and out[:5] == bytes(5) and out[-67:] == bytes(67)
    finally:
        tier.close()


def test_dram_get_into_many_with_a_short_buffer_copies_nothing(gather_path: str) -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MIB, page_bytes=MIB, prefault=False))
    try:
        tier.put(TierKey(b"a"), b"\x11" * 5000, FP)
        tier.put(TierKey(b"b"), b"\x22" * 5000, FP)
        first, short = bytearray(5000), bytearray(4999)
        with pytest.raises(ValueError, match="smaller"):
            tier.get_into_many([TierKey(b"a"), TierKey(b"b")], [memoryview(first), memoryview(short)], [])
        assert first == bytearray(5000) and short == bytearray(4999)  # checked before any copy
    finally:
        tier.close()


def test_native_gather_refuses_a_span_outside_the_region_and_a_read_only_buffer() -> None:
    from tiers import _gather  # type: ignore[attr-defined]

    region = memoryview(bytes(range(256)) * 4)
    out = bytearray(16)
    _gather.gather(region, [1000], [16], [out])
    assert out == region[1000:1016]
    with pytest.raises(ValueError, match="outside"):
        _gather.gather(region, [1020], [16], [bytearray(16)])
    with pytest.raises(ValueError, match="negative"):
        _gather.gather(region, [-1], [16], [bytearray(16)])
    with pytest.raises(BufferError):
        _gather.gather(region, [0], [4], [b"read"])
    with pytest.raises(ValueError, match="length"):
        _gather.gather(region, [0, 4], [4], [bytearray(4)])


def test_a_closed_dram_tier_misses_a_batched_read_without_touching_its_region(gather_path: str) -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MIB, page_bytes=MIB, prefault=False))
    tier.put(TierKey(b"k"), b"x" * 1000, FP)
    tier.close()  # its mapping is gone: reading it would fault or raise
    sizes: list[int | None] = []
    tier.get_into_many([TierKey(b"k"), TierKey(b"j")], [memoryview(bytearray(1000))] * 2, sizes)
    assert sizes == [None, None]


def _rss_bytes_of_mapping(address: int) -> int | None:
    """The Rss of the mapping starting at ``address`` in this process (/proc/self/smaps)."""
    try:
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            inside = int(head.split("-")[0], 16) == address
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    return None


def test_an_attached_arena_fills_its_page_tables_in_the_background_and_closes_cleanly() -> None:
    import tiers.dram

    owner = Arena.create_unnamed(64 * MIB)
    try:
        assert owner.wait_populated(0)  # its creator touched its pages: nothing to wait for
        owner.array[:4096] = 7
        attached = Arena.attach(owner.name)
        address = attached.array.ctypes.data
        if tiers.dram._libc_madvise() is None or _rss_bytes_of_mapping(address) is None:
            attached.close()
            pytest.skip("no libc madvise or no /proc/self/smaps on this platform")
        assert attached._populating is not None
        assert attached.wait_populated(30)
        assert not attached._populating.is_alive()
        rss = _rss_bytes_of_mapping(address)
        if rss == 0:  # a kernel before 5.14 refuses MADV_POPULATE_WRITE: left to page faults
            attached.close()
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
        assert rss == 64 * MIB  # every page mapped before the first copy touches it
        assert bytes(attached.view[:4096]) == b"\x07" * 4096  # and not one byte changed
        attached.close()
        again = Arena.attach(owner.name)
        again.close()  # closing while it populates waits for the step under way, then unmaps
    finally:
        owner.close()


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda(), reason="checks the machine without CUDA")
def test_without_cuda_no_mapping_is_pinned_and_the_arena_still_works() -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False))
    attached = Arena.attach(tier.arena.name)
    try:
        assert not tier.pinned and not attached.pin_with_cuda() and not attached.pinned
        tier.put(TierKey(b"k" * 32), b"x" * 1000, b"f" * 32)
        out = bytearray(1000)
        assert tier.get_into(TierKey(b"k" * 32), memoryview(out)) == 1000 and out == b"x" * 1000
    finally:
        attached.close()
        tier.close()


@pytest.mark.gpu
def test_each_process_mapping_of_the_arena_is_pinned_on_its_own_and_let_go_at_close() -> None:
    """CUDA registers a mapping, not the file: the tier's mapping is pinned, a second mapping of
    the same arena (what an engine attaches) is not until it pins itself; then bytes written
    through either reach the GPU and come back; closing the second leaves the first pinned."""
    import torch

    tier = DramTier(DramConfig(capacity_bytes=64 << 20, page_bytes=16 << 20))
    attached = Arena.attach(tier.arena.name)
    try:
        assert tier.pinned and torch.frombuffer(tier.arena.view, dtype=torch.uint8).is_pinned()
        assert not attached.pinned
        assert not torch.frombuffer(attached.view, dtype=torch.uint8).is_pinned()
        assert attached.pin_with_cuda() and attached.pin_with_cuda()  # once; a second call is a no-op
        host = torch.frombuffer(attached.view, dtype=torch.uint8)
        assert host.is_pinned()
        payload = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
        tier.arena.array[: 8 << 20] = payload.numpy()  # written through the tier's mapping
        device = host[: 8 << 20].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), payload)
        host[8 << 20 : 16 << 20].copy_(device.flip(0), non_blocking=True)  # back through the engine's
        torch.cuda.synchronize()
        assert torch.equal(torch.from_numpy(tier.arena.array[8 << 20 : 16 << 20].copy()), payload.flip(0))
    finally:
        attached.close()
    assert not attached.pinned
    assert tier.pinned and torch.frombuffer(tier.arena.view, dtype=torch.uint8).is_pinned()
    tier.close()


def test_a_mapping_the_driver_refuses_to_pin_is_asked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """cudaHostRegister refusing (a driver's limit, say) leaves the copies staged and is not
    asked again at every restore: a refusal costs a failed call and a warning each time."""
    from tiers import cuda

    asked: list[int] = []
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "pin_host_memory", lambda address, size: asked.append(size) is not None)
    tier = DramTier(
        DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False, pin_with_cuda="off")
    )
    attached = Arena.attach(tier.arena.name)
    try:
        assert not attached.pin_with_cuda() and not attached.pin_with_cuda()
        assert asked == [attached.size_bytes] and not attached.pinned
    finally:
        attached.close()
        tier.close()
