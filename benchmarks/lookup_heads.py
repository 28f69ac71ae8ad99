"""What a lookup past the local prefix costs now that it promises only what a restore would take
(``RemoteTier.heads``: birth, fingerprint and, sealed, the key id checked) against the bare
existence check it replaced (``contains``), alternating rounds, medians printed:

    python -m benchmarks.lookup_heads [--keys 64] [--block-kib 256] [--rounds 30]

over a Redis Cluster (3 masters on 127.0.0.1; ``heads`` is one pipelined GETRANGE) and a kvstore
node (``kvstore serve``; ``heads`` is its data port's head request when a cutoff (retention, an
invalidation) or a sealed key id must be checked, and is ``contains`` otherwise: the "no cutoff"
row). "whole values" is the contract's default ``heads`` over the same tier (each value read
whole): what a kvstore node's lookup did before it had a head request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from kvstore.keys import BlockKey, Fingerprint
from kvstore.server.builder import build_remote
from kvstore.server.config import load_settings
from kvstore.store.model import Scope, namespace_of_tier_key, tier_key
from tiers.remote import RemoteBlock, RemoteTier

FP = Fingerprint(bytes(range(32)))
NAMESPACE = "t/bench"


def _tier(remote: dict[str, str]) -> RemoteTier:
    settings = {"data_dir": tempfile.gettempdir(), **{f"remote.{k}": v for k, v in remote.items()}}
    tier = build_remote(load_settings(env={}, overrides=settings))
    assert tier is not None
    return tier


def measure(label: str, remote: dict[str, str], keys: int, block: int, rounds: int) -> None:
    from tiers.cipher import BlockCipher
    from tiers.sealed_remote import SealedRemote

    scope = Scope(NAMESPACE, FP)
    plain_keys = [tier_key(scope, BlockKey(i.to_bytes(32, "big"))) for i in range(keys)]
    sealed_keys = [tier_key(scope, BlockKey((i + keys).to_bytes(32, "big"))) for i in range(keys)]
    payload = os.urandom(block)
    with tempfile.TemporaryDirectory() as keys_dir:
        plain = _tier(remote)
        sealed = SealedRemote(_tier(remote), BlockCipher(keys_dir, namespace_of_tier_key))
        now = time.time()
        assert plain.put_many([RemoteBlock(k, FP, payload, now) for k in plain_keys]) == keys
        assert sealed.put_many([RemoteBlock(k, FP, payload, now) for k in sealed_keys]) == keys
        calls: dict[str, Callable[[], list[bool]]] = {
            "contains (before)": lambda: plain.contains(plain_keys),
            "heads, no cutoff": lambda: [h is not None for h in plain.heads(plain_keys, FP)],
            "heads, plain": lambda: [h is not None for h in plain.heads(plain_keys, FP, now - 60)],
            "heads, sealed": lambda: [h is not None for h in sealed.heads(sealed_keys, FP, now - 60)],
            "whole values": lambda: [
                h is not None for h in RemoteTier.heads(plain, plain_keys, FP, now - 60)
            ],
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        try:
            for i in range(rounds):
                order = list(calls.items())
                for name, call in order[i % len(order) :] + order[: i % len(order)]:
                    t0 = time.perf_counter()
                    assert call() == [True] * keys
                    times[name].append(time.perf_counter() - t0)
        finally:
            plain.delete_many(plain_keys + sealed_keys)
            plain.close()
            sealed.close()
    base = statistics.median(times["contains (before)"])
    print(f"{label}: {keys} keys of {block >> 10} KiB, {rounds} rounds (order rotating), medians:")
    for name, samples in times.items():
        m = statistics.median(samples)
        print(f"  {name:18} {m * 1e3:8.2f} ms  {m / base:6.2f}x")


def main() -> None:
    from benchmarks.redis_cluster import RedisClusterProcess
    from benchmarks.server_process import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    a = parser.parse_args()
    block = a.block_kib << 10
    with RedisClusterProcess(masters=3) as cluster:
        redis = {"backend": "redis", "nodes": ",".join(cluster.nodes), "key_prefix": "lh:"}
        measure("redis (3 masters, 127.0.0.1)", redis, a.keys, block, a.rounds)
    settings = {"server.tokens": "tok=bench", "nvme.enabled": "false", "dram.prefault": "false"}
    node = ServerProcess({**settings, "dram.capacity_bytes": "256MiB"}, tcp=True)
    try:
        kvstore = {"backend": "kvstore", "nodes": node.tcp, "tokens": f"{NAMESPACE}=tok", "timeout_s": "10"}
        measure("kvstore node (127.0.0.1)", kvstore, a.keys, block, a.rounds)
    finally:
        node.stop()


if __name__ == "__main__":
    main()
