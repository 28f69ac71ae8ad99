"""The store over a remote tier (``kvstore/store/remote.py``): two stores, as two sidecars of a
fleet, sharing one real three-master Redis Cluster. What one stores, the other finds (as tier
``remote``), reads through into its own dram and serves; deletion and invalidation reach the
shared copies; a full queue drops; a dead cluster costs misses, never errors."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from benchmarks.redis_cluster import RedisClusterProcess
from kvstore.store import Scope, StoreConfig, TieredStore
from kvstore.store.model import shared_key_name
from tests.test_store_restart import BLOCK, FP, chain, data
from tiers.dram import DramConfig, DramTier
from tiers.redis_cluster import RedisClusterTier
from tiers.remote import RemoteConfig, RemoteTier

A = Scope("t/tenant-a", FP)
B = Scope("t/tenant-b", FP)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcess]:
    with RedisClusterProcess(masters=3) as c:
        yield c


def sidecar(remote: RemoteTier, dram_blocks: int = 32, queue_bytes: int = 64 * BLOCK) -> TieredStore:
    dram = DramTier(DramConfig(capacity_bytes=dram_blocks * BLOCK, page_bytes=BLOCK, prefault=False))
    return TieredStore([dram], StoreConfig(), remote=remote, remote_queue_bytes=queue_bytes)


@pytest.fixture
def pair(cluster: RedisClusterProcess) -> Iterator[tuple[TieredStore, TieredStore]]:
    prefix = f"s{time.monotonic_ns()}:"  # each test its own keys on the shared cluster
    one = sidecar(
        RedisClusterTier(RemoteConfig(nodes=cluster.nodes, key_prefix=prefix), key_name=shared_key_name)
    )
    two = sidecar(
        RedisClusterTier(RemoteConfig(nodes=cluster.nodes, key_prefix=prefix), key_name=shared_key_name)
    )
    yield one, two
    one.close()
    two.close()


def sent(store: TieredStore) -> None:
    assert store._remote is not None and store._remote.drain(10)


def test_a_prefix_stored_by_one_sidecar_is_found_and_served_by_another(
    pair: tuple[TieredStore, TieredStore],
) -> None:
    one, two = pair
    keys = chain(6, "shared")
    # sidecar one stores 6 blocks -> they go to dram and, behind, to the cluster
    assert one.put(A, keys, [data(k) for k in keys]) == 6
    sent(one)
    assert one.stats().counters["remote_stored_blocks"] == 6
    # sidecar two has none locally: its lookup finds them remote, in order
    found = two.lookup(A, keys)
    assert (found.hit_blocks, found.tiers) == (6, ("remote",) * 6)
    # a restore reads them through into two's dram and serves them
    assert two.get(A, keys) == [data(k) for k in keys]
    stats = two.stats().counters
    assert stats["remote_filled_blocks"] == 6
    assert stats.get("remote_queued_blocks", 0) == 0  # read-through blocks are not sent back
    assert two.lookup(A, keys).tiers == ("dram",) * 6
    # a longer prompt: the local prefix, then the remote continuation, then the miss
    longer = chain(8, "shared")
    assert one.put(A, longer[6:], [data(k) for k in longer[6:]], parent=longer[5]) == 2
    sent(one)
    assert two.lookup(A, chain(9, "shared")).tiers == ("dram",) * 6 + ("remote",) * 2


def test_the_arena_restore_reads_through_too(pair: tuple[TieredStore, TieredStore]) -> None:
    one, two = pair
    keys = chain(4, "arena")
    one.put(A, keys, [data(k) for k in keys])
    sent(one)
    resolved = two.resolve(A, keys, ttl_s=5)
    assert len(resolved.slots) == 4 and resolved.lease is not None
    arena = two.tiers[0].as_arena()
    assert arena is not None
    assert [bytes(arena.slot_view(s)) for s in resolved.slots] == [data(k) for k in keys]
    two.release(resolved.lease.lease_id)


def test_tenants_do_not_see_each_others_blocks_through_the_shared_store(
    pair: tuple[TieredStore, TieredStore],
) -> None:
    one, two = pair
    keys = chain(3, "private")
    one.put(A, keys, [data(k) for k in keys])
    sent(one)
    assert two.lookup(B, keys).hit_blocks == 0  # the same prompt, another tenant: no hit
    assert two.get(B, keys) == [None, None, None]


def test_deletion_and_invalidation_reach_the_shared_copies(pair: tuple[TieredStore, TieredStore]) -> None:
    one, two = pair
    keys = chain(5, "gone")
    one.put(A, keys, [data(k) for k in keys])
    other = chain(2, "stays")
    one.put(B, other, [data(k) for k in other])
    sent(one)
    assert two.lookup(A, keys).hit_blocks == 5
    one.delete(A, keys[3:])
    assert two.lookup(A, keys).hit_blocks == 3
    one.invalidate("t/tenant-a", FP)
    assert two.lookup(A, keys).hit_blocks == 0
    assert two.lookup(B, other).hit_blocks == 2  # another namespace: untouched
    one.invalidate(None, FP)  # one fingerprint in every namespace this sidecar knows
    assert two.lookup(B, other).hit_blocks == 0


def test_a_full_queue_drops_and_counts_and_never_blocks_a_put(cluster: RedisClusterProcess) -> None:
    store = sidecar(
        RedisClusterTier(RemoteConfig(nodes=cluster.nodes, key_prefix="q:")),
        dram_blocks=96,
        queue_bytes=2 * BLOCK,
    )
    try:
        for i in range(20):
            keys = chain(4, f"burst{i}")
            assert store.put(A, keys, [data(k) for k in keys]) == 4  # stored locally, always
        sent(store)
        counters = store.stats().counters
        assert counters["remote_dropped_blocks"] > 0
        assert counters["remote_queued_blocks"] + counters["remote_dropped_blocks"] == 80
        assert counters["remote_stored_blocks"] == counters["remote_queued_blocks"]
        assert counters["remote_handled_blocks"] == counters["remote_queued_blocks"]  # drained
    finally:
        store.close()


def test_a_dead_shared_store_means_local_hits_and_misses_never_errors() -> None:
    with RedisClusterProcess(masters=3) as doomed:
        store = sidecar(RedisClusterTier(RemoteConfig(nodes=doomed.nodes, timeout_s=0.3, backoff_s=30.0)))
        try:
            keys = chain(4, "local")
            store.put(A, keys, [data(k) for k in keys])
            sent(store)
            doomed.stop_all()
            more = chain(6, "local")
            assert store.lookup(A, more).tiers == ("dram",) * 4  # the remote part reads as a miss
            assert store.get(A, more)[:4] == [data(k) for k in keys]
            assert store.put(A, more[4:], [data(k) for k in more[4:]], parent=more[3]) == 2
            sent(store)
            counters = store.stats().counters
            assert counters["remote_failures"] >= 1 and counters["remote_nodes_down"] == 1
        finally:
            store.close()


def test_a_block_read_through_keeps_its_birth_and_leaves_on_time(cluster: RedisClusterProcess) -> None:
    """Retention 2 s: a chain stored by one at t0 and read through into two at t0 + 1 is gone
    from two's dram by the sweep at t0 + 2.1 (counted), though two stored a chain of its own
    at t0 + 0.5 that is still due later: the read-through block took its place in the sweep's
    order by its birth, not at the back of the queue (where it would wait for that chain)."""
    prefix = f"s{time.monotonic_ns()}:"
    config = StoreConfig(retention_s={A.namespace: 2.0})

    def retained() -> TieredStore:
        dram = DramTier(DramConfig(capacity_bytes=32 * BLOCK, page_bytes=BLOCK, prefault=False))
        remote = RedisClusterTier(
            RemoteConfig(nodes=cluster.nodes, key_prefix=prefix), key_name=shared_key_name
        )
        return TieredStore([dram], config, remote=remote, remote_queue_bytes=64 * BLOCK)

    one, two = retained(), retained()
    try:
        early, own = chain(3, "born-early"), chain(2, "born-later")
        t0 = time.time()
        assert one.put(A, early, [data(k) for k in early]) == 3
        sent(one)
        time.sleep(max(0.0, t0 + 0.5 - time.time()))
        assert two.put(A, own, [data(k) for k in own]) == 2
        time.sleep(max(0.0, t0 + 1.0 - time.time()))
        assert two.get(A, early) == [data(k) for k in early]  # read through, born at t0; a sweep
        assert two.lookup(A, early).tiers == ("dram",) * 3
        time.sleep(max(0.0, t0 + 2.1 - time.time()))  # the next sweep may come 1 s after
        assert two.put(A, chain(1, "sweeper"), [data(chain(1, "sweeper")[0])]) == 1  # the sweep's turn
        assert time.time() < t0 + 2.5, "too slow a machine: the later chain expired too"
        assert two.stats().counters["retention_expired_blocks"] == 3
        assert two.tiers[0].usage().blocks == 3  # own's 2 and the sweeper: early's 3 are gone
    finally:
        one.close()
        two.close()
