"""Clean ahead of eviction (``store.clean_ahead``): a full arena's next victims get a copy on nvme
on a thread, so a write into the full arena evicts them without copying or waiting for the disk;
the cleaner never waits under the store lock and leaves half of the disk's queue to writers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.keys import BlockKey
from kvstore.store import StoreConfig, TieredStore
from kvstore.store.cleaner import Cleaner
from tests.test_store_arena import BLOCK, A, chain, data, hold_writer
from tiers import TierKey
from tiers.dram import DramConfig, DramTier
from tiers.nvme import NvmeConfig, NvmeTier


def _store(tmp_path: Path, clean_ahead: float = 0.5, queue_blocks: int = 64) -> TieredStore:
    """An 8-block arena over nvme."""
    dram = DramTier(DramConfig(capacity_bytes=8 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(
        NvmeConfig(path=tmp_path / "nvme", capacity_bytes=64 * BLOCK, max_pending_bytes=queue_blocks * BLOCK)
    )
    return TieredStore([dram, nvme], StoreConfig(clean_ahead=clean_ahead))


def _until(what: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _tiers(s: TieredStore, key: BlockKey) -> set[str]:
    block = s._index.get((s._index.intern(A), key))
    assert block is not None
    return {s.tiers[t].name for t in block.tiers}


def _full_over_a_held_disk(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch, queue_blocks: int
) -> tuple[TieredStore, threading.Event]:
    """The arena full of eight singles over a disk that takes nothing until the event is set,
    once the cleaner has queued its first copy."""
    s = _store(tmp_path, queue_blocks=queue_blocks)
    nvme = s.tiers[1]
    assert isinstance(nvme, NvmeTier)
    gate = hold_writer(nvme, monkeypatch)
    for key in singles[:8]:
        s.put(A, [key], [data(key)])
    _until(lambda: s.stats().counters.get("cleaned_blocks", 0) >= 1)
    return s, gate


@pytest.fixture
def singles() -> list[BlockKey]:
    """Twelve one-block chains: eviction order is the order they were stored."""
    return [chain(1, salt=f"single-{i}")[0] for i in range(12)]


def test_a_full_arenas_next_victims_are_copied_to_disk_and_evicted_without_a_copy(
    tmp_path: Path, singles: list[BlockKey]
) -> None:
    s = _store(tmp_path)
    try:
        for key in singles[:8]:
            assert s.put(A, [key], [data(key)]) == 1  # the arena is full
        _until(lambda: s.stats().counters.get("cleaned_blocks", 0) >= 4)
        time.sleep(0.2)  # nothing past the coldest half is cleaned
        assert s.stats().counters["cleaned_blocks"] == 4
        assert [_tiers(s, k) for k in singles[:4]] == [{"dram", "nvme"}] * 4  # the coldest four
        assert [_tiers(s, k) for k in singles[4:8]] == [{"dram"}] * 4
        assert s.lookup(A, singles[:4]).tiers == ("dram",) * 4  # still served from the arena

        for key in singles[8:]:
            assert s.put(A, [key], [data(key)]) == 1  # four victims, all clean
        counters = s.stats().counters
        assert counters["evicted_dram_blocks"] == 4
        assert counters.get("demotions", 0) == 0  # nothing copied on the write's path
        assert [s.tier_of(A, k) for k in singles[:4]] == ["nvme"] * 4
        assert s.get(A, singles) == [data(k) for k in singles]
        assert s._reads._eviction.stranded() == []
    finally:
        s.close()


def test_chains_are_cleaned_in_the_order_eviction_takes_them(tmp_path: Path) -> None:
    """Eviction takes a chain tail first; the heads of the chains still in the arena lose their
    heap entries while their tails hold them (popped, not evictable), yet the cleaner finds them:
    every victim of three more writes was clean."""
    s = _store(tmp_path)
    try:
        chains = [chain(2, salt=f"chain-{i}") for i in range(7)]
        cleaned = 4
        for keys in chains[:4]:
            s.put(A, keys, [data(k) for k in keys])  # the arena is full
        for keys in chains[4:]:
            _until(lambda n=cleaned: s.stats().counters.get("cleaned_blocks", 0) >= n)
            s.put(A, keys, [data(k) for k in keys])
            cleaned += 2
        counters = s.stats().counters
        assert counters["evicted_dram_blocks"] == 6 and counters.get("demotions", 0) == 0
        assert [s.tier_of(A, k) for keys in chains[:3] for k in keys] == ["nvme"] * 6
        assert s._reads._eviction.stranded() == []
    finally:
        s.close()


def test_the_cleaner_leaves_half_the_disk_queue_and_never_holds_the_lock_waiting(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk takes nothing (its writer is held): the cleaner queues two blocks of a 4-block
    queue and then waits, outside the lock; callers go on; a write's dirty victim still finds
    room in the queue and is demoted, not dropped."""
    s, gate = _full_over_a_held_disk(tmp_path, singles, monkeypatch, queue_blocks=4)
    try:
        time.sleep(0.5)  # what it would queue more, it would have by now
        # Queued: the first clean copy (its batch taken by the held writer) and one more.
        assert s.stats().counters["cleaned_blocks"] == 2
        started = time.monotonic()
        assert s.lookup(A, singles[:8]).hit_blocks == 8  # the lock is free while it waits
        assert time.monotonic() - started < 0.25
        for key in singles[8:10]:
            assert s.put(A, [key], [data(key)]) == 1  # two clean victims: nothing queued
        assert s.put(A, [singles[10]], [data(singles[10])]) == 1  # a dirty victim: demoted
        counters = s.stats().counters
        assert counters["demotions"] == 1 and counters.get("nvme_busy_skipped_blocks", 0) == 0
        gate.set()
        s.flush()
        assert all(s.tier_of(A, k) is not None for k in singles[:11])  # nothing was dropped
    finally:
        gate.set()
        s.close()


def test_clean_ahead_zero_copies_nothing_ahead(tmp_path: Path, singles: list[BlockKey]) -> None:
    s = _store(tmp_path, clean_ahead=0)
    try:
        assert s._cleaner is None
        for key in singles:
            s.put(A, [key], [data(key)])
        counters = s.stats().counters
        assert counters["demotions"] == 4 and "cleaned_blocks" not in counters
    finally:
        s.close()


@pytest.mark.parametrize("fraction", [1.5, -0.1])
def test_a_clean_ahead_outside_zero_to_one_is_refused_before_a_store_is_built(fraction: float) -> None:
    from kvstore.errors import InvalidArgument
    from kvstore.server.config import load_settings

    with pytest.raises(ValueError, match="clean_ahead"):
        StoreConfig(clean_ahead=fraction)  # no tier made yet: nothing left behind in /dev/shm
    with pytest.raises(InvalidArgument, match="clean_ahead"):
        load_settings(env={}, overrides={"store.clean_ahead": str(fraction)})


def test_a_cleaner_closes_promptly_while_the_disk_is_behind(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch
) -> None:
    s, gate = _full_over_a_held_disk(tmp_path, singles, monkeypatch, queue_blocks=2)
    try:
        cleaner = s._cleaner
        assert isinstance(cleaner, Cleaner)
        started = time.monotonic()
        cleaner.close()  # waiting on the disk's queue: it ends within that wait
        assert time.monotonic() - started < 3.0 and not cleaner._thread.is_alive()
    finally:
        gate.set()
        s.close()


def _cleaner_inside_a_slow_copy(
    s: TieredStore, monkeypatch: pytest.MonkeyPatch, seconds: float
) -> threading.Event:
    """Each put into the store's nvme takes ``seconds``; the event is set once one has begun."""
    nvme = s.tiers[1]
    put = nvme.put
    copying = threading.Event()

    def slow_put(*args: Any, **kwargs: Any) -> None:
        copying.set()
        time.sleep(seconds)
        put(*args, **kwargs)

    monkeypatch.setattr(nvme, "put", slow_put)
    return copying


def test_a_demote_while_the_cleaner_copies_moves_every_block(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvstore demote dram` skips held blocks; the cleaner holds none while it copies, so a
    demote that starts meanwhile moves every block."""
    s = _store(tmp_path)
    copying = _cleaner_inside_a_slow_copy(s, monkeypatch, 0.3)
    try:
        for key in singles[:8]:
            s.put(A, [key], [data(key)])
        assert copying.wait(10)
        assert s.demote("dram") == 8
        assert [s.tier_of(A, k) for k in singles[:8]] == ["nvme"] * 8
    finally:
        s.close()


def test_a_restore_needing_the_whole_arena_while_the_cleaner_copies_gets_every_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain leaves the arena tail first, so a block the cleaner held while copying would keep
    its whole chain in: a restore (resolve) of eight blocks from nvme into the full 8-block arena
    would pin none of them. The cleaner holds nothing: every block comes up, read back exact."""
    s = _store(tmp_path)
    below, resident = chain(8, salt="below"), chain(8, salt="resident")
    try:
        s.put(A, below, [data(k) for k in below])
        assert s.demote("dram") == 8
        copying = _cleaner_inside_a_slow_copy(s, monkeypatch, 1.0)
        s.put(A, resident, [data(k) for k in resident])  # the arena full of dirty blocks
        assert copying.wait(10)  # the cleaner is inside a copy of the resident chain's tail
        resolved = s.resolve(A, below)
        assert resolved.tiers == ("nvme",) * 8 and resolved.lease is not None
        arena = s.arena
        assert arena is not None
        for key, slot in zip(below, resolved.slots, strict=True):
            assert arena.arena.view[slot.offset : slot.offset + slot.size_bytes] == data(key)
        s.release(resolved.lease.lease_id)
        assert s.get(A, resident) == [data(k) for k in resident]  # demoted as they went
    finally:
        s.close()


def _cleaner_copy_held_at_the_disk(
    s: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[bytes], threading.Event, threading.Event]:
    """The cleaner's puts into nvme wait for ``go`` (one at a time); ``entered`` is set when one
    waits, with its tier key appended to the list."""
    nvme = s.tiers[1]
    put = nvme.put
    keys: list[bytes] = []
    entered, go = threading.Event(), threading.Event()

    def held_put(key: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "kvstore-cleaner":
            keys.append(bytes(key))
            entered.set()
            assert go.wait(10)
        put(key, *args, **kwargs)

    monkeypatch.setattr(nvme, "put", held_put)
    return keys, entered, go


@pytest.mark.parametrize("stored_again", [False, True])
def test_a_block_deleted_while_the_cleaner_copies_it_leaves_no_copy_behind(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch, stored_again: bool
) -> None:
    """Nothing is held while the disk takes a copy, so the block may go meanwhile: its copy goes
    after it. Stored again under the same key meanwhile (and demoted), the new block keeps its
    own disk copy."""
    s = _store(tmp_path)
    copied, entered, go = _cleaner_copy_held_at_the_disk(s, monkeypatch)
    try:
        for key in singles[:8]:
            s.put(A, [key], [data(key)])
        assert entered.wait(10)
        by_tkey = {s._index.get((s._index.intern(A), k)).tkey: k for k in singles[:8]}  # type: ignore[union-attr]
        key = by_tkey[copied[0]]
        assert s.delete(A, [key]) == 1
        if stored_again:
            s.put(A, [key], [data(key)])
            with s._lock:  # demoted by hand, as an eviction would
                block = s._index.get((s._index.intern(A), key))
                assert block is not None and s._placement.demote(block, 0)
        go.set()
        _until(lambda: len(copied) > 1 or s.stats().counters.get("cleaned_blocks", 0) > 0)
        s.flush()
        held = s.tiers[1].get_into(copied[0], memoryview(bytearray(BLOCK)))
        if stored_again:
            assert held == BLOCK and s.tier_of(A, key) == "nvme" and s.get(A, [key]) == [data(key)]
        else:
            assert held is None and s.tier_of(A, key) is None
    finally:
        go.set()
        s.close()


def test_a_write_whose_victims_are_clean_never_waits_for_a_busy_disk(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write into a full arena waits for a disk whose queue is full only for the victims it
    would demote; when the cleaner has copied them all, it waits for nothing (it waited the
    whole pace, 2 s, before)."""
    s = _store(tmp_path, queue_blocks=2)
    nvme = s.tiers[1]
    assert isinstance(nvme, NvmeTier)
    gate: threading.Event | None = None
    try:
        for key in singles[:8]:
            s.put(A, [key], [data(key)])
        _until(lambda: s.stats().counters.get("cleaned_blocks", 0) >= 4)
        s.flush()
        gate = hold_writer(nvme, monkeypatch)
        nvme.put(TierKey(b"busy"), data(singles[0]), bytes(s._index.intern(A).fingerprint))  # queue full
        more = chain(4, salt="more")
        started = time.monotonic()
        assert s.put(A, more, [data(k) for k in more]) == 4  # its four victims are the clean four
        assert time.monotonic() - started < 1.0
        counters = s.stats().counters
        assert counters.get("pace_timeouts", 0) == 0 and counters.get("demotions", 0) == 0
        assert [s.tier_of(A, k) for k in singles[:4]] == ["nvme"] * 4  # evicted, none lost
    finally:
        if gate is not None:
            gate.set()
        s.close()


def _keep_writing(s: TieredStore, seconds: float, until: Callable[[], bool] = lambda: False) -> bool:
    """Poke the cleaner as a stream of writes does, every 10 ms, for ``seconds`` or until
    ``until()``; whether ``until()`` came true."""
    cleaner = s._cleaner
    assert isinstance(cleaner, Cleaner)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if until():
            return True
        cleaner.poke()
        time.sleep(0.01)
    return until()


def test_the_cleaner_waits_for_a_pause_in_the_writes(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cleaning takes the CPU and memory bandwidth a burst of writes copies with: it waits
    until the writes pause (QUIET_S), then cleans as before."""
    monkeypatch.setattr("kvstore.store.cleaner.QUIET_S", 1.0)
    monkeypatch.setattr("kvstore.store.cleaner.MAX_DEFER_S", 60.0)
    s = _store(tmp_path)
    try:
        for key in singles[:8]:
            s.put(A, [key], [data(key)])  # the arena is full: the cleaner is poked
        assert not _keep_writing(s, 1.5, lambda: s.stats().counters.get("cleaned_blocks", 0) > 0)
        _until(lambda: s.stats().counters.get("cleaned_blocks", 0) >= 4)  # the pause came
        assert [_tiers(s, k) for k in singles[:4]] == [{"dram", "nvme"}] * 4
    finally:
        s.close()


def test_writes_that_never_pause_get_their_cleaning_alongside(
    tmp_path: Path, singles: list[BlockKey], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvstore.store.cleaner.QUIET_S", 1.0)
    monkeypatch.setattr("kvstore.store.cleaner.MAX_DEFER_S", 0.2)
    s = _store(tmp_path)
    try:
        for key in singles[:8]:
            s.put(A, [key], [data(key)])
        assert _keep_writing(s, 10.0, lambda: s.stats().counters.get("cleaned_blocks", 0) >= 4)
    finally:
        s.close()
