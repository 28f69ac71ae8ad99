"""The store under threads: puts, restores, pins, deletes and evictions at once, over real
`dram` and `nvme` tiers. Nothing served may differ from what was put."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from kvstore.errors import LeaseExpired, LeaseNotFound, StoreFull
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.store import Scope, StoreConfig, TieredStore
from tiers.dram import DramConfig, DramTier
from tiers.nvme import NvmeConfig, NvmeTier

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
                elif op < 0.85 and deletes:
                    store.delete(scope, keys[rng.randrange(len(keys)) :])
                elif op < 0.95:
                    store.pin(scope, keys, ttl_s=0.01)
                elif deletes:
                    store.invalidate(namespace=scope.namespace)
            except (StoreFull, LeaseExpired, LeaseNotFound):
                pass  # everything pinned, or a lease outlived by a slow thread: allowed

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
