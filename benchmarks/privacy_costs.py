"""What sealing remote copies and clearing deleted nvme values cost, alternating rounds, medians printed:

    python -m benchmarks.privacy_costs seal       # remote put/get of one 2 MiB block, Redis Cluster
                                               # (3 masters on 127.0.0.1), plain vs sealed (AES-GCM)
    python -m benchmarks.privacy_costs seal-node  # the same over a kvstore node (kvstore serve)
    python -m benchmarks.privacy_costs wipe   # nvme: put N blocks, then delete them all and flush,
                                           # without vs with zeroing the deleted values in place

Each round runs both variants back to back (order alternating), so machine noise hits both.
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
from kvstore.store.model import Scope, namespace_of_tier_key, tier_key, tier_key_prefix
from tiers.base import TierKey
from tiers.remote import RemoteBlock, RemoteTier

MiB = 1 << 20
FP = Fingerprint(bytes(range(32)))


def _key(i: int, ns: str = "t/bench") -> TierKey:
    return tier_key(Scope(ns, FP), BlockKey(i.to_bytes(32, "big")))


def _median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.2f} ms"


def seal(rounds: int = 40) -> None:
    from benchmarks.redis_cluster import RedisClusterProcess
    from tiers.redis_cluster import RedisClusterTier
    from tiers.remote import RemoteConfig

    with RedisClusterProcess(masters=3) as cluster:
        plain = RedisClusterTier(RemoteConfig(nodes=cluster.nodes, key_prefix="p:"))
        sealed = RedisClusterTier(RemoteConfig(nodes=cluster.nodes, key_prefix="s:"))
        _ab("redis (3 masters, 127.0.0.1)", plain, sealed, rounds)


def seal_node(rounds: int = 40) -> None:
    from benchmarks.server_process import ServerProcess
    from kvstore.remote.nodes import KvStoreNodesTier
    from tiers.remote import RemoteConfig

    settings = {"server.tokens": "tok=bench", "nvme.enabled": "false", "dram.prefault": "false"}
    node = ServerProcess({**settings, "dram.capacity_bytes": "256MiB"}, tcp=True)
    try:
        config = RemoteConfig(nodes=(node.tcp,), tokens={"t/bench": "tok"}, timeout_s=10)
        _ab("kvstore node (127.0.0.1)", KvStoreNodesTier(config), KvStoreNodesTier(config), rounds)
    finally:
        node.stop()


def _ab(label: str, plain: RemoteTier, inner: RemoteTier, rounds: int) -> None:
    """One 2 MiB block put then got per call through ``plain`` and through ``inner`` sealed."""
    from tiers.cipher import BlockCipher
    from tiers.sealed_remote import SealedRemote

    payload = os.urandom(2 * MiB)
    times: dict[str, list[float]] = {f"{v} {op}": [] for v in ("plain", "sealed") for op in ("put", "get")}
    with tempfile.TemporaryDirectory() as keys:
        sealed = SealedRemote(inner, BlockCipher(keys, namespace_of_tier_key))

        def run(name: str, tier: RemoteTier, i: int) -> None:
            key = _key(i if name == "plain" else i + (1 << 20))  # the two never share a key
            t0 = time.perf_counter()
            assert tier.put_many([RemoteBlock(key, FP, payload)]) == 1
            t1 = time.perf_counter()
            got = tier.get_many([key], FP)
            t2 = time.perf_counter()
            assert got[0] is not None and bytes(got[0]) == payload
            times[f"{name} put"].append(t1 - t0)
            times[f"{name} get"].append(t2 - t1)

        try:
            for i in range(rounds):
                order = [("plain", plain), ("sealed", sealed)]
                for name, tier in order if i % 2 else order[::-1]:
                    run(name, tier, i)
        finally:
            for tier in (plain, sealed):
                tier.delete_matching(tier_key_prefix(Scope("t/bench", FP)))
                tier.close()
    print(f"remote tier {label}, one 2 MiB block per call, {rounds} alternating rounds, medians:")
    for name, samples in times.items():
        print(f"  {name:12} {_median_ms(samples)}")


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
    {"seal": seal, "seal-node": seal_node, "wipe": wipe}[sys.argv[1] if len(sys.argv) > 1 else "seal"]()
