"""Damage LMDB finds only when a read meets it (a page of the payloads' B-tree damaged under a
running server, after the open that would have moved a damaged environment aside): the block
is a counted miss and dropped, the blocks before it are served, and the request does not fail."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import ModelIdentity, block_keys
from tiers.base import TierKey
from tiers.nvme import NvmeConfig, NvmeTier

PAGE = 4096
P_BRANCH, P_LEAF = 0x01, 0x02
MODEL = ModelIdentity(
    "test/damaged-reads", "ef" * 32, num_layers=2, num_kv_heads=4, head_dim=64, tokens_per_block=16
)
BLOCKS = 160  # of 32 KiB: the payloads' B-tree is a branch page over a few leaves


def _nodes(raw: mmap.mmap, page: int) -> Iterator[tuple[int, bytes, int]]:
    """(the child page a branch node names, key, offset of a leaf node's data) of each node."""
    at = page * PAGE
    lower = struct.unpack_from("<H", raw, at + 12)[0]
    for i in range((lower - 16) // 2):
        node = at + struct.unpack_from("<H", raw, at + 16 + 2 * i)[0]
        lo, hi, flags, ksize = struct.unpack_from("<HHHH", raw, node)
        yield lo | hi << 16 | flags << 32, raw[node + 8 : node + 8 + ksize], node + 8 + ksize


def payload_leaves(data_mdb: Path) -> dict[int, list[bytes]]:
    """The live leaf pages of the ``payloads`` database and the keys on each, walked down from
    the newer meta page (LMDB's layout on 64-bit Linux: a page header of 16 bytes, the main
    database's root at 128 and the transaction id at 144 of a meta page, a named database's
    root at 40 of its record)."""
    with open(data_mdb, "rb") as f:  # mapped: the file is reserved far past its pages in use
        raw = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    meta = max((0, 1), key=lambda p: struct.unpack_from("<Q", raw, p * PAGE + 144)[0])
    main_root = struct.unpack_from("<Q", raw, meta * PAGE + 128)[0]
    (root,) = [
        struct.unpack_from("<Q", raw, at + 40)[0]
        for _, key, at in _nodes(raw, main_root)
        if key == b"payloads"
    ]
    leaves: dict[int, list[bytes]] = {}
    pages = [root]
    while pages:
        page = pages.pop()
        flags = struct.unpack_from("<H", raw, page * PAGE + 10)[0]
        if flags & P_BRANCH:
            pages += [child for child, _, _ in _nodes(raw, page)]
        elif flags & P_LEAF:
            leaves[page] = [key for _, key, _ in _nodes(raw, page)]
    raw.close()
    return leaves


def damage(data_mdb: Path, page: int) -> None:
    """Zero a page in place, as a lost write leaves it: a page of no type LMDB knows."""
    with open(data_mdb, "r+b") as f:
        f.seek(page * PAGE)
        f.write(bytes(PAGE))


def _block(i: int) -> bytes:
    return bytes([i % 251 + 1]) * MODEL.block_bytes


def test_a_page_damaged_under_a_running_server_is_a_counted_miss_and_the_rest_is_served() -> None:
    server = ServerProcess(
        {"dram.capacity_bytes": "16MiB", "dram.page_bytes": "1MiB", "dram.prefault": "false"}
    )
    try:
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            keys = block_keys(fp, list(range(BLOCKS * MODEL.tokens_per_block)), MODEL.tokens_per_block)
            assert kv.write(fp, keys, [_block(i) for i in range(BLOCKS)]) == BLOCKS
        server.restart()  # a clean stop spills every block to nvme; dram starts empty
        data = server.data_dir / "nvme" / "data.mdb"
        leaves = payload_leaves(data)
        assert len(leaves) >= 2
        at = {bytes(key): i for i, key in enumerate(keys)}
        on_page = {page: sorted(at[k[-32:]] for k in names) for page, names in leaves.items()}
        page, lost = next((p, blocks) for p, blocks in on_page.items() if 0 not in blocks)
        damage(data, page)
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            got = kv.get(fp, keys)  # the restore meets the damaged page: a miss there, no error
            assert [bytes(v) for v in got] == [_block(i) for i in range(lost[0])]
            assert kv.lookup(fp, keys) == lost[0], "the block on the damaged page is dropped"
            nvme = [t for t in kv.stats()["tiers"] if t["name"] == "nvme"]
            assert nvme[0]["checksum_failures"] >= 1
        assert "is on a damaged page" in (server.data_dir / "serve.log").read_text()
    finally:
        server.stop()


def test_a_batched_read_that_meets_a_damaged_page_reads_the_others(tmp_path: Path) -> None:
    """The tier's batched read (one transaction for many blocks): the blocks on the damaged
    page are counted misses and dropped, every other block of the batch is read."""
    fp = b"\x0e" * 32
    keys = [TierKey(bytes([3]) + b"abc" + fp + i.to_bytes(32, "little")) for i in range(BLOCKS)]
    config = NvmeConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 << 20)
    tier = NvmeTier(config)
    for i, key in enumerate(keys):
        tier.put(key, _block(i), fp)
    tier.close()
    tier = NvmeTier(config)
    try:
        leaves = payload_leaves(tmp_path / "nvme" / "data.mdb")
        page, names = next(iter(leaves.items()))
        damage(tmp_path / "nvme" / "data.mdb", page)
        sizes: list[int | None] = []
        outs = [bytearray(MODEL.block_bytes) for _ in keys]
        tier.get_into_many(keys, [memoryview(o) for o in outs], sizes)
        lost = {i for i, key in enumerate(keys) if bytes(key) in names}
        assert [i for i, n in enumerate(sizes) if n is None] == sorted(lost)
        assert all(outs[i] == _block(i) for i in range(BLOCKS) if i not in lost)
        assert tier.usage().checksum_failures == len(lost)
        assert tier.usage().blocks == BLOCKS - len(lost)
    finally:
        tier.close()
