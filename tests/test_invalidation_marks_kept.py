"""A shared kvstore node keeps the fleet's invalidation marks and ledger entries (blocks under
``MARK_FINGERPRINT``): a full store evicts other blocks instead, a tenant's quota drops its own
blocks instead, and its retention does not expire them. A mark the node let go would make every
sidecar that was down miss an invalidation, or (with the ledger) drop its copies for nothing."""

from __future__ import annotations

from kvstore.keys import Fingerprint
from kvstore.store import Scope, StoreConfig, TieredStore
from kvstore.store.model import MARK_FINGERPRINT
from tests.test_store_eviction import SIZE, FakeClock, key
from tiers.dram import DramConfig, DramTier

NS = "t/tenant-a"


def test_marks_outlive_eviction_quota_and_retention_on_a_node() -> None:
    wall = FakeClock()
    tier = DramTier(DramConfig(capacity_bytes=8 * SIZE, page_bytes=SIZE, prefault=False))
    config = StoreConfig(retention_s={NS: 10.0}, quota_bytes={NS: 4 * SIZE})
    store = TieredStore([tier], config, wall_clock=wall)
    marks, blocks = Scope(NS, MARK_FINGERPRINT), Scope(NS, Fingerprint(b"\x05" * 32))
    try:
        assert store.put(marks, [key(0)], [b"\x01" * SIZE]) == 1
        for i in range(1, 20):  # past the tenant's quota (4 blocks) many times
            store.put(blocks, [key(i)], [bytes([i]) * SIZE])
        assert store.lookup(marks, [key(0)]).hit_blocks == 1
        other = Scope("t/tenant-b", Fingerprint(b"\x06" * 32))
        for i in range(1, 20):  # past the store (8 blocks) many times
            store.put(other, [key(i)], [bytes([i]) * SIZE])
        assert store.lookup(marks, [key(0)]).hit_blocks == 1
        counters = store.stats().counters
        assert counters["quota_evictions"] > 0 and counters["evicted_dram_blocks"] > 0
        assert store.lookup(blocks, [key(1)]).hit_blocks == 0  # the tenant's oldest went
        wall.now += 11  # past the namespace's retention
        assert store.lookup(blocks, [key(19)]).hit_blocks == 0
        assert store.lookup(marks, [key(0)]).hit_blocks == 1
    finally:
        store.close()
