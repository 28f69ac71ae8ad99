"""The same-host data plane at the store: resolve slots to read in place, reserve and commit
slots written in place, over a real arena that another process maps."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import kvstore.store.arena
from kvstore.errors import KvStoreError, LeaseExpired, LeaseNotFound
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.store import Reservation, Scope, StoreConfig, TieredStore
from kvstore.store.held import KEY_PREFIX as HELD_KEY_PREFIX
from tiers import Tier, TierKey
from tiers.dram import Arena, DramConfig, DramTier
from tiers.nvme import NvmeConfig, NvmeTier
from tiers.throttle import Throttled

BLOCK = 1 << 16
FP = Fingerprint(b"\x0a" * 32)
A = Scope("tenant-a", FP)


class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def data(key: BlockKey) -> bytes:
    return (key * (BLOCK // 32))[:BLOCK]


def chain(n: int, salt: str = "s") -> list[BlockKey]:
    return block_keys(FP, list(range(n * 4)), 4, cache_salt=salt)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[TieredStore]:
    dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=32 * BLOCK))
    # No cleaner: these tests follow exact placements in a 4-block arena, where a block the
    # cleaner holds for its copy changes what can be evicted (tests/test_cleaner.py has it).
    s = TieredStore([dram, nvme], StoreConfig(clean_ahead=0), clock=clock)
    yield s
    s.close()


def _write_slots(arena_name: str, offsets: list[int], payloads: list[bytes]) -> None:
    arena = Arena.attach(arena_name)
    for offset, payload in zip(offsets, payloads, strict=True):
        arena.view[offset : offset + len(payload)] = payload
    arena.close()


def test_reserve_write_in_another_process_commit_then_resolve(store: TieredStore) -> None:
    keys = chain(3)
    reservation = store.reserve(A, keys, [BLOCK] * 3)
    assert all(s is not None for s in reservation.slots)
    assert store.lookup(A, keys).hit_blocks == 0  # invisible until commit
    offsets = [s.offset for s in reservation.slots if s]
    ctx = multiprocessing.get_context("spawn")
    arena = store.arena
    assert arena is not None
    child = ctx.Process(target=_write_slots, args=(arena.arena.name, offsets, [data(k) for k in keys]))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert store.commit(reservation.reservation_id) == 3
    resolved = store.resolve(A, keys)
    assert len(resolved.slots) == 3 and resolved.lease is not None
    for key, slot in zip(keys, resolved.slots, strict=True):
        assert arena.arena.view[slot.offset : slot.offset + slot.size_bytes] == data(key)
    store.release(resolved.lease.lease_id)
    assert store.get(A, keys) == [data(k) for k in keys]


def test_reserve_skips_present_keys_and_commit_twice_fails(store: TieredStore) -> None:
    keys = chain(2)
    store.put(A, keys[:1], [data(keys[0])])
    reservation = store.reserve(A, keys, [BLOCK, BLOCK])
    assert reservation.slots[0] is None and reservation.slots[1] is not None
    assert store.commit(reservation.reservation_id) == 1
    with pytest.raises(LeaseNotFound):
        store.commit(reservation.reservation_id)


def test_two_writers_of_one_key_one_wins(store: TieredStore) -> None:
    keys = chain(1)
    first = store.reserve(A, keys, [BLOCK])
    second = store.reserve(A, keys, [BLOCK])
    assert first.slots[0] is not None and second.slots[0] is None
    store.commit(first.reservation_id)
    assert store.commit(second.reservation_id) == 0


def test_a_chunk_reserved_before_its_parent_is_committed_takes_its_depth_at_commit(
    store: TieredStore,
) -> None:
    keys = chain(4, salt="pipelined")
    head = store.reserve(A, keys[:2], [BLOCK, BLOCK])
    tail = store.reserve(A, keys[2:], [BLOCK, BLOCK], parent=keys[1])  # keys[1] not stored yet
    assert store.commit(head.reservation_id) == 2
    assert store.commit(tail.reservation_id) == 2
    index = store._index
    assert [index.get((A, k)).depth for k in keys] == [0, 1, 2, 3]  # type: ignore[union-attr]
    assert [index.get((A, k)).parent for k in keys] == [None, *keys[:3]]  # type: ignore[union-attr]


def test_abort_and_expiry_give_slots_back(store: TieredStore, clock: FakeClock) -> None:
    arena = store.arena
    assert arena is not None
    reservation = store.reserve(A, chain(4), [BLOCK] * 4)
    assert arena.usage().stored_bytes == 4 * BLOCK
    store.abort(reservation.reservation_id)
    assert arena.usage().stored_bytes == 0
    reservation = store.reserve(A, chain(4), [BLOCK] * 4, ttl_s=2)
    clock.now += 3
    store.lookup(A, chain(1))  # any call collects what expired
    with pytest.raises(LeaseExpired):
        store.commit(reservation.reservation_id)
    assert store.stats().counters["reservations_expired"] == 1
    assert store.reserve(A, chain(4), [BLOCK] * 4).slots.count(None) == 0


def test_resolve_promotes_from_nvme_into_the_arena(store: TieredStore) -> None:
    keys = chain(6)
    store.put(A, keys, [data(k) for k in keys])  # the arena holds the head; the tail goes below
    assert [store.tier_of(A, k) for k in keys] == ["dram"] * 4 + ["nvme"] * 2
    arena = store.arena
    assert arena is not None
    # The whole chain does not fit a 4-block arena at once: resolve pins the prefix it can.
    resolved = store.resolve(A, keys)
    assert len(resolved.slots) == 4 and resolved.lease is not None
    store.release(resolved.lease.lease_id)
    resolved = store.resolve(A, keys[4:])  # the tail: copied up from nvme, read in place
    assert len(resolved.slots) == 2 and resolved.tiers == ("nvme", "nvme")  # where they were found
    assert resolved.lease is not None
    for key, slot in zip(keys[4:], resolved.slots, strict=True):
        assert arena.arena.view[slot.offset : slot.offset + slot.size_bytes] == data(key)
    store.release(resolved.lease.lease_id)
    assert store.stats().counters["promotions"] == 2
    assert store.get(A, keys) == [data(k) for k in keys]


def test_resolve_of_a_miss_pins_nothing(store: TieredStore) -> None:
    resolved = store.resolve(A, chain(2))
    assert resolved.slots == () and resolved.lease is None
    assert store.stats().leases == 0


def test_a_throttled_tier_slows_its_readers_only(tmp_path: Path, store: TieredStore) -> None:
    import time

    keys = chain(2)
    store.put(A, keys, [data(k) for k in keys])
    start = time.perf_counter()
    store.release(store.resolve(A, keys).lease.lease_id)  # type: ignore[union-attr]
    fast = time.perf_counter() - start
    store.close()
    dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme-throttled", capacity_bytes=32 * BLOCK))
    throttled = TieredStore(
        [Throttled(dram, 2 * BLOCK / 0.2), nvme], StoreConfig(clean_ahead=0)
    )  # 2 blocks: 0.2 s
    try:
        throttled.put(A, keys, [data(k) for k in keys])
        start = time.perf_counter()
        resolved = throttled.resolve(A, keys)
        slow = time.perf_counter() - start
        assert resolved.lease is not None
        throttled.release(resolved.lease.lease_id)
        assert slow >= 0.2 > fast
        buf = memoryview(bytearray(BLOCK))
        start = time.perf_counter()
        throttled.get_into(A, keys[0], buf)
        assert time.perf_counter() - start >= 0.1
    finally:
        throttled.close()


def test_a_pinning_lookup_gives_the_slots_of_what_the_arena_holds(
    store: TieredStore, clock: FakeClock
) -> None:
    """``lookup(..., slots=True)``: a slot for each pinned hit with an arena copy (the bytes a
    resolve would read), None for one only below; ``lease_held`` until the lease is released,
    or has expired and been collected (a later call collects it)."""
    keys = chain(6)
    store.put(A, keys, [data(k) for k in keys])  # the arena holds the head; the tail goes below
    arena = store.arena
    assert arena is not None
    found = store.lookup(A, keys, pin_ttl_s=5, slots=True)
    assert found.hit_blocks == 6 and found.lease is not None
    assert [s is not None for s in found.slots] == [True] * 4 + [False] * 2
    for key, slot in zip(keys[:4], found.slots[:4], strict=True):
        assert slot is not None and arena.arena.view[slot.offset : slot.offset + slot.size_bytes] == data(key)
    assert store.lease_held(found.lease.lease_id)
    assert not store.lease_held(found.lease.lease_id, owner="someone-else")
    store.release(found.lease.lease_id)
    assert not store.lease_held(found.lease.lease_id)
    assert store.lookup(A, keys, slots=True).slots == ()  # not pinned: no slots to trust
    assert store.lookup(A, keys, pin_ttl_s=5).slots == ()  # not asked for
    lapsing = store.lookup(A, keys[:2], pin_ttl_s=2, slots=True).lease
    assert lapsing is not None
    clock.now += 3
    assert store.lease_held(lapsing.lease_id)  # past its time, still pinning until collected
    store.release(store.lookup(A, keys[:1], pin_ttl_s=1).lease.lease_id)  # type: ignore[union-attr]
    assert not store.lease_held(lapsing.lease_id)


def test_a_throttled_arena_hands_out_no_slots(tmp_path: Path) -> None:
    """A throttled arena's reader waits out its delay inside ``resolve``: a lookup must not let
    it read in place for free."""
    dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme-throttled", capacity_bytes=32 * BLOCK))
    throttled = TieredStore([Throttled(dram, 1e9), nvme], StoreConfig(clean_ahead=0))
    try:
        keys = chain(2)
        throttled.put(A, keys, [data(k) for k in keys])
        found = throttled.lookup(A, keys, pin_ttl_s=5, slots=True)
        assert found.hit_blocks == 2 and found.slots == ()
    finally:
        throttled.close()


def test_lease_ids_of_two_stores_do_not_start_alike(tmp_path: Path) -> None:
    """A restarted server must not grant an id its predecessor granted: a reader checking a
    lease from before the restart would find another's and trust a copy it should not."""
    firsts = set()
    for _ in range(2):
        dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
        s = TieredStore([dram], StoreConfig())
        try:
            s.put(A, chain(1), [data(chain(1)[0])])
            lease = s.lookup(A, chain(1), pin_ttl_s=5).lease
            assert lease is not None
            firsts.add(lease.lease_id)
        finally:
            s.close()
    assert len(firsts) == 2


def test_a_key_deleted_under_a_reader_is_stored_again_once_the_reader_lets_go(store: TieredStore) -> None:
    keys = chain(2)
    store.put(A, keys, [data(k) for k in keys])
    resolved = store.resolve(A, keys)
    assert resolved.lease is not None
    assert store.delete(A, keys[1:]) == 1  # the reader still holds its slot: doomed, not freed
    arena = store.arena
    assert arena is not None
    slot = resolved.slots[1]
    assert arena.arena.view[slot.offset : slot.offset + slot.size_bytes] == data(keys[1])
    # Its storage is still the reader's: a new copy cannot go under the key yet, and neither
    # path hands out a slot to write in vain; both say so in the counters.
    assert store.put(A, keys[1:], [data(keys[1])]) == 0
    reservation = store.reserve(A, keys[1:], [BLOCK], parent=keys[0])
    assert reservation.slots == (None,)
    store.abort(reservation.reservation_id)
    assert store.stats().counters["put_doomed_blocks"] == 2
    assert store.lookup(A, keys).hit_blocks == 1
    store.release(resolved.lease.lease_id)  # the doomed block is freed now ...
    reservation = store.reserve(A, keys[1:], [BLOCK], parent=keys[0])  # ... and the key is free
    (slot,) = reservation.slots
    assert slot is not None
    arena.arena.view[slot.offset : slot.offset + BLOCK] = data(keys[1])
    assert store.commit(reservation.reservation_id) == 1
    assert store.get(A, keys) == [data(k) for k in keys]


def test_a_reservation_larger_than_the_arena_evicts_nothing(store: TieredStore) -> None:
    keys = chain(3)
    store.put(A, keys, [data(k) for k in keys])
    assert [store.tier_of(A, k) for k in keys] == ["dram"] * 3
    big = chain(1, salt="too big")
    reservation = store.reserve(A, big, [5 * BLOCK])  # the arena holds 4 blocks in all
    assert reservation.slots == (None,)
    store.abort(reservation.reservation_id)
    assert [store.tier_of(A, k) for k in keys] == ["dram"] * 3  # nothing was demoted for it
    assert store.stats().counters.get("evictions", 0) == 0


def test_a_reservation_in_a_full_arena_makes_room_for_each_block_it_can(store: TieredStore) -> None:
    old = chain(4, salt="old")
    store.put(A, old, [data(k) for k in old])  # the arena (4 blocks) is full
    held = store.resolve(A, old[:2])  # two of them pinned: they stay
    assert held.lease is not None
    new = chain(3, salt="new")
    reservation = store.reserve(A, new, [BLOCK] * 3)
    assert [s is not None for s in reservation.slots] == [True, True, False]  # room for two only
    assert [store.tier_of(A, k) for k in old] == ["dram", "dram", "nvme", "nvme"]  # demoted, not lost
    assert store._writes._governance.reserved[A.namespace] == 2 * BLOCK  # only the slots given count
    assert store.commit(reservation.reservation_id) == 2
    assert not store._writes._governance.reserved
    store.release(held.lease.lease_id)
    assert store.get(A, old) == [data(k) for k in old]


def test_a_chunk_into_a_full_arena_evicts_as_many_blocks_as_it_needs_in_one_pass(store: TieredStore) -> None:
    """Room for a chunk's run of equal blocks is made at once (not a block at a time, each with
    its own reserve): exactly as many victims as slots wanted, the coldest."""
    singles = [chain(1, salt=f"single-{i}")[0] for i in range(4)]
    for key in singles:
        store.put(A, [key], [data(key)])  # the arena (4 blocks) is full, coldest first
    new = chain(3, salt="new")
    reservation = store.reserve(A, new, [BLOCK] * 3)
    assert all(s is not None for s in reservation.slots)
    assert store.stats().counters["evicted_dram_blocks"] == 3
    assert [store.tier_of(A, k) for k in singles] == ["nvme", "nvme", "nvme", "dram"]
    assert store.commit(reservation.reservation_id) == 3


def test_a_reservation_that_fails_in_the_arena_holds_nothing(store: TieredStore) -> None:
    parent = chain(1, salt="parent")
    store.put(A, parent, [data(parent[0])])
    (block,) = store._index.blocks.values()
    arena = store.arena
    assert arena is not None
    arena.close()  # the arena closing under the call: its slots cannot be had
    with pytest.raises(KvStoreError):
        store.reserve(A, chain(2, salt="child"), [BLOCK] * 2, parent=parent[0])
    assert not store._writes._governance.reserved  # no bytes left counted against the quota
    assert block.pins == 0  # and the parent it held for its chain is let go


def hold_writer(nvme: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The disk takes nothing: nvme's writer commits no batch until the event is set."""
    gate = threading.Event()
    commit = nvme._writer._commit

    def gated(batch: object) -> None:
        assert gate.wait(30), "the test never let the disk go on"
        commit(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(nvme._writer, "_commit", gated)
    return gate


def _gated_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, above: Sequence[Tier] = (), throttled: bool = False
) -> tuple[TieredStore, threading.Event]:
    """A 4-block arena (below the tiers ``above``) over nvme whose write queue takes 2 blocks
    and whose writer commits nothing until the event is set: the disk is behind. No cleaner.
    ``throttled``: nvme behind a read throttle (its write queue is still the store's to use)."""
    dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(
        NvmeConfig(path=tmp_path / "nvme", capacity_bytes=32 * BLOCK, max_pending_bytes=2 * BLOCK)
    )
    gate = hold_writer(nvme, monkeypatch)
    # Without the cleaner: these tests follow victims that have no copy on the disk yet
    # (tests/test_cleaner.py has the cleaner against a disk that is behind).
    disk: Tier = Throttled(nvme, 1 << 40) if throttled else nvme
    return TieredStore([*above, dram, disk], StoreConfig(clean_ahead=0)), gate


def test_a_writer_waits_for_a_disk_that_is_behind_outside_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, gate = _gated_store(tmp_path, monkeypatch)
    try:
        first, second, third = chain(4, salt="1"), chain(2, salt="2"), chain(1, salt="3")
        s.put(A, first, [data(k) for k in first])  # the arena is full
        s.put(A, second, [data(k) for k in second])  # two victims fill the disk's queue
        writer = threading.Thread(target=s.put, args=(A, third, [data(third[0])]))
        reserved: list[Reservation] = []
        same_host = threading.Thread(
            target=lambda: reserved.append(s.reserve(A, chain(1, salt="4"), [BLOCK]))
        )
        writer.start()
        same_host.start()
        writer.join(0.3)
        assert writer.is_alive() and same_host.is_alive()  # paced: both wait for the disk...
        assert s.lookup(A, second).hit_blocks == 2  # ...and everyone else goes on meanwhile
        gate.set()
        writer.join(10)
        same_host.join(10)
        assert not writer.is_alive() and not same_host.is_alive()
        # Each paced write holds the slot it waited for: the reservation beside the writer
        # cannot take the writer's, nor the writer the reservation's.
        assert reserved[0].slots[0] is not None
        s.abort(reserved[0].reservation_id)
        counters = s.stats().counters
        assert counters["demotions"] == 4 and counters.get("nvme_busy_skipped_blocks", 0) == 0
        everything = first + second + third
        assert [s.tier_of(A, k) for k in everything] == ["nvme"] * 4 + ["dram"] * 3  # none lost
        assert not _held_slots(s)
    finally:
        gate.set()
        s.close()


def test_two_paced_writers_each_keep_the_slot_they_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk writes one block a commit, each commit let through by the test: the first
    # victim's slot comes free while the second's still waits, with both writers paced.
    dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=32 * BLOCK, batch_max_blocks=1))
    commits = threading.Semaphore(0)
    commit = nvme._writer._commit

    def one_at_a_time(batch: object) -> None:
        assert commits.acquire(timeout=30), "the test never let the disk go on"
        commit(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(nvme._writer, "_commit", one_at_a_time)
    s = TieredStore([dram, nvme], StoreConfig(clean_ahead=0))
    pace = s._pacing.pace

    def descheduled(t: int, sizes: Sequence[int], timeout_s: float) -> object:
        held = pace(t, sizes, timeout_s)
        time.sleep(0.2)  # a writer descheduled between its wait and its write (a busy host)
        return held

    try:
        first = chain(4, salt="1")
        s.put(A, first, [data(k) for k in first])  # the arena is full; the disk holds nothing
        monkeypatch.setattr(s._pacing, "pace", descheduled)
        late = [chain(1, salt="2"), chain(1, salt="3")]
        writers = [threading.Thread(target=s.put, args=(A, keys, [data(keys[0])])) for keys in late]
        for n, writer in enumerate(writers, 1):  # in line one after the other
            writer.start()
            deadline = time.monotonic() + 10
            while s.stats().counters["retired_slots"] < n and time.monotonic() < deadline:
                time.sleep(0.01)
        writers[0].join(0.3)
        assert all(writer.is_alive() for writer in writers)  # each evicted a victim and waits for it
        assert s.stats().counters["retired_slots"] == 2
        commits.release()  # the first victim's copy written: one slot free, one still retiring
        writers[0].join(10)
        assert not writers[0].is_alive()  # first in line, first served...
        assert writers[1].is_alive()  # ...and the second waits for its own slot, not the first's
        commits.release(100)  # then the rest
        for writer in writers:
            writer.join(10)
        assert not any(writer.is_alive() for writer in writers)
        # Both blocks in the arena: neither writer took the slot the other waited for (the
        # one left without it went on to find no room, and its block went to the disk or nowhere).
        assert [s.tier_of(A, keys[0]) for keys in late] == ["dram", "dram"]
        counters = s.stats().counters
        assert counters["demotions"] == 2 and counters.get("nvme_busy_skipped_blocks", 0) == 0
        assert [s.tier_of(A, k) for k in first] == ["dram"] * 2 + ["nvme"] * 2  # none lost (tail first)
        assert not _held_slots(s)  # each write took the room held for it
    finally:
        commits.release(100)
        s.close()


def test_two_promotions_into_a_full_arena_each_keep_the_slot_they_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two resolves of blocks that only nvme holds, into an arena full of blocks the disk has not
    written: each evicts a victim and waits for its copy; the first victim's slot, once free, is
    the first resolve's, and the second waits for its own (no third victim evicted for it)."""
    dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=32 * BLOCK, batch_max_blocks=1))
    commits = threading.Semaphore(0)
    commit = nvme._writer._commit

    def one_at_a_time(batch: object) -> None:
        assert commits.acquire(timeout=30), "the test never let the disk go on"
        commit(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(nvme._writer, "_commit", one_at_a_time)
    # the resolves' wait for the disk outlasts this test's steps on a loaded host (CI's 2 cores)
    monkeypatch.setattr(kvstore.store.arena, "PACE_S", 30.0)
    s = TieredStore([dram, nvme], StoreConfig(clean_ahead=0))
    wait_retired = s._pacing.wait_retired

    def descheduled(t: int, size_bytes: int, timeout_s: float) -> object:
        room = wait_retired(t, size_bytes, timeout_s)
        time.sleep(0.2)  # a resolve descheduled between its wait and its promotion (a busy host)
        return room

    try:
        wanted = [chain(1, salt="x"), chain(1, salt="y")]
        for keys in wanted:
            s.put(A, keys, [data(keys[0])])
        full = chain(4, salt="full")
        commits.release(2)  # the two wanted blocks go to the disk as the arena fills
        s.put(A, full, [data(k) for k in full])  # paced: it waited for their slots
        assert [s.tier_of(A, keys[0]) for keys in wanted] == ["nvme", "nvme"]
        assert [s.tier_of(A, k) for k in full] == ["dram"] * 4  # on no disk yet
        before = s.stats().counters["demotions"]
        monkeypatch.setattr(s._pacing, "wait_retired", descheduled)
        resolved: dict[int, object] = {}

        def resolve(n: int) -> None:
            resolved[n] = s.resolve(A, wanted[n])

        resolves = [threading.Thread(target=resolve, args=(n,)) for n in range(2)]
        for n, thread in enumerate(resolves, 1):  # in line one after the other
            thread.start()
            deadline = time.monotonic() + 10
            while s.stats().counters["demotions"] < before + n and time.monotonic() < deadline:
                time.sleep(0.01)
        resolves[0].join(0.3)
        assert all(thread.is_alive() for thread in resolves)  # each evicted a victim and waits for it
        commits.release()  # the first victim's copy written: one slot free, one still retiring
        resolves[0].join(10)
        assert not resolves[0].is_alive()  # first in line, first served...
        assert resolves[1].is_alive()  # ...and the second waits for its own slot, not the first's
        commits.release(100)
        resolves[1].join(10)
        assert not resolves[1].is_alive()
        assert [len(resolved[n].slots) for n in range(2)] == [1, 1]  # type: ignore[attr-defined]
        assert [s.tier_of(A, keys[0]) for keys in wanted] == ["dram", "dram"]
        assert s.stats().counters["demotions"] == before + 2  # one victim each, no third
        assert not _held_slots(s)  # each promotion took the room held for it
        for n in range(2):
            s.release(resolved[n].lease.lease_id)  # type: ignore[attr-defined]
    finally:
        commits.release(100)
        s.close()


@pytest.mark.parametrize("throttled", [False, True], ids=["nvme", "throttled-nvme"])
def test_a_disk_behind_past_the_pace_drops_the_victims_and_stalls_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, throttled: bool
) -> None:
    import kvstore.store.writes

    monkeypatch.setattr(kvstore.store.writes, "PACE_S", 0.2)
    s, gate = _gated_store(tmp_path, monkeypatch, throttled=throttled)
    try:
        first, second, third = chain(4, salt="1"), chain(2, salt="2"), chain(2, salt="3")
        s.put(A, first, [data(k) for k in first])
        s.put(A, second, [data(k) for k in second])
        assert s.put(A, third, [data(k) for k in third]) == 2  # stored after 0.2 s, never waiting in the lock
        counters = s.stats().counters
        # Two writes waited: the second for its victims' slots (retired until the disk writes
        # their copies, then let go unwritten), the third for the full queue
        assert counters["pace_timeouts"] == 2 and counters["nvme_busy_skipped_blocks"] >= 2
        assert counters["retired_slots_freed_unwritten"] == 2
        assert counters["demotions"] == 2  # the two that found the queue with room
        assert s.lookup(A, third).hit_blocks == 2
        present = sum(s.lookup(A, [k]).hit_blocks for k in first + second)
        assert present == 6 - 2  # of the four victims two were demoted, two dropped
        assert not _held_slots(s)  # a write out of time holds no room past its own write
    finally:
        gate.set()
        s.close()


def _held_slots(s: TieredStore) -> list[bytes]:
    """The arena slots held for paced writes (``kvstore.store.held``) that no write has taken."""
    arena = s.arena
    return [key for key in arena._pending if key.startswith(HELD_KEY_PREFIX)]  # type: ignore[attr-defined]


def test_a_write_of_blocks_already_stored_never_waits_for_a_disk_that_is_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, gate = _gated_store(tmp_path, monkeypatch)
    try:
        first, second = chain(4, salt="1"), chain(2, salt="2")
        s.put(A, first, [data(k) for k in first])  # the arena is full
        s.put(A, second, [data(k) for k in second])  # two victims fill the disk's queue
        assert [s.tier_of(A, k) for k in second] == ["dram"] * 2
        paced = s.stats().counters.get("pace_timeouts", 0)  # that put's, for its victims' slots
        started = time.monotonic()
        reserved = s.reserve(A, second, [BLOCK] * 2)  # a second store of them
        assert reserved.slots == (None, None)  # nothing to write: nothing to make room for
        s.commit(reserved.reservation_id)
        assert s.put(A, second, [data(k) for k in second]) == 0
        assert time.monotonic() - started < 1.0  # not paced (PACE_S is 2 s) for room it never needs
        assert s.stats().counters.get("pace_timeouts", 0) == paced
    finally:
        gate.set()
        s.close()


def test_a_write_whose_room_a_memory_tier_below_takes_never_waits_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiers.hbm import HbmConfig, HbmTier

    hbm = HbmTier(HbmConfig(capacity_bytes=2 * BLOCK, page_bytes=BLOCK, device="cpu"))
    s, gate = _gated_store(tmp_path, monkeypatch, above=[hbm])  # hbm over dram over a slow disk
    nvme = s.tiers[2]
    try:
        two = chain(2, salt="hbm")
        s.put(A, two, [data(k) for k in two])  # hbm is full
        nvme.put(TierKey(b"x"), data(two[0]), bytes(FP))  # and so is the disk's queue (2 blocks)
        nvme.put(TierKey(b"y"), data(two[1]), bytes(FP))
        started = time.monotonic()
        more = chain(2, salt="more")
        assert s.put(A, more, [data(k) for k in more]) == 2  # its victims go to dram, which has room
        assert time.monotonic() - started < 1.0  # not paced (PACE_S is 2 s)
        assert s.stats().counters.get("pace_timeouts", 0) == 0
    finally:
        gate.set()
        s.close()


def test_an_operators_demote_waits_for_the_disk_outside_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvstore demote dram` into a disk that is behind moves every block in the end, and no
    other caller waits behind it meanwhile: it waits for the disk between blocks, the store let go."""
    s, gate = _gated_store(tmp_path, monkeypatch)
    try:
        keys = chain(4, salt="demoted")
        s.put(A, keys, [data(k) for k in keys])  # the arena full; the disk's queue takes 2 blocks
        moved: list[int] = []
        demote = threading.Thread(target=lambda: moved.append(s.demote("dram")))
        demote.start()
        demote.join(0.3)
        assert demote.is_alive()  # the queue is full and the disk takes nothing: it waits...
        started = time.monotonic()
        assert s.lookup(A, keys).hit_blocks == 4  # ...and a lookup is answered meanwhile
        assert time.monotonic() - started < 0.25
        arena = s.arena
        assert arena is not None
        # The blocks moved so far keep their arena slots until the disk has written them: a
        # kill -9 meanwhile leaves them to salvage
        assert arena.usage().stored_bytes == 4 * BLOCK and arena.usage().used_bytes == 2 * BLOCK
        gate.set()
        demote.join(10)
        assert moved == [4]
        assert [s.tier_of(A, k) for k in keys] == ["nvme"] * 4
        s.tiers[1].flush()
        other = chain(1, salt="meanwhile")
        assert s.put(A, other, [data(other[0])]) == 1  # the slots came free once written
        assert s.tier_of(A, other[0]) == "dram" and s.stats().counters.get("pace_timeouts", 0) == 0
    finally:
        gate.set()
        s.close()


@pytest.mark.parametrize("quota_blocks", [None, 3])
def test_a_reservation_holds_its_bytes_against_the_quota_and_stops_at_it(quota_blocks: int | None) -> None:
    """With a quota each block is checked as it is given a slot, and the chain stops at the
    quota; without one the bytes are held in one sum. Either way exactly the slots given count,
    until commit or abort."""
    dram = DramTier(DramConfig(capacity_bytes=8 * BLOCK, page_bytes=BLOCK, prefault=False))
    quota = {} if quota_blocks is None else {A.namespace: quota_blocks * BLOCK}
    s = TieredStore([dram], StoreConfig(quota_bytes=quota))
    try:
        keys = chain(5, salt="quota")
        reservation = s.reserve(A, keys, [BLOCK] * 5)
        given = 5 if quota_blocks is None else quota_blocks
        assert [slot is not None for slot in reservation.slots] == [True] * given + [False] * (5 - given)
        assert s._writes._governance.reserved[A.namespace] == given * BLOCK
        s.abort(reservation.reservation_id)
        assert not s._writes._governance.reserved
        reservation = s.reserve(A, keys[:2], [BLOCK] * 2)
        assert s._writes._governance.reserved[A.namespace] == 2 * BLOCK
        assert s.commit(reservation.reservation_id) == 2
        assert not s._writes._governance.reserved
    finally:
        s.close()
