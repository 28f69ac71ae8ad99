"""Every copy that leaves the process knows what it is: a block's checksum is bound to its key
(namespace, model fingerprint, block key), so a whole value moved under another key is a miss,
counted and deleted. The Redis Cluster case is in test_remote_contract.py (its cluster); this
file covers the nvme tier (a real LMDB, edited with py-lmdb as an attacker would) and a shared
kvstore node (a real ``kvstore serve`` process whose arena slot is altered in /dev/shm)."""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import threading
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from benchmarks.ports import free_port
from benchmarks.server_process import ServerProcess
from kvstore.client import Client, connect
from kvstore.client.dataport import DataPortClient
from kvstore.keys import BlockKey, Fingerprint
from kvstore.remote.nodes import KvStoreNodesTier
from kvstore.store import Scope, tier_key
from kvstore.stream import recv_exact
from kvstore.wire import END, OK_FRAME
from tests.nvme_fixtures import config, raw_env
from tiers import Codec, TierKey
from tiers.dram import Arena
from tiers.nvme import NvmeConfig, NvmeTier
from tiers.remote import RemoteBlock, RemoteConfig

FP = Fingerprint(bytes(range(32)))
OTHER_FP = Fingerprint(bytes(reversed(range(32))))
SIZE = 100_000

__all__ = ["config"]


def key(namespace: str, n: int, fingerprint: Fingerprint = FP) -> TierKey:
    return tier_key(Scope(namespace, fingerprint), BlockKey(n.to_bytes(32, "big")))


def payload(seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(SIZE)


MOVES = {
    "another-key": key("t/a", 2),  # same tenant, same model, another block
    "another-namespace": key("t/b", 1),  # the same block key in another tenant
    "another-model": key("t/a", 1, OTHER_FP),  # the same block key under another model
}


@pytest.mark.parametrize("reader", ["get_into", "get_into_many"])  # Python's (or C's) copy, C's loop
@pytest.mark.parametrize("moved_to", list(MOVES))
def test_an_nvme_block_moved_under_another_key_is_a_counted_miss_and_deleted(
    config: NvmeConfig, moved_to: str, reader: str
) -> None:
    source, target = key("t/a", 1), MOVES[moved_to]
    tier = NvmeTier(config)
    tier.put(source, payload(1), FP)
    tier.close()
    # copy the block's header and payload, as they are, under the other key
    with raw_env(config) as env:
        headers, payloads = env.open_db(b"headers"), env.open_db(b"payloads")
        with env.begin(write=True) as txn:
            for db in (headers, payloads):
                txn.put(target, txn.get(source, db=db) or b"", db=db)
    tier = NvmeTier(config)
    try:
        assert {b.key for b in tier.scan()} == {source, target}  # the header parses: it is indexed
        out = memoryview(bytearray(SIZE))
        if reader == "get_into":
            assert tier.get_into(target, out) is None
        else:
            sizes: list[int | None] = []
            tier.get_into_many([target], [out], sizes)
            assert sizes == [None]
        assert tier.usage().checksum_failures == 1  # counted
        assert tier.size_of(target) is None  # and deleted
        assert tier.get_into(source, out) == SIZE and bytes(out) == payload(1)  # the original serves
    finally:
        tier.close()
    tier = NvmeTier(config)
    try:
        assert [b.key for b in tier.scan()] == [source]  # the delete reached the disk
    finally:
        tier.close()


def test_an_nvme_block_of_the_previous_format_is_dropped_at_open(
    config: NvmeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """A header of version 1 (its checksum not bound to the key) is never read as version 2."""
    tier = NvmeTier(config)
    tier.put(key("t/a", 1), payload(1), FP)
    tier.close()
    old = key("t/a", 7)
    v1 = struct.pack(
        "<4sHB32sQQQ", b"KVSB", 1, int(Codec.NONE), FP, SIZE, SIZE, xxhash.xxh3_64_intdigest(payload(7))
    )
    with raw_env(config) as env:
        headers, payloads = env.open_db(b"headers"), env.open_db(b"payloads")
        with env.begin(write=True) as txn:
            txn.put(old, v1, db=headers)
            txn.put(old, payload(7), db=payloads)
    with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
        tier = NvmeTier(config)
    try:
        assert [b.key for b in tier.scan()] == [key("t/a", 1)]
        assert tier.get_into(old, memoryview(bytearray(SIZE))) is None
        assert "dropped 1 blocks whose header is unreadable or of an older format" in caplog.text
    finally:
        tier.close()
    with raw_env(config) as env:
        headers = env.open_db(b"headers")
        with env.begin() as txn:
            assert txn.get(old, db=headers) is None  # cleared from the disk


# ---- a shared kvstore node whose arena copy is altered in place ------------------------------


@pytest.fixture(scope="module")
def node() -> Iterator[ServerProcess]:
    """A shared node as deployed (``kvstore serve``): tenant ``local`` reaches it over TCP with
    its token, and over the Unix socket as the same-host client it is by default."""
    server = ServerProcess(
        {
            "dram.capacity_bytes": "8MiB",
            "dram.page_bytes": "1MiB",
            "dram.prefault": "false",
            "nvme.capacity_bytes": "64MiB",
            "server.tokens": "tok-l=local",
            "server.metrics_address": f"127.0.0.1:{free_port()}",
        },
        tcp=True,
    )
    try:
        yield server
    finally:
        server.stop()


def sidecar(node: ServerProcess) -> KvStoreNodesTier:
    """A sidecar's remote tier, fresh: nothing of it cached from an earlier one."""
    return KvStoreNodesTier(RemoteConfig(nodes=(node.tcp,), tokens={"t/local": "tok-l"}))


def flip_in_arena(kv: Client, block: bytes) -> None:
    """What someone who can open the node's arena in /dev/shm does: find a block's bytes there
    and flip one, in place."""
    path = Arena.path_of(kv.attach().name)
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, os.fstat(fd).st_size) as arena:
            at = arena.find(block)
            assert at >= 0 and arena.find(block, at + 1) < 0
            arena[at + 100] ^= 0xFF
    finally:
        os.close(fd)


def dram_checksum_failures(kv: Client) -> int:
    return int(next(t["checksum_failures"] for t in kv.stats()["tiers"] if t["name"] == "dram"))


def scraped_dram_checksum_failures(node: ServerProcess) -> float:
    address = node.settings["server.metrics_address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    line = 'kvstore_tier_checksum_failures_total{tier="dram"} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).removeprefix(line))


@pytest.mark.parametrize("written", ["by-a-sidecar-over-tcp", "in-place-by-a-same-host-client"])
def test_a_shared_nodes_arena_copy_altered_in_place_is_a_counted_miss(
    node: ServerProcess, written: str
) -> None:
    seed = 10 if written.startswith("by") else 20
    keys = [key("t/local", seed + i) for i in range(3)]
    blocks = [np.random.default_rng(seed + i).bytes(8192) for i in range(3)]
    with connect(node.unix) as kv:
        failures = dram_checksum_failures(kv)
        if written.startswith("by"):  # checksummed as the node received it
            first = sidecar(node)
            assert first.put_many([RemoteBlock(k, FP, b) for k, b in zip(keys, blocks, strict=True)]) == 3
            first.close()
        else:  # written into the mapped arena by the client; checksummed when first served
            block_keys_ = [BlockKey(k[-32:]) for k in keys]
            assert kv.write(FP, block_keys_, blocks) == 3
            served = sidecar(node)
            assert served.get_many(keys, FP) == blocks
            served.close()
        flip_in_arena(kv, blocks[1])
        fresh = sidecar(node)
        try:
            # the node serves the intact prefix and stops at the altered block: a miss
            assert fresh.get_many(keys, FP) == [blocks[0], None, None]
        finally:
            fresh.close()
        assert dram_checksum_failures(kv) == failures + 1  # counted, in stats and the metrics
        assert scraped_dram_checksum_failures(node) == failures + 1
        assert kv.exists(FP, [BlockKey(k[-32:]) for k in keys]) == [True, False, True]  # deleted


def test_a_block_changed_on_its_way_from_a_node_is_a_counted_miss_for_the_receiver() -> None:
    """The client end checks what the node sends: here a data port whose second block arrives
    with bytes that are not the ones checksummed (as a flip on the wire would leave it). The
    get ends its prefix there, reads the rest of the answer (the connection stays usable),
    and counts the failure."""
    blocks = [np.random.default_rng(30 + i).bytes(8192) for i in range(3)]
    keys = [bytes([i]) * 32 for i in range(3)]
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket, flip: bool) -> None:
        recv_exact(conn, 1 + 32 + 4 + 32 * len(keys))  # the get: op, fingerprint, n, keys
        parts = [OK_FRAME]
        for i, block in enumerate(blocks):
            sent = bytearray(block)
            if flip and i == 1:
                sent[100] ^= 0xFF
            parts += [struct.pack("<QQ", len(block), xxhash.xxh3_64_intdigest(block)), bytes(sent)]
        conn.sendall(b"".join([*parts, struct.pack("<Q", END), OK_FRAME]))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            recv_exact(conn, 4)  # magic
            for _ in range(2):  # token, scope
                (n,) = struct.unpack("<H", recv_exact(conn, 2))
                recv_exact(conn, n)
            conn.sendall(OK_FRAME)
            answer(conn, flip=True)
            answer(conn, flip=False)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    client = DataPortClient("127.0.0.1", listener.getsockname()[1], "tok")
    try:
        take = lambda size: memoryview(bytearray(size))  # noqa: E731
        assert [bytes(b) for b in client.get(FP, keys, take)] == blocks[:1]  # a miss from block 1
        assert client.checksum_failures == 1
        assert [bytes(b) for b in client.get(FP, keys, take)] == blocks  # the stream stayed whole
        assert client.checksum_failures == 1
    finally:
        client.close()
        listener.close()
        server.join(timeout=5)
