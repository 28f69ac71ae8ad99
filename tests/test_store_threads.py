"""The store under threads: puts, restores, pins, deletes and evictions at once, over real
`dram` and `nvme` tiers. Nothing served may differ from what was put."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from kvstore.errors import LeaseExpired, LeaseNotFound, StoreFull
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.store import Scope, StoreConfig, TieredStore
from tiers.dram import DramConfig, DramTier
from tiers.nvme import NvmeConfig, NvmeTier
from tiers.throttle import Throttled

BLOCK = 1 << 15
FP = Fingerprint(b"\x09" * 32)


def data(scope: Scope, key: BlockKey) -> bytes:
    return ((scope.namespace.encode() + key) * (BLOCK // 32 + 1))[:BLOCK]


@pytest.mark.parametrize("deletes", [False, True], ids=["pins-hold", "with-deletes"])
def test_threads_never_see_wrong_bytes(tmp_path: Path, deletes: bool) -> None:
    """Without deletes a pinned block is always served; with them it may vanish (delete wins
    over a pin and the reader recomputes), but never comes back wrong."""
    dram = DramTier(DramConfig(capacity_bytes=12 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=24 * BLOCK))
    store = TieredStore([dram, nvme], StoreConfig(lease_ttl_s=0.05))
    chains = {c: block_keys(FP, list(range(c * 1000, c * 1000 + 24)), 4) for c in range(6)}
    errors: list[str] = []
    served = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        scope = Scope(f"tenant-{seed % 2}", FP)
        buf = memoryview(bytearray(BLOCK))
        for _ in range(300):
            keys = chains[rng.randrange(len(chains))]
            op = rng.random()
            try:
                if op < 0.35:
                    store.put(scope, keys, [data(scope, k) for k in keys])
                elif op < 0.75:
                    hit = store.lookup(scope, keys, pin_ttl_s=1.0)
                    for key in keys[: hit.hit_blocks]:
                        n = store.get_into(scope, key, buf)
                        if n is None:
                            if not deletes:
                                errors.append("a pinned block vanished")
                        elif buf[:n] != data(scope, key):
                            errors.append("wrong bytes served")
                        else:
                            served[0] += 1
                    if hit.lease is not None:
                        store.release(hit.lease.lease_id)
                elif op < 0.8:
                    resolved = store.resolve(scope, keys)  # promotes from nvme outside the lock
                    arena = store.arena
                    assert arena is not None
                    for key, slot in zip(keys, resolved.slots, strict=False):
                        if arena.arena.view[slot.offset : slot.offset + slot.size_bytes] != data(scope, key):
                            errors.append("wrong bytes resolved")
                        else:
                            served[0] += 1
                    if resolved.lease is not None:
                        store.release(resolved.lease.lease_id)
                elif op < 0.85 and deletes:
                    store.delete(scope, keys[rng.randrange(len(keys)) :])
                elif op < 0.95:
                    store.pin(scope, keys, ttl_s=0.01)
                elif deletes:
                    store.invalidate(namespace=scope.namespace)
            except (StoreFull, LeaseExpired, LeaseNotFound):
                pass  # everything pinned, or a lease outlived by a slow thread: allowed
            except Exception as exc:  # noqa: BLE001 - anything else fails the test, not just this thread
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stats = store.stats()
    store.close()
    assert not errors, errors[:5]
    assert served[0] > 100
    for usage in stats.tiers:
        assert usage.used_bytes <= usage.capacity_bytes


def _slow_nvme_store(tmp_path: Path, seconds_per_block: float) -> tuple[TieredStore, list[BlockKey]]:
    """A store whose nvme serves a block in ``seconds_per_block``, holding a chain only there."""
    dram = DramTier(DramConfig(capacity_bytes=8 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=16 * BLOCK))
    # No cleaner: the tests time promotions, which a block it holds for a copy would slow.
    store = TieredStore([dram, Throttled(nvme, BLOCK / seconds_per_block)], StoreConfig(clean_ahead=0))
    keys = block_keys(FP, list(range(32)), 4)  # 8 blocks
    store.put(A, keys, [data(A, k) for k in keys])
    assert store.demote("dram") == len(keys)
    return store, keys


A = Scope("tenant-a", FP)


def test_a_slow_promotion_does_not_block_lookups(tmp_path: Path) -> None:
    """resolve copies an nvme block into the arena outside the store lock: while one reader
    waits on a slow medium, another's lookup is answered at once."""
    store, keys = _slow_nvme_store(tmp_path, seconds_per_block=0.5)
    try:
        took: list[float] = []

        def slow_reader() -> None:
            start = time.perf_counter()
            resolved = store.resolve(A, keys[:1])
            took.append(time.perf_counter() - start)
            assert resolved.lease is not None and len(resolved.slots) == 1
            store.release(resolved.lease.lease_id)

        reader = threading.Thread(target=slow_reader)
        reader.start()
        time.sleep(0.1)  # the reader is inside its copy now
        start = time.perf_counter()
        assert store.lookup(A, keys).hit_blocks == len(keys)
        lookup_s = time.perf_counter() - start
        reader.join(10)
        assert took and took[0] >= 0.5  # the copy did take its time
        assert lookup_s < 0.2, f"a lookup waited {lookup_s:.3f} s behind a promotion"
        assert store.tier_of(A, keys[0]) == "dram"
    finally:
        store.close()


def test_two_resolves_of_one_slow_block_both_get_it(tmp_path: Path) -> None:
    """The second resolve waits for the first one's promotion instead of missing."""
    store, keys = _slow_nvme_store(tmp_path, seconds_per_block=0.2)
    try:
        got: list[int] = []

        def reader() -> None:
            resolved = store.resolve(A, keys[:3])
            got.append(len(resolved.slots))
            if resolved.lease is not None:
                store.release(resolved.lease.lease_id)

        readers = [threading.Thread(target=reader) for _ in range(2)]
        for r in readers:
            r.start()
        for r in readers:
            r.join(20)
        assert got == [3, 3]
        assert store.stats().counters["promotions"] == 3  # each block copied once
    finally:
        store.close()
