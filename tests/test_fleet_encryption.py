"""Encryption beyond the host, on real servers: sidecars with encryption at rest, sharing one
key folder, over a real shared kvstore node and over a real Redis Cluster. The remote copy holds
no plaintext; a sidecar with the same keys restores it; after ``shred`` at one sidecar, a copy
that escaped the deletion (planted back, byte for byte, as a backup or a node that was down would
keep it) is restored nowhere: the other sidecar misses it, and a fresh one, with even the fleet's
invalidation mark gone, reads it as a counted miss and deletes it."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.client import connect
from kvstore.keys import BlockKey
from kvstore.server.config import load_settings
from kvstore.server.serve import start_server
from kvstore.server.shredding import KEY_CHECK_S
from kvstore.store.model import Scope, namespace_of_tier_key, tier_key
from tests.service_fixtures import BLOCK, MODEL, chain, settings_for
from tests.test_fleet_sidecars import Sidecar, cluster, shared_server  # noqa: F401 (fixtures)
from tiers.cipher import OVERHEAD_BYTES, BlockCipher

PATTERN = b"PLAINTEXT-KV-PATTERN-"


@dataclass
class Backend:
    """One shared remote tier: the sidecars' remote settings, and the raw copies it holds."""

    settings: dict[str, str]
    raw: Callable[[list[BlockKey]], list[bytes]]  # the stored values, as the medium holds them
    plant: Callable[[list[BlockKey], list[bytes]], None]  # put raw values back
    clear: Callable[[], None]  # remove every value of this fleet, invalidation marks included


@pytest.fixture(params=["kvstore", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    fp = MODEL.fingerprint()
    if request.param == "kvstore":
        shared = request.getfixturevalue("shared_server")
        address = shared.server.tcp_address
        assert address is not None
        node = connect(address, token="tok-a")  # the tenant the sidecars' blocks go under

        def raw_node(keys: list[BlockKey]) -> list[bytes]:
            return [bytes(v) for v in node.get(fp, keys)]

        def plant_node(keys: list[BlockKey], values: list[bytes]) -> None:
            node.put(fp, keys, values)  # 0 where a copy is still there

        def clear_node() -> None:
            node.invalidate(everything=True)

        settings = {"backend": "kvstore", "nodes": address, "tokens": "t/local=tok-a"}
        try:
            yield Backend(settings, raw_node, plant_node, clear_node)
        finally:
            node.invalidate(everything=True)
            node.close()
        return
    from redis.cluster import ClusterNode, RedisCluster

    nodes = request.getfixturevalue("cluster").nodes
    prefix = f"e{time.monotonic_ns()}:".encode()
    host, _, port = nodes[0].rpartition(":")
    r = RedisCluster(startup_nodes=[ClusterNode(host, int(port))])

    def names() -> list[bytes]:
        return sorted(r.scan_iter(match=prefix + b"*", count=1000))

    def raw_redis(keys: list[BlockKey]) -> list[bytes]:
        return [r.get(n) for n in names()]

    saved: dict[bytes, bytes] = {}

    def plant_redis(keys: list[BlockKey], values: list[bytes]) -> None:
        for name, value in saved.items():
            r.set(name, value)

    def clear_redis() -> None:
        for name in names():
            r.delete(name)

    def raw_and_save(keys: list[BlockKey]) -> list[bytes]:
        values = raw_redis(keys)
        saved.update(zip(names(), values, strict=True))
        return values

    settings = {"backend": "redis", "nodes": ",".join(nodes), "key_prefix": prefix.decode()}
    try:
        yield Backend(settings, raw_and_save, plant_redis, clear_redis)
    finally:
        clear_redis()
        r.close()


class Encrypted(Sidecar):
    """A sidecar with encryption at rest over ``backend``, its keys in ``keys_dir``."""

    def __init__(self, backend: Backend, keys_dir: Path) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
        overrides = settings_for(self.data_dir, **{f"remote.{k}": v for k, v in backend.settings.items()})
        overrides["nvme.encryption_keys_dir"] = str(keys_dir)
        self.server = start_server(load_settings(env={}, overrides=overrides))


def patterned(n: int) -> list[bytes]:
    unit = len(PATTERN) + 1
    return [(PATTERN + bytes([i])) * (BLOCK // unit) + bytes(BLOCK % unit) for i in range(n)]


def local_hits(sidecar: Sidecar, keys: list[BlockKey]) -> int:
    with connect(sidecar.server.unix_address) as kv:
        return kv.lookup_tiers(kv.register(MODEL), keys).hit_blocks


def restored(sidecar: Sidecar, keys: list[BlockKey], blocks: list[bytes]) -> int:
    with connect(sidecar.server.unix_address) as kv:
        fp = kv.register(MODEL)
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        n = kv.read_into(fp, keys, outs)
        assert [bytes(o) for o in outs[:n]] == blocks[:n]
        return n


def restored_after_planting(
    sidecar: Sidecar, backend: Backend, keys: list[BlockKey], blocks: list[bytes], copies: list[bytes]
) -> int:
    """Plant the copies back, as copies the deletion missed would be (a backup, a node that was
    down), and restore through ``sidecar``."""
    backend.plant(keys, copies)
    return restored(sidecar, keys, blocks)


def counters(sidecar: Sidecar) -> dict[str, int]:
    with connect(sidecar.server.unix_address) as kv:
        return dict(kv.stats()["counters"])


def test_remote_copies_are_sealed_and_a_shred_at_one_sidecar_reaches_every_copy(backend: Backend) -> None:
    keys_dir = Path(tempfile.mkdtemp(prefix="kvk-", dir="/tmp"))  # the fleet's one key folder
    a = Encrypted(backend, keys_dir)
    b = Encrypted(backend, keys_dir)
    fresh: Sidecar | None = None
    try:
        keys, blocks = chain(4, "sealed"), patterned(4)
        with connect(a.server.unix_address) as kv_a:
            fp = kv_a.register(MODEL)
            assert kv_a.write(fp, keys, blocks) == 4
            deadline = time.monotonic() + 10
            while kv_a.stats()["counters"].get("remote_stored_blocks", 0) < 4:
                assert time.monotonic() < deadline, kv_a.stats()["counters"]
                time.sleep(0.05)
        copies = backend.raw(keys)
        assert len(copies) == 4 and all(len(c) >= BLOCK + 28 for c in copies)
        assert not any(PATTERN in c for c in copies), "a remote copy holds plaintext"

        assert restored(b, keys, blocks) == 4  # the same key folder: b opens a's copies

        with connect(a.server.unix_address) as kv_a:
            assert kv_a.shred("local")[1]  # the shared key file is deleted
        deadline = time.monotonic() + 5 * KEY_CHECK_S  # b's key watch forgets the key, drops b's copies
        while local_hits(b, keys):
            assert time.monotonic() < deadline, "b still serves a shredded tenant's blocks"
            time.sleep(0.05)
        assert restored_after_planting(b, backend, keys, blocks, copies) == 0

        # The fleet's invalidation mark (which also makes those copies misses) lost as well, as
        # when the remote evicted it or was restored from a backup: only the key stands between
        # the copies and a sidecar, and it is gone. A sidecar started now finds them, cannot
        # open them, counts them and deletes them.
        backend.clear()
        fresh = Encrypted(backend, keys_dir)
        assert restored_after_planting(fresh, backend, keys, blocks, copies) == 0
        assert counters(fresh)["remote_unsealable"] >= 1
        assert len(backend.raw(keys)) < len(keys)  # what it could not open, it deleted
    finally:
        for s in (a, b, fresh):
            if s is not None:
                s.close()
        shutil.rmtree(keys_dir, ignore_errors=True)


def test_sidecars_sharing_a_key_folder_agree_on_a_tenants_key_made_at_once(tmp_path: Path) -> None:
    """Eight ciphers over one folder (eight sidecars' views of the fleet's key folder) seal a
    new tenant's first block at the same moment: one key is made, and each opens every seal."""
    ciphers = [BlockCipher(tmp_path, namespace_of_tier_key) for _ in range(8)]
    key = tier_key(Scope("t/new", MODEL.fingerprint()), chain(1, "race")[0])
    payload = memoryview(patterned(1)[0])
    start = threading.Barrier(len(ciphers))

    def seal(cipher: BlockCipher) -> bytearray:
        out = bytearray(len(payload) + OVERHEAD_BYTES)
        start.wait()
        cipher.seal_into(key, payload, memoryview(out))
        return out

    with ThreadPoolExecutor(len(ciphers)) as pool:
        sealed = list(pool.map(seal, ciphers))
    assert len(list(tmp_path.glob("*.key"))) == 1 and not list(tmp_path.glob(".*"))
    for cipher in ciphers:
        for s in sealed:
            out = bytearray(len(payload))
            assert cipher.open_into(key, memoryview(s), memoryview(out)) == len(payload)
            assert out == payload


def test_a_key_made_by_another_sidecar_after_this_one_looked_opens_its_copies(tmp_path: Path) -> None:
    """Sidecar a asks for a tenant's copies before any sidecar has made the tenant's key (it
    finds none); sidecar b then makes it by sealing: a opens b's copies from then on, and a
    shred still leaves nothing that opens."""
    a, b = BlockCipher(tmp_path, namespace_of_tier_key), BlockCipher(tmp_path, namespace_of_tier_key)
    key = tier_key(Scope("t/late", MODEL.fingerprint()), chain(1, "late")[0])
    payload = memoryview(patterned(1)[0])
    sealed = bytearray(len(payload) + OVERHEAD_BYTES)
    out = bytearray(len(payload))
    assert a.key_id(key) is None  # a looks first: no key in the folder yet
    b.seal_into(key, payload, memoryview(sealed))
    assert a.key_id(key) == b.key_id(key) is not None
    assert a.open_into(key, memoryview(sealed), memoryview(out)) == len(payload) and out == payload
    assert b.shred("t/late")
    assert a.vanished() == ["t/late"]
    assert a.open_into(key, memoryview(sealed), memoryview(out)) is None


def test_with_encryption_on_and_no_nvme_tier_nothing_leaves_the_host_unsealed(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The cipher lives with the nvme tier: without one, the sidecar runs without its remote
    tier rather than send plaintext copies."""
    address = request.getfixturevalue("shared_server").server.tcp_address
    assert address is not None
    data_dir = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    remote = {"remote.backend": "kvstore", "remote.nodes": address, "remote.tokens": "t/local=tok-a"}
    overrides = settings_for(data_dir, **remote, **{"nvme.enabled": "false"})
    overrides["nvme.encryption_keys_dir"] = str(tmp_path / "keys")
    server = start_server(load_settings(env={}, overrides=overrides))
    try:
        keys = chain(2, "no-nvme")
        with connect(server.unix_address) as kv:
            fp = kv.register(MODEL)
            assert kv.write(fp, keys, patterned(2)) == 2
            time.sleep(0.5)  # the write-behind would have sent them by now
            assert not any(k.startswith("remote_") for k in kv.stats()["counters"])
        with connect(address, token="tok-a") as node:
            assert node.get(fp, keys) == []
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
