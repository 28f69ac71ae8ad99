"""Two sidecars of a fleet, each a real kvstore server with its own data folder and arena, over
one shared remote tier: first a shared kvstore server (``remote.backend = kvstore``), then a
Redis Cluster (``remote.backend = redis``). A chain one sidecar's client stores is found by the
other's client as tier ``remote`` and restored through it, byte for byte."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from benchmarks.redis_cluster import RedisClusterProcess
from kvstore.client import connect
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from tests.service_fixtures import MODEL, blocks_for, chain, settings_for


class Sidecar:
    def __init__(self, **remote: str) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
        overrides = settings_for(self.data_dir, **{f"remote.{k}": v for k, v in remote.items()})
        self.server: RunningServer = start_server(load_settings(env={}, overrides=overrides))

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def sidecars(**remote: str) -> Iterator[tuple[Sidecar, Sidecar]]:
    a, b = Sidecar(**remote), Sidecar(**remote)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture(scope="module")
def shared_server() -> Iterator[Sidecar]:
    shared = Sidecar()
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcess]:
    with RedisClusterProcess(masters=3) as c:
        yield c


@pytest.fixture(params=["kvstore", "redis"])
def fleet(request: pytest.FixtureRequest) -> Iterator[tuple[Sidecar, Sidecar]]:
    if request.param == "kvstore":
        shared = request.getfixturevalue("shared_server")
        address = shared.server.tcp_address
        assert address is not None
        # the sidecars' Unix callers are tenant "local" (namespace t/local): tenant-a's token
        # files their blocks under tenant-a on the shared server
        yield from sidecars(backend="kvstore", nodes=address, tokens="t/local=tok-a")
    else:
        cluster = request.getfixturevalue("cluster")
        prefix = f"f{time.monotonic_ns()}:"
        yield from sidecars(backend="redis", nodes=",".join(cluster.nodes), key_prefix=prefix)


def test_a_prefix_stored_through_one_sidecar_is_restored_through_the_other(
    fleet: tuple[Sidecar, Sidecar],
) -> None:
    check_restored_through_the_other(*fleet)


def check_restored_through_the_other(a: Sidecar, b: Sidecar) -> None:
    """Six blocks written through a reach the remote tier; b finds them there and restores them,
    byte for byte, promoting them into its own dram (every backend)."""
    keys = chain(6, "fleet")
    blocks = blocks_for(keys)
    with connect(a.server.unix_address) as kv_a:
        fp = kv_a.register(MODEL)
        assert kv_a.write(fp, keys, blocks) == 6  # into a's arena, then behind to the remote
        deadline = time.monotonic() + 10
        while kv_a.stats()["counters"].get("remote_stored_blocks", 0) < 6:
            assert time.monotonic() < deadline, kv_a.stats()["counters"]
            time.sleep(0.05)
    with connect(b.server.unix_address) as kv_b:
        assert kv_b.register(MODEL) == fp
        found = kv_b.lookup_tiers(fp, keys)
        assert (found.hit_blocks, found.tiers) == (6, ("remote",) * 6)
        outs = [memoryview(bytearray(len(x))) for x in blocks]
        assert kv_b.read_into(fp, keys, outs) == 6  # read through into b's arena, then copied
        assert [bytes(o) for o in outs] == blocks
        assert kv_b.lookup_tiers(fp, keys).tiers == ("dram",) * 6
        assert kv_b.stats()["counters"]["remote_filled_blocks"] == 6


def test_a_remote_backend_without_nodes_is_refused_at_start() -> None:
    data_dir = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    try:
        # the [remote] section checks itself when settings are read, before anything starts
        with pytest.raises(InvalidArgument, match=r"remote\.nodes"):
            load_settings(env={}, overrides=settings_for(data_dir, **{"remote.backend": "redis"}))
        bad = settings_for(data_dir, **{"remote.backend": "kvstore", "remote.nodes": "127.0.0.1:1"})
        bad["remote.tokens"] = "tenant-a=tok-a"  # not a namespace
        with pytest.raises(InvalidArgument, match="keyed by namespace"):
            load_settings(env={}, overrides=bad)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_mooncake_settings_that_cannot_work_are_refused_at_start() -> None:
    data_dir = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    mooncake = {"remote.backend": "mooncake", "remote.metadata_server": "http://127.0.0.1:1/metadata"}
    try:
        two = settings_for(data_dir, **mooncake, **{"remote.nodes": "127.0.0.1:1,127.0.0.1:2"})
        with pytest.raises(FailedPrecondition, match="the master"):
            start_server(load_settings(env={}, overrides=two))
        ttl = settings_for(data_dir, **mooncake, **{"remote.nodes": "127.0.0.1:1", "remote.ttl_s": "60"})
        with pytest.raises(FailedPrecondition, match="no per-key expiry"):
            start_server(load_settings(env={}, overrides=ttl))
        no_metadata = settings_for(data_dir, **{"remote.backend": "mooncake", "remote.nodes": "127.0.0.1:1"})
        with pytest.raises(FailedPrecondition, match="metadata_server"):
            start_server(load_settings(env={}, overrides=no_metadata))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
