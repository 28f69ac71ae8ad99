"""The tiered store, step by step: placement, prefix-aware eviction, leases, quotas, tenancy.

Two memory tiers stand in for a fast and a slow tier (`hbm` on the CPU above `dram`), each one
page per block, so every eviction below is forced and predictable. Restart behaviour with the
`nvme` tier is in test_store_restart.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from kvstore.errors import InvalidArgument, LeaseExpired, LeaseNotFound, QuotaExceeded, StoreFull
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.store import Scope, StoreConfig, TieredStore
from tiers import Tier, TierKey, TierUnavailable
from tiers.dram import DramConfig, DramTier
from tiers.hbm import HbmConfig, HbmTier

PAGE = 1 << 16
FP = Fingerprint(b"\x01" * 32)
FP2 = Fingerprint(b"\x02" * 32)
A = Scope("tenant-a", FP)
B = Scope("tenant-b", FP)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(n: int, salt: str = "", fp: Fingerprint = FP) -> list[BlockKey]:
    return block_keys(fp, list(range(n * 4)), 4, cache_salt=salt or None)


def data(key: BlockKey) -> bytes:
    return (key * (PAGE // 32))[:PAGE]


def make_store(
    fast_blocks: int, slow_blocks: int, config: StoreConfig | None = None, clock: FakeClock | None = None
) -> TieredStore:
    fast = HbmTier(HbmConfig(capacity_bytes=fast_blocks * PAGE, page_bytes=PAGE, device="cpu"))
    slow = DramTier(DramConfig(capacity_bytes=slow_blocks * PAGE, page_bytes=PAGE, prefault=False))
    return TieredStore([fast, slow], config, clock=clock or FakeClock())


@pytest.fixture
def store() -> Iterator[TieredStore]:
    s = make_store(fast_blocks=4, slow_blocks=4)
    yield s
    s.close()


def where(store: TieredStore, scope: Scope, keys: list[BlockKey]) -> list[str | None]:
    return [store.tier_of(scope, k) for k in keys]


def test_put_lookup_get(store: TieredStore) -> None:
    keys = chain(3)
    assert store.put(A, keys, [data(k) for k in keys]) == 3
    assert store.lookup(A, keys).hit_blocks == 3
    assert store.lookup(A, keys).tiers == ("hbm", "hbm", "hbm")
    assert store.get(A, keys) == [data(k) for k in keys]
    assert store.put(A, keys, [data(k) for k in keys]) == 0  # already present
    assert store.stats().counters["put_dedup_blocks"] == 3


def test_lookup_stops_at_the_first_miss(store: TieredStore) -> None:
    keys = chain(4)
    store.put(A, keys[:2], [data(k) for k in keys[:2]])
    store.put(A, keys[3:], [data(keys[3])], parent=keys[2])
    assert store.lookup(A, keys).hit_blocks == 2


def test_eviction_demotes_children_before_parents(store: TieredStore) -> None:
    a = chain(4, "a")
    b = chain(2, "b")
    store.put(A, a, [data(k) for k in a])  # fast: a0 a1 a2 a3
    store.put(A, b, [data(k) for k in b])  # no room: the leaves of a go down first
    assert where(store, A, a) == ["hbm", "hbm", "dram", "dram"]
    assert where(store, A, b) == ["hbm", "hbm"]
    assert store.stats().counters["demotions"] == 2
    assert store.get(A, a[3:]) == [data(a[3])]  # still served, from the slow tier, then promoted


def test_last_tier_drops_leaves_first_and_never_strands_a_child(store: TieredStore) -> None:
    chains = [chain(3, f"c{i}") for i in range(6)]  # 18 blocks into 8 slots
    for keys in chains:
        store.put(A, keys, [data(k) for k in keys])
    present = {k for _, k, _ in store.blocks()}
    assert len(present) <= 8
    for keys in chains:
        # every present block's parent is present: a prefix, never a hole
        hit = store.lookup(A, keys).hit_blocks
        assert set(keys[:hit]) == present & set(keys)


def test_recompute_cost_keeps_deep_blocks_longer() -> None:
    # Two one-block chains compete: a deep block (recompute over a long prefix) and a shallow
    # one. With equal hits and sizes the shallow one goes first.
    s = make_store(fast_blocks=2, slow_blocks=1)
    deep, shallow, newcomer = chain(1, "deep"), chain(1, "shallow"), chain(1, "new")
    s.put(A, deep, [data(deep[0])], first_depth=500)
    s.put(A, shallow, [data(shallow[0])], first_depth=0)
    s.put(A, newcomer, [data(newcomer[0])])
    assert s.tier_of(A, deep[0]) == "hbm" and s.tier_of(A, shallow[0]) == "dram"
    s.close()


def test_hits_keep_a_block_in_the_fast_tier() -> None:
    s = make_store(fast_blocks=2, slow_blocks=2)
    hot, cold, new = chain(1, "hot"), chain(1, "cold"), chain(1, "new")
    s.put(A, hot, [data(hot[0])])
    s.put(A, cold, [data(cold[0])])
    for _ in range(3):
        s.get(A, hot)
    s.put(A, new, [data(new[0])])
    assert s.tier_of(A, hot[0]) == "hbm" and s.tier_of(A, cold[0]) == "dram"
    s.close()


def test_pinned_blocks_are_never_evicted(store: TieredStore) -> None:
    a = chain(4, "a")
    store.put(A, a, [data(k) for k in a])
    lease = store.lookup(A, a, pin_ttl_s=30).lease
    assert lease is not None and lease.blocks == 4
    b = chain(4, "b")
    store.put(A, b, [data(k) for k in b])  # fast tier is all pinned: b lands in the slow tier
    assert where(store, A, a) == ["hbm"] * 4
    assert where(store, A, b) == ["dram"] * 4
    c = chain(1, "c")
    store.put(A, c, [data(c[0])])  # b is not pinned: its leaf b3 drops out of the last tier
    assert store.lookup(A, b).hit_blocks == 3
    store.pin(A, b + c, ttl_s=30)
    d = chain(1, "d")
    with pytest.raises(StoreFull):
        store.put(A, d, [data(d[0])])  # now everything everywhere is pinned
    store.release(lease.lease_id)
    store.put(A, d, [data(d[0])])
    assert store.tier_of(A, d[0]) == "hbm"


def test_leases_expire_on_their_own() -> None:
    clock = FakeClock()
    s = make_store(fast_blocks=2, slow_blocks=0 + 1, clock=clock)
    a = chain(2, "a")
    s.put(A, a, [data(k) for k in a])
    lease = s.pin(A, a, ttl_s=5)
    clock.now += 6
    b = chain(2, "b")
    s.put(A, b, [data(k) for k in b])  # the lease ran out, so a can make way
    assert where(s, A, b) == ["hbm", "hbm"]
    with pytest.raises(LeaseExpired):
        s.release(lease.lease_id)
    assert s.stats().counters["leases_expired"] == 1
    s.close()


def test_release_twice_and_unknown_lease_raise(store: TieredStore) -> None:
    a = chain(1)
    store.put(A, a, [data(a[0])])
    lease = store.pin(A, a, ttl_s=10)
    store.release(lease.lease_id)
    with pytest.raises(LeaseNotFound):
        store.release(lease.lease_id)
    with pytest.raises(LeaseNotFound):
        store.release(123456)
    with pytest.raises(InvalidArgument):
        store.pin(A, a, ttl_s=0)


def test_promotion_on_hit(store: TieredStore) -> None:
    a = chain(4, "a")
    b = chain(2, "b")
    store.put(A, a, [data(k) for k in a])
    store.put(A, b, [data(k) for k in b])
    assert store.tier_of(A, a[2]) == "dram"
    assert store.get(A, [a[2]]) == [data(a[2])]
    assert store.tier_of(A, a[2]) == "hbm"
    assert store.stats().counters["promotions"] == 1


def test_write_through_keeps_a_copy_below() -> None:
    fast = HbmTier(HbmConfig(capacity_bytes=2 * PAGE, page_bytes=PAGE, device="cpu"))
    slow = DramTier(DramConfig(capacity_bytes=4 * PAGE, page_bytes=PAGE, prefault=False))
    s = TieredStore([fast, slow], StoreConfig(write_through=True), persistent=[False, True])
    a = chain(2)
    s.put(A, a, [data(k) for k in a])
    assert slow.usage().blocks == 2 and fast.usage().blocks == 2
    b = chain(1, "b")
    s.put(A, b, [data(b[0])])  # a1 leaves the fast tier without a copy: the slow one has it
    assert s.stats().counters.get("demotions", 0) == 0
    assert s.get(A, a) == [data(k) for k in a]
    s.close()


def test_tenants_never_share_blocks(store: TieredStore) -> None:
    keys = chain(2)
    store.put(A, keys, [data(k) for k in keys])
    assert store.lookup(B, keys).hit_blocks == 0
    assert store.get(B, keys) == [None, None]
    assert store.exists(B, keys) == [False, False]
    assert store.delete(B, keys) == 0
    store.put(B, keys, [b"\xee" * PAGE, b"\xee" * PAGE])
    assert store.get(A, keys) == [data(k) for k in keys]
    assert store.get(B, keys) == [b"\xee" * PAGE] * 2


def test_delete_and_invalidate() -> None:
    s = make_store(fast_blocks=8, slow_blocks=8)
    a1, a2, b1 = chain(2, "a1"), chain(2, "a2", fp=FP2), chain(2, "b1")
    s.put(A, a1, [data(k) for k in a1])
    s.put(Scope("tenant-a", FP2), a2, [data(k) for k in a2])
    s.put(B, b1, [data(k) for k in b1])
    assert s.delete(A, a1[1:]) == 1
    assert s.lookup(A, a1).hit_blocks == 1
    assert s.invalidate(fingerprint=FP2) == 2  # a model change: that fingerprint everywhere
    assert s.lookup(Scope("tenant-a", FP2), a2).hit_blocks == 0
    assert s.invalidate(namespace="tenant-b") == 2
    assert s.lookup(B, b1).hit_blocks == 0
    assert s.lookup(A, a1).hit_blocks == 1
    assert s.invalidate() == 1
    assert s.stats().blocks == 0
    assert all(u.used_bytes == 0 for u in s.stats().tiers)
    s.close()


def test_demote_moves_a_tier_down_children_first_and_drops_nothing() -> None:
    s = make_store(fast_blocks=6, slow_blocks=4)
    a, b, c = chain(3, "a"), chain(2, "b"), chain(1, "c", fp=FP2)
    s.put(A, a, [data(k) for k in a])
    s.put(Scope("tenant-a", FP2), c, [data(c[0])])
    s.put(B, b, [data(k) for k in b])
    lease = s.pin(A, a[2:], ttl_s=30)
    # tenant-a's FP blocks: a2 is pinned, so it stays, and so does its parent a1 (a child may
    # not sit in a faster tier than its parent); a0 has a1 above it here: it stays too.
    assert s.demote("hbm", namespace="tenant-a", fingerprint=FP) == 0
    s.release(lease.lease_id)
    assert s.demote("hbm", namespace="tenant-a", fingerprint=FP) == 3
    assert where(s, A, a) == ["dram"] * 3
    assert s.tier_of(Scope("tenant-a", FP2), c[0]) == "hbm"  # another fingerprint
    assert where(s, B, b) == ["hbm"] * 2  # another tenant
    assert s.stats().counters["demotions"] == 3
    # The slow tier has room for one more block: b1 (a leaf, deepest first) takes it; nothing
    # below is evicted to make room, so c0 and b0 stay.
    assert s.demote("hbm") == 1
    assert where(s, B, b) == ["hbm", "dram"] and s.tier_of(Scope("tenant-a", FP2), c[0]) == "hbm"
    assert where(s, A, a) == ["dram"] * 3
    assert s.get(A, a) == [data(k) for k in a] and s.get(B, b) == [data(k) for k in b]
    with pytest.raises(InvalidArgument):
        s.demote("dram")  # the slowest tier
    with pytest.raises(InvalidArgument):
        s.demote("tape")
    s.close()


def test_deleting_a_pinned_block_hides_it_and_frees_it_on_release(store: TieredStore) -> None:
    keys = chain(1)
    store.put(A, keys, [data(keys[0])])
    lease = store.pin(A, keys, ttl_s=10)
    assert store.delete(A, keys) == 1
    assert store.lookup(A, keys).hit_blocks == 0
    assert store.stats().tiers[0].used_bytes == PAGE  # still held for the reader
    store.release(lease.lease_id)
    assert store.stats().tiers[0].used_bytes == 0


def test_quota_evicts_the_tenants_own_blocks_first() -> None:
    s = make_store(fast_blocks=8, slow_blocks=8, config=StoreConfig(quota_bytes={"tenant-a": 3 * PAGE}))
    b = chain(2, "b")
    s.put(B, b, [data(k) for k in b])
    for i in range(4):
        one = chain(1, f"a{i}")
        s.put(A, one, [data(one[0])])
    assert s.stats().namespace_bytes["tenant-a"] == 3 * PAGE
    assert s.lookup(B, b).hit_blocks == 2  # the other tenant lost nothing
    assert s.stats().counters["quota_evictions"] == 1
    s.close()


def test_quota_full_of_pinned_blocks_refuses() -> None:
    s = make_store(fast_blocks=8, slow_blocks=8, config=StoreConfig(quota_bytes={"tenant-a": 2 * PAGE}))
    a = chain(2, "a")
    s.put(A, a, [data(k) for k in a])
    s.pin(A, a, ttl_s=10)
    c = chain(1, "c")
    with pytest.raises(QuotaExceeded):
        s.put(A, c, [data(c[0])])
    with pytest.raises(QuotaExceeded):
        s.put(A, chain(3, "big"), [data(k) for k in chain(3, "big")])
    s.close()


def test_a_chain_longer_than_the_quota_stores_its_prefix() -> None:
    s = make_store(fast_blocks=8, slow_blocks=8, config=StoreConfig(quota_bytes={"tenant-a": 2 * PAGE}))
    a = chain(4)
    with pytest.raises(QuotaExceeded, match="stored 2 of 4"):
        s.put(A, a, [data(k) for k in a])
    assert s.lookup(A, a).hit_blocks == 2
    s.close()


def test_bad_arguments_are_invalid(store: TieredStore) -> None:
    with pytest.raises(InvalidArgument):
        store.lookup(A, [BlockKey(b"short")])
    with pytest.raises(InvalidArgument):
        store.put(A, chain(2), [b"x"])
    with pytest.raises(InvalidArgument):
        Scope("", FP)
    with pytest.raises(InvalidArgument):
        Scope("t", Fingerprint(b"x"))
    keys = chain(1)
    store.put(A, keys, [data(keys[0])])
    with pytest.raises(InvalidArgument):
        store.get_into(A, keys[0], memoryview(bytearray(10)))


def test_retention_removes_blocks_from_every_tier_after_their_time() -> None:
    wall = FakeClock()  # the wall clock, stepped like the lease clock
    fast = HbmTier(HbmConfig(capacity_bytes=4 * PAGE, page_bytes=PAGE, device="cpu"))
    slow = DramTier(DramConfig(capacity_bytes=8 * PAGE, page_bytes=PAGE, prefault=False))
    config = StoreConfig(retention_s={"tenant-a": 60.0})  # tenant-b keeps its blocks
    store = TieredStore([fast, slow], config, clock=FakeClock(), wall_clock=wall)
    try:
        keys_a, keys_b = chain(6, "a"), chain(2, "b")
        store.put(A, keys_a, [data(k) for k in keys_a])  # 6 blocks: 4 fast, 2 demoted to slow
        store.put(B, keys_b, [data(k) for k in keys_b])
        wall.now += 59
        assert store.lookup(A, keys_a).hit_blocks == 6
        wall.now += 2  # past 60 s: invisible at once ...
        assert store.lookup(A, keys_a).hit_blocks == 0
        store.lookup(B, keys_b)  # ... and gone from the tiers at the next sweep
        assert store.stats().counters["retention_expired_blocks"] == 6
        assert fast.usage().blocks + slow.usage().blocks == 2
        assert store.lookup(B, keys_b).hit_blocks == 2
        store.put(A, keys_a[:1], [data(keys_a[0])])  # stored again: a new life
        wall.now += 30
        assert store.lookup(A, keys_a[:1]).hit_blocks == 1
    finally:
        store.close()


def test_a_block_past_its_retention_is_stored_again_before_the_sweep_reaches_it() -> None:
    wall = FakeClock()
    tier = DramTier(DramConfig(capacity_bytes=8 * PAGE, page_bytes=PAGE, prefault=False))
    store = TieredStore(
        [tier], StoreConfig(retention_s={"tenant-a": 0.5}), clock=FakeClock(), wall_clock=wall
    )
    try:
        keys = chain(1)
        assert store.put(A, keys, [data(keys[0])]) == 1
        assert store.lookup(A, keys).hit_blocks == 1  # this swept, nothing due: the next is 1 s away
        wall.now += 0.6  # past its retention, and the sweep has not come round
        assert store.lookup(A, keys).hit_blocks == 0
        assert store.put(A, keys, [data(keys[0])]) == 1  # a new life, not a duplicate of the old
        assert store.lookup(A, keys).hit_blocks == 1
        assert store.get(A, keys) == [data(keys[0])]
        assert tier.usage().blocks == 1
        counters = store.stats().counters
        assert counters["retention_expired_blocks"] == 1 and counters.get("put_dedup_blocks", 0) == 0
    finally:
        store.close()


class _FlakyDram(DramTier):
    """A dram tier whose reads of the keys in ``failing`` raise, as a remote tier's do when its
    peer is gone: a read batch stops at that block."""

    failing: frozenset[bytes] = frozenset()

    def get_into(self, key: TierKey, out: memoryview) -> int | None:
        if bytes(key) in self.failing:
            raise TierUnavailable("peer went away")
        return super().get_into(key, out)

    def get_into_many(
        self, keys: Sequence[TierKey], outs: Sequence[memoryview], sizes: list[int | None]
    ) -> None:
        Tier.get_into_many(self, keys, outs, sizes)  # block by block, stopping at a failure


def test_a_read_that_raises_mid_batch_misses_that_block_and_serves_the_rest() -> None:
    tier = _FlakyDram(DramConfig(capacity_bytes=8 * PAGE, page_bytes=PAGE, prefault=False))
    s = TieredStore([tier], clock=FakeClock())
    try:
        keys = chain(5)
        s.put(A, keys, [data(k) for k in keys])
        bad = s._index.visible((s._index.intern(A), keys[2]))
        assert bad is not None
        tier.failing = frozenset([bytes(bad.tkey)])
        outs = [memoryview(bytearray(PAGE)) for _ in keys]
        assert s.get_into_many(A, keys, outs) == [PAGE, PAGE, None, PAGE, PAGE]
        assert all(bytes(outs[i]) == data(keys[i]) for i in (0, 1, 3, 4))
        assert s.tier_of(A, keys[2]) is None  # that copy is gone; the others stay
        assert s.tier_of(A, keys[4]) == tier.name
    finally:
        s.close()


class _HookedDram(DramTier):
    """A dram tier that runs ``during`` once inside its next batched read, before the copies:
    what another thread could do while a restore copies without the store's lock."""

    during: Callable[[], None] | None = None

    def get_into_many(
        self, keys: Sequence[TierKey], outs: Sequence[memoryview], sizes: list[int | None]
    ) -> None:
        during, self.during = self.during, None
        if during is not None:
            during()
        super().get_into_many(keys, outs, sizes)


def test_a_restore_gives_back_its_holds_a_block_deleted_meanwhile_is_freed_a_leased_one_kept() -> None:
    tier = _HookedDram(DramConfig(capacity_bytes=8 * PAGE, page_bytes=PAGE, prefault=False))
    s = TieredStore([tier], clock=FakeClock())
    try:
        keys = chain(4)
        s.put(A, keys, [data(k) for k in keys])
        lease = s.pin(A, keys[3:], ttl_s=30)
        tier.during = lambda: s.delete(A, keys[1:3]) and None  # held by the restore: doomed
        outs = [memoryview(bytearray(PAGE)) for _ in keys]
        assert s.get_into_many(A, keys, outs) == [PAGE] * 4  # doomed blocks keep their bytes till then
        assert all(bytes(outs[i]) == data(keys[i]) for i in range(4))
        assert tier.usage().blocks == 2  # the restore's last hold freed the two deleted blocks
        assert s.lookup(A, keys).hit_blocks == 1  # keys[1] is gone: the prefix ends there
        index = s._index
        pins = [b.pins for k in (keys[0], keys[3]) if (b := index.visible((index.intern(A), k)))]
        assert pins == [0, 1]  # the restore's holds are given back; the lease's stays
        s.release(lease.lease_id)
        assert s.get_into_many(A, keys[3:], outs[3:]) == [PAGE]
    finally:
        s.close()


def test_a_block_larger_than_the_fast_tier_goes_below_without_emptying_it() -> None:
    store = make_store(fast_blocks=4, slow_blocks=8)
    try:
        keys = chain(3)
        store.put(A, keys, [data(k) for k in keys])
        assert where(store, A, keys) == ["hbm"] * 3
        big = chain(1, salt="too big for hbm")
        assert store.put(A, big, [b"\x07" * (5 * PAGE)]) == 1  # hbm holds 4 pages, dram 8
        assert where(store, A, big) == ["dram"]
        assert where(store, A, keys) == ["hbm"] * 3  # nothing in hbm was demoted for it
    finally:
        store.close()
