"""What encryption costs, as rows of ``kvstore bench service`` and ``kvstore bench fleet``: each
sealed figure against the same plain one measured in the same run, rounds alternating, medians.

- ``nvme_rows`` (bench service): remote put and get of 2 MiB blocks through a server whose
  blocks live in nvme (a small arena, no promotion), with ``nvme.encryption_keys_dir`` (AES-GCM
  at rest) against the same server without it;
- ``remote_tier_rows`` (bench fleet): the fleet's remote tier, put and get of 2 MiB blocks, sealed
  (``tiers.sealed_remote``: what a sidecar with encryption on sends) against plain, over a Redis
  Cluster (3 masters) and a kvstore node.

``python -m benchmarks.sealed_costs [--quick]`` prints both sets alone.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import Result
from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import BlockKey, Fingerprint, ModelIdentity
from kvstore.server.builder import build_remote
from kvstore.server.config import load_settings
from kvstore.store.model import Scope, namespace_of_tier_key, tier_key
from tiers.base import TierKey
from tiers.remote import RemoteBlock, RemoteTier

MiB = 1 << 20
BLOCK = 2 * MiB
TOKEN = "sealed-bench"
MODEL = ModelIdentity(
    "bench/sealed", "00" * 32, num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16
)


def _alternating(calls: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The median seconds of each call, the order alternating round by round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for i in range(rounds):
        for name, call in order if i % 2 else order[::-1]:
            times[name].append(call())
    return {name: statistics.median(t) for name, t in times.items()}


def _rows(what: str, total: int, medians: dict[str, float], note: str) -> list[Result]:
    return [
        Result(
            f"{what} {op}, sealed",
            total / medians[f"sealed {op}"] / 1e9,
            "GB/s",
            "plain, same run",
            total / medians[f"plain {op}"] / 1e9,
            None,
            note,
        )
        for op in ("put", "get")
    ]


def nvme_rows(count: int, rounds: int) -> list[Result]:
    """Remote put/get of ``count`` 2 MiB blocks a round, nvme encrypted at rest against plain."""
    keys_dir = Path(tempfile.mkdtemp(prefix="kvk-", dir="/tmp"))
    settings = {
        "dram.capacity_bytes": str(16 * BLOCK),  # one page: the blocks live in nvme
        "dram.prefault": "false",
        "store.promote_on_hit": "false",
        "nvme.capacity_bytes": "4GiB",
        "server.tokens": f"{TOKEN}=bench",
        "server.max_message_bytes": "64MiB",
    }
    plain = ServerProcess(settings, tcp=True)
    sealed = ServerProcess({**settings, "nvme.encryption_keys_dir": str(keys_dir)}, tcp=True)
    try:
        with connect(plain.tcp, token=TOKEN) as kv_plain, connect(sealed.tcp, token=TOKEN) as kv_sealed:
            blocks = [os.urandom(BLOCK) for _ in range(count)]
            outs = [memoryview(bytearray(BLOCK)) for _ in range(count)]
            served = {"plain": kv_plain, "sealed": kv_sealed}
            fps = {name: kv.register(MODEL) for name, kv in served.items()}

            def put(name: str) -> Callable[[], float]:
                def run() -> float:
                    keys = [BlockKey(os.urandom(32)) for _ in range(count)]
                    t0 = time.perf_counter()
                    assert served[name].put(fps[name], keys, blocks) == count
                    return time.perf_counter() - t0

                return run

            got = [BlockKey(os.urandom(32)) for _ in range(count)]
            for name, kv in served.items():
                assert kv.put(fps[name], got, blocks) == count
            time.sleep(1.0)  # the nvme writer catches up
            # what both hold (an overflowing arena may drop a block its disk has not written yet)
            n = min(kv.lookup(fps[name], got) for name, kv in served.items())
            if n < count // 2:
                raise RuntimeError(f"only {n} of {count} blocks stayed: no nvme figure")

            def get(name: str) -> Callable[[], float]:
                def run() -> float:
                    t0 = time.perf_counter()
                    for i in range(0, n, 8):  # a get answers a bounded share of a big batch
                        j = min(n, i + 8)
                        assert served[name].get_into(fps[name], got[i:j], outs[i:j]) == j - i
                    return time.perf_counter() - t0

                return run

            get("plain")(), get("sealed")()  # warm up both
            medians = _alternating(
                {
                    f"{v} {op}": (put if op == "put" else get)(v)
                    for v in ("plain", "sealed")
                    for op in ("put", "get")
                },
                rounds,
            )
            assert bytes(outs[n - 1]) == blocks[n - 1]
    finally:
        plain.stop()
        sealed.stop()
        for path in keys_dir.iterdir():
            path.unlink()
        keys_dir.rmdir()
    note = (
        f"put {count}, get {n} blocks of 2 MiB a round over TCP, from nvme (32 MiB arena, no promotion);"
        " AES-256-GCM at rest"
    )
    return [
        *_rows("remote 2 MiB, nvme", count * BLOCK, medians, note)[:1],
        *_rows("remote 2 MiB, nvme", n * BLOCK, medians, note)[1:],
    ]


def remote_tier_rows(count: int, rounds: int) -> list[Result]:
    """The remote tier's put/get of ``count`` 2 MiB blocks, sealed against plain, on Redis
    Cluster and on a kvstore node."""
    from benchmarks.redis_cluster import RedisClusterProcess

    rows: list[Result] = []
    with RedisClusterProcess(masters=3) as cluster:
        redis = {"backend": "redis", "nodes": ",".join(cluster.nodes), "timeout_s": "10"}
        rows += _tier_rows("redis tier", redis, count, rounds, "3 masters on 127.0.0.1")
    node = ServerProcess(
        {
            "server.tokens": f"{TOKEN}=bench",
            "nvme.enabled": "false",
            "dram.prefault": "false",
            "dram.capacity_bytes": str(4 * count * BLOCK + 64 * MiB),
            "server.max_message_bytes": "64MiB",
        },
        tcp=True,
    )
    try:
        kvstore = {"backend": "kvstore", "nodes": node.tcp, "tokens": f"t/bench={TOKEN}", "timeout_s": "10"}
        rows += _tier_rows("kvstore tier", kvstore, count, rounds, "one kvstore node on 127.0.0.1, data port")
    finally:
        node.stop()
    return rows


def _tier(remote: dict[str, str]) -> RemoteTier:
    settings = {"data_dir": tempfile.gettempdir(), **{f"remote.{k}": v for k, v in remote.items()}}
    tier = build_remote(load_settings(env={}, overrides=settings))
    assert tier is not None
    return tier


def _tier_rows(what: str, remote: dict[str, str], count: int, rounds: int, where: str) -> list[Result]:
    from tiers.cipher import BlockCipher
    from tiers.sealed_remote import SealedRemote

    fp = Fingerprint(bytes(range(32)))
    scope = Scope("t/bench", fp)
    payloads = [os.urandom(BLOCK) for _ in range(count)]
    with tempfile.TemporaryDirectory() as keys_dir:
        tiers = {
            "plain": _tier(remote),
            "sealed": SealedRemote(_tier(remote), BlockCipher(keys_dir, namespace_of_tier_key)),
        }
        written: dict[str, list[TierKey]] = {"plain": [], "sealed": []}

        def put(name: str) -> Callable[[], float]:
            def run() -> float:
                keys = [tier_key(scope, BlockKey(os.urandom(32))) for _ in range(count)]
                blocks = [RemoteBlock(k, fp, p, time.time()) for k, p in zip(keys, payloads, strict=True)]
                t0 = time.perf_counter()
                assert tiers[name].put_many(blocks) == count
                elapsed = time.perf_counter() - t0
                written[name] = keys
                return elapsed

            return run

        def get(name: str) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                got = tiers[name].get_many(written[name], fp)
                elapsed = time.perf_counter() - t0
                assert all(g is not None for g in got)
                return elapsed

            return run

        try:
            put("plain")(), put("sealed")()  # warm up, and something to get
            calls: dict[str, Callable[[], float]] = {}
            for v in ("plain", "sealed"):
                calls[f"{v} put"], calls[f"{v} get"] = put(v), get(v)
            medians = _alternating(calls, rounds)
        finally:
            for tier in tiers.values():
                tier.delete_matching(bytes([len(b"t/bench")]) + b"t/bench")
                tier.close()
    note = f"{count} blocks of 2 MiB a call, pipelined; {where}; sealed: AES-256-GCM under the tenant's key"
    return _rows(what, count * BLOCK, medians, note)


def main() -> None:
    """``python -m benchmarks.sealed_costs [--quick]``: the rows as the full (or quick) bench service
    and bench fleet runs measure them."""
    import sys

    from benchmarks.common import print_results

    quick = "--quick" in sys.argv
    rows = nvme_rows(64, 5 if quick else 9)
    rows += remote_tier_rows(count=8 if quick else 32, rounds=3 if quick else 7)
    print_results(f"encryption's cost{' --quick' if quick else ''}", rows)


if __name__ == "__main__":
    main()
