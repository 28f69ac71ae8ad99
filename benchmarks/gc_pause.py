"""The pause a full garbage collection would impose on a serving process, and what is left of it
once the index is frozen as ``kvstore serve`` does (``kvstore.server.serve.hold_full_collections``).

A full (generation 2) collection walks every object the collector tracks with the GIL held: no
request of any client moves meanwhile. A store's index holds a few tracked objects a block (the
entry, its set of tiers, its id, its eviction entry), so the pause grows with what is stored.
Measured in this process: a store of ``blocks`` tiny blocks put through ``TieredStore.put``, a
full collection timed as CPython would run it, then the same after ``gc.freeze()``.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time

from benchmarks.common import Result
from kvstore.keys import ModelIdentity, block_keys
from kvstore.store import Scope, TieredStore
from tiers.nvme import NvmeConfig, NvmeTier

MODEL = ModelIdentity("bench/gc", "ef" * 32, num_layers=1, num_kv_heads=1, head_dim=16, tokens_per_block=1)
PUT_BLOCKS = 1000  # blocks a put


def _timed_full_collection() -> float:
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start


def bench_gc_pause(blocks: int) -> list[Result]:
    unfrozen, frozen = full_collection_pauses(blocks)
    return [
        Result(
            f"full GC pause, {blocks // 1000}k blocks indexed",
            unfrozen * 1e3,
            "ms",
            note=f"what CPython's default would stop every request for, in this process; "
            f"{frozen * 1e3:.2f} ms after the freeze kvstore serve makes, and it runs no full "
            "collection after start",
        )
    ]


def full_collection_pauses(blocks: int) -> tuple[float, float]:
    """Seconds of a full collection with ``blocks`` blocks indexed, and of the same once frozen."""
    size = MODEL.block_bytes
    folder = tempfile.mkdtemp(prefix="kvs-gc-", dir="/tmp")
    # nvme alone: the index is the same whatever the tier, and LMDB holds tiny blocks tightly
    # where a memory tier would spend a 4 KiB slot on each
    tier = NvmeTier(NvmeConfig(path=folder, capacity_bytes=blocks * size * 4 + (64 << 20)))
    store = TieredStore([tier], persistent=[True])
    try:
        fp = MODEL.fingerprint()
        scope = Scope("t/bench", fp)
        keys = block_keys(fp, list(range(blocks)), 1)
        payload = os.urandom(size)
        for start in range(0, blocks, PUT_BLOCKS):
            part = keys[start : start + PUT_BLOCKS]
            store.put(scope, part, [payload] * len(part), parent=keys[start - 1] if start else None)
        if store.lookup(scope, keys[:64]).hit_blocks != 64:
            raise RuntimeError("the store lost blocks before the collection was timed")
        gc.collect()
        unfrozen = min(_timed_full_collection() for _ in range(3))
        gc.freeze()
        try:
            frozen = min(_timed_full_collection() for _ in range(3))
        finally:
            gc.unfreeze()
    finally:
        store.close()
        shutil.rmtree(folder, ignore_errors=True)
    return unfrozen, frozen


if __name__ == "__main__":
    for r in bench_gc_pause(200_000):
        print(f"{r.metric}: {r.value:.1f} ms; {r.note}")
