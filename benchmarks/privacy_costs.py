"""What clearing deleted nvme values costs, alternating rounds, medians printed:

    python -m benchmarks.privacy_costs wipe   # nvme: put N blocks, then delete them all and flush,
                                           # without vs with zeroing the deleted values in place

Each round runs both variants back to back (order alternating), so machine noise hits both.
What sealing costs is measured by ``benchmarks.sealed_costs`` (rows of bench service and fleet).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.keys import BlockKey, Fingerprint
from kvstore.store.model import Scope, tier_key
from tiers.base import TierKey

MiB = 1 << 20
FP = Fingerprint(bytes(range(32)))


def _key(i: int, ns: str = "t/bench") -> TierKey:
    return tier_key(Scope(ns, FP), BlockKey(i.to_bytes(32, "big")))


def _median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.2f} ms"


def wipe(rounds: int = 8, blocks: int = 256, size: int = 256 * 1024) -> None:
    from tiers.nvme import NvmeConfig, NvmeTier
    from tiers.nvme_wipe import Wiper

    real = Wiper.freed
    payload = os.urandom(size)
    times: dict[str, list[float]] = {"without": [], "with": []}
    puts: list[float] = []  # the same blocks' put + flush, for scale

    def run(name: str, fn: Callable[..., bool]) -> None:
        Wiper.freed = fn  # type: ignore[method-assign]
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_BENCH_DIR")) as folder:
            tier = NvmeTier(NvmeConfig(path=str(Path(folder) / "nvme"), capacity_bytes=2 * blocks * size))
            try:
                keys = [_key(i) for i in range(blocks)]
                t0 = time.perf_counter()
                for key in keys:
                    tier.put(key, payload, FP)
                tier.flush()
                puts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for key in keys:
                    tier.delete(key)
                tier.flush()
                times[name].append(time.perf_counter() - t0)
            finally:
                tier.close()

    try:
        for i in range(rounds):
            order: list[tuple[str, Callable[..., bool]]] = [("without", lambda *a: False), ("with", real)]
            for name, fn in order if i % 2 else order[::-1]:
                run(name, fn)
    finally:
        Wiper.freed = real  # type: ignore[method-assign]
    mib = blocks * size / MiB
    print(
        f"nvme delete of {blocks} blocks of {size // 1024} KiB ({mib:.0f} MiB) + flush, {rounds} rounds, medians:"
    )
    print(f"  (their put + flush: {_median_ms(puts)})")
    for name, samples in times.items():
        med = statistics.median(samples)
        print(f"  {name:8} wipe: {med * 1e3:.1f} ms ({blocks / med:,.0f} deletes/s, {mib / med:,.0f} MiB/s)")


if __name__ == "__main__":
    {"wipe": wipe}[sys.argv[1] if len(sys.argv) > 1 else "wipe"]()
