"""Retention across a fleet, on real ``kvstore serve`` processes: two sidecars with
``store.default_retention_s`` over one shared remote tier (a shared kvstore node given the same
retention, then a Redis Cluster). A chain stored through A and read through into B is, past its
retention counted from its first store, found by neither, restored by neither, and gone from the
remote tier: B's read-through copy kept the remote copy's birth time (a restarted clock would
still serve it), and a Redis key's PTTL is the retention the block has left. At the tier level,
a copy past the retention asked for (or of unknown age) is a counted miss, deleted on the node
(``tests/test_remote_contract.py`` holds the same check for Redis, ``tests/mooncake_contract.py``
for Mooncake)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from benchmarks.redis_cluster import RedisClusterProcess
from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import BlockKey, Fingerprint
from kvstore.remote.nodes import KvStoreNodesTier
from kvstore.store.model import Scope, shared_key_name, tier_key
from tests.service_fixtures import MODEL, blocks_for, chain, process_settings
from tests.test_remote_contract import check_an_expired_copy_is_a_counted_miss
from tiers.remote import RemoteConfig

RETENTION_S = 3.0
MARGIN_S = 0.3  # past the deadline before looking: the clocks of two processes, a sweep's turn


@pytest.fixture(scope="module")
def node() -> Iterator[ServerProcess]:
    """The shared node, given the tenants' retention as an operator would (its own copy then
    goes, counted from when it arrived, even if no sidecar reads it again)."""
    node = ServerProcess(process_settings(**{"store.default_retention_s": str(RETENTION_S)}), tcp=True)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcess]:
    with RedisClusterProcess(masters=3) as c:
        yield c


@pytest.fixture(params=["kvstore", "redis"])
def fleet(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, ServerProcess, dict[str, str]]]:
    if request.param == "kvstore":
        node = request.getfixturevalue("node")
        # the sidecars' Unix callers are tenant "local": tenant-a's token files them on the node
        remote = {"remote.backend": "kvstore", "remote.nodes": node.tcp, "remote.tokens": "t/local=tok-a"}
    else:
        cluster = request.getfixturevalue("cluster")
        remote = {
            "remote.backend": "redis",
            "remote.nodes": ",".join(cluster.nodes),
            "remote.key_prefix": f"r{time.monotonic_ns()}:",
        }
    settings = process_settings(**remote, **{"store.default_retention_s": str(RETENTION_S)})
    a = ServerProcess(settings)
    try:
        b = ServerProcess(settings)
        try:
            yield a, b, remote
        finally:
            b.stop()
    finally:
        a.stop()


def test_a_block_leaves_every_sidecar_and_the_remote_tier_its_retention_after_it_was_first_stored(
    fleet: tuple[ServerProcess, ServerProcess, dict[str, str]], request: pytest.FixtureRequest
) -> None:
    a, b, remote = fleet
    keys = chain(4, "retained")
    blocks = blocks_for(keys)
    with connect(a.unix) as kv:
        fp = kv.register(MODEL)
        before_s = time.time()
        assert kv.write(fp, keys, blocks) == 4
        stored_s = time.time()  # every block was born in [before_s, stored_s]
        deadline = time.monotonic() + 10
        while kv.stats()["counters"].get("remote_stored_blocks", 0) < 4:
            assert time.monotonic() < deadline, kv.stats()["counters"]
            time.sleep(0.02)
    if remote["remote.backend"] == "redis":
        check_pttl_is_the_retention_left(
            request.getfixturevalue("cluster"), remote, fp, keys, before_s, stored_s
        )
    time.sleep(1.0)  # b reads it a second into its life: a restarted clock would show then
    with connect(b.unix) as kv:
        assert kv.register(MODEL) == fp
        outs = [memoryview(bytearray(len(x))) for x in blocks]
        assert kv.read_into(fp, keys, outs) == 4  # read through into b's dram
        assert [bytes(o) for o in outs] == blocks
        assert kv.lookup_tiers(fp, keys).tiers == ("dram",) * 4
        read_s = time.time()
    wait_s = stored_s + RETENTION_S + MARGIN_S - time.time()
    time.sleep(max(0.0, wait_s))
    # b's copy, had its clock restarted at the read-through, would live until read_s + retention
    assert time.time() < read_s + RETENTION_S, "too slow a machine: the read-through came too late to tell"
    for sidecar in (a, b):
        with connect(sidecar.unix) as kv:
            assert kv.lookup(fp, keys) == 0, (sidecar.data_dir, kv.lookup_tiers(fp, keys).tiers)
            outs = [memoryview(bytearray(len(x))) for x in blocks]
            assert kv.read_into(fp, keys, outs) == 0  # not restored, nor read through again
    if remote["remote.backend"] == "kvstore":
        node = request.getfixturevalue("node")
        with connect(node.tcp, token="tok-a") as kv:
            assert kv.exists(fp, keys) == [False] * 4  # the node's copy is gone too
    else:
        client = _redis(request.getfixturevalue("cluster"))
        try:
            assert [client.exists(_redis_key(remote, fp, k)) for k in keys] == [0] * 4
        finally:
            client.close()


def check_pttl_is_the_retention_left(
    cluster: RedisClusterProcess,
    remote: dict[str, str],
    fp: Fingerprint,
    keys: list[BlockKey],
    before_s: float,
    stored_s: float,
) -> None:
    """Each key expires when its block does: its PTTL is what the retention has left since the
    block's birth (in [before_s, stored_s]), not the whole retention from the remote put."""
    client = _redis(cluster)
    try:
        asked_s = time.time()
        pttls = [client.pttl(_redis_key(remote, fp, k)) for k in keys]
        answered_s = time.time()
    finally:
        client.close()
    low = (before_s + RETENTION_S - answered_s) * 1000 - 5
    high = (stored_s + RETENTION_S - asked_s) * 1000 + 5  # ceil to the millisecond
    assert all(low <= p <= high for p in pttls), (pttls, low, high)


def _redis(cluster: RedisClusterProcess) -> redis.RedisCluster:
    host, _, port = cluster.nodes[0].rpartition(":")
    return redis.RedisCluster(host=host, port=int(port))


def _redis_key(remote: dict[str, str], fp: Fingerprint, key: BlockKey) -> bytes:
    """The name the sidecar stores a block under (tenant ``local`` over its Unix socket)."""
    return remote["remote.key_prefix"].encode() + shared_key_name(tier_key(Scope("t/local", fp), key))


def test_a_node_copy_past_its_retention_is_a_counted_miss_and_deleted_there(node: ServerProcess) -> None:
    """The sidecar's own check, whatever the node's retention: the birth in the value's header."""
    tier = KvStoreNodesTier(RemoteConfig(nodes=(node.tcp,), tokens={"t/local": "tok-a"}))
    try:
        check_an_expired_copy_is_a_counted_miss(tier, "t/local")
    finally:
        tier.close()
