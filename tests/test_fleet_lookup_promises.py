"""A lookup promises no remote copy a restore would refuse, on real processes: a sidecar (a real
``kvstore serve`` with a retention and encryption on) over a real shared kvstore node and over a
real Redis Cluster. Copies are planted there as a lagging or foreign sidecar would leave them,
through the same remote tier code: one born before the retention, one born before the scope's
last invalidation, one sealed under another key folder's key, and a good one. For each, the
sidecar's lookup reports exactly as many blocks as its restore then gets: 0, 0, 0 and 4 (the
lookup used to say ``remote`` for all four, and the restore got nothing for the first three)."""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.redis_cluster import RedisClusterProcess
from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import BlockKey
from kvstore.server.builder import build_remote
from kvstore.server.config import load_settings
from kvstore.store.model import Scope, namespace_of_tier_key, tier_key
from tests.service_fixtures import MODEL, chain, process_settings
from tiers.cipher import BlockCipher
from tiers.remote import RemoteBlock, RemoteTier
from tiers.sealed_remote import SealedRemote

RETENTION_S = 600.0
NAMESPACE = "t/local"  # the sidecar's Unix callers


@pytest.fixture(scope="module")
def node() -> Iterator[ServerProcess]:
    node = ServerProcess(process_settings(), tcp=True)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcess]:
    with RedisClusterProcess(masters=3) as c:
        yield c


@pytest.fixture(params=["kvstore", "redis"])
def remote(request: pytest.FixtureRequest) -> dict[str, str]:
    if request.param == "kvstore":
        node: ServerProcess = request.getfixturevalue("node")
        return {"remote.backend": "kvstore", "remote.nodes": node.tcp, "remote.tokens": f"{NAMESPACE}=tok-a"}
    cluster: RedisClusterProcess = request.getfixturevalue("cluster")
    return {
        "remote.backend": "redis",
        "remote.nodes": ",".join(cluster.nodes),
        "remote.key_prefix": f"p{time.monotonic_ns()}:",
    }


def planter(remote: dict[str, str], keys_dir: Path) -> RemoteTier:
    """The sidecars' own remote tier code, sealing under the keys in ``keys_dir``."""
    tier = build_remote(load_settings(env={}, overrides=process_settings(**remote)))
    assert tier is not None
    return SealedRemote(tier, BlockCipher(keys_dir, namespace_of_tier_key))


def blocks_for(keys: list[BlockKey]) -> list[bytes]:
    """Each key's block, the same every time it is asked for."""
    return [hashlib.shake_256(bytes(k)).digest(MODEL.block_bytes) for k in keys]


def plant(tier: RemoteTier, keys: list[BlockKey], born_s: float) -> None:
    scope = Scope(NAMESPACE, MODEL.fingerprint())
    blocks = [
        RemoteBlock(tier_key(scope, k), scope.fingerprint, b, born_s)
        for k, b in zip(keys, blocks_for(keys), strict=True)
    ]
    assert tier.put_many(blocks) == len(keys)


def promised_and_restored(sidecar: ServerProcess, keys: list[BlockKey]) -> tuple[int, tuple[str, ...], int]:
    with connect(sidecar.unix) as kv:
        fp = kv.register(MODEL)
        found = kv.lookup_tiers(fp, keys)
        blocks = blocks_for(keys)
        outs = [memoryview(bytearray(len(b))) for b in blocks]
        n = kv.read_into(fp, keys, outs)
        assert [bytes(o) for o in outs[:n]] == blocks[:n]
        return found.hit_blocks, found.tiers, n


def test_a_lookup_promises_no_remote_copy_a_restore_would_refuse(remote: dict[str, str]) -> None:
    keys_dir = Path(tempfile.mkdtemp(prefix="kvk-", dir="/tmp"))  # the sidecar's keys
    foreign_dir = Path(tempfile.mkdtemp(prefix="kvk-", dir="/tmp"))  # another fleet's
    ours, foreign = planter(remote, keys_dir), planter(remote, foreign_dir)
    settings = {
        **remote,
        "store.default_retention_s": str(RETENTION_S),
        "nvme.encryption_keys_dir": str(keys_dir),
    }
    sidecar = ServerProcess(process_settings(**settings))
    try:
        # the sidecar invalidates the model; a lagging sidecar's copy born before it comes later
        with connect(sidecar.unix) as kv:
            kv.invalidate(kv.register(MODEL))
        now = time.time()
        good, expired = chain(4, "promise-good"), chain(4, "promise-expired")
        invalidated, unopenable = chain(4, "promise-invalidated"), chain(4, "promise-foreign-key")
        plant(ours, good, now)
        plant(ours, expired, now - RETENTION_S - 60)
        plant(ours, invalidated, now - 30)
        plant(foreign, unopenable, now)

        refused = [promised_and_restored(sidecar, keys) for keys in (expired, invalidated, unopenable)]
        assert refused == [(0, (), 0)] * 3
        assert promised_and_restored(sidecar, good) == (4, ("remote",) * 4, 4)
    finally:
        sidecar.stop()
        for tier in (ours, foreign):
            tier.delete_many(
                [tier_key(Scope(NAMESPACE, MODEL.fingerprint()), k) for k in chain(4, "promise-good")]
            )
            tier.close()
        for folder in (keys_dir, foreign_dir):
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()
