"""The store over a real `nvme` tier: the cache survives restarts, chain links included, and a
corrupt block is a miss, never wrong bytes."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

from kvstore.cli.demo import run_demo
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.server.builder import open_store
from kvstore.server.config import load_settings
from kvstore.store import Scope, StoreConfig, TieredStore, tier_key
from kvstore.store.model import parse_meta
from tiers.base import TierKey
from tiers.dram import DramConfig, DramTier, salvage
from tiers.nvme import NvmeConfig, NvmeTier

BLOCK = 1 << 16
FP = Fingerprint(b"\x05" * 32)
A = Scope("tenant-a", FP)


def data(key: BlockKey) -> bytes:
    return (key * (BLOCK // 32))[:BLOCK]


def chain(n: int, salt: str) -> list[BlockKey]:
    return block_keys(FP, list(range(n * 4)), 4, cache_salt=salt)


def open_two_tier(folder: Path, dram_blocks: int, nvme_blocks: int) -> TieredStore:
    dram = DramTier(DramConfig(capacity_bytes=dram_blocks * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=folder / "nvme", capacity_bytes=nvme_blocks * BLOCK))
    return TieredStore([dram, nvme], StoreConfig())


def test_every_block_survives_a_clean_restart(tmp_path: Path) -> None:
    keys = chain(8, "a")
    store = open_two_tier(tmp_path, dram_blocks=3, nvme_blocks=32)
    store.put(A, keys, [data(k) for k in keys])
    assert store.stats().tiers[1].blocks == 5  # demoted; three are only in dram
    store.close()  # spills the dram-only blocks
    store = open_two_tier(tmp_path, dram_blocks=3, nvme_blocks=32)
    assert store.lookup(A, keys).hit_blocks == 8
    assert store.get(A, keys) == [data(k) for k in keys]
    store.close()


def test_chain_links_survive_a_restart(tmp_path: Path) -> None:
    chains = [chain(4, f"c{i}") for i in range(4)]
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=16 * BLOCK))
    store = TieredStore([nvme])
    for keys in chains:
        store.put(A, keys, [data(k) for k in keys])
    store.close()
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=16 * BLOCK))
    store = TieredStore([nvme])
    for i in range(6):  # full: six blocks must go, and only leaves may
        other = chain(1, f"new{i}")
        store.put(A, other, [data(other[0])])
    for keys in chains:
        assert sum(store.exists(A, keys)) == store.lookup(A, keys).hit_blocks, "a hole in a chain"
    store.close()


def test_a_corrupt_block_on_disk_is_a_counted_miss(tmp_path: Path) -> None:
    keys = chain(2, "a")
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=8 * BLOCK))
    store = TieredStore([nvme])
    store.put(A, keys, [data(k) for k in keys])
    store.close()
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=4)
    payloads = env.open_db(b"payloads")
    with env.begin(write=True, db=payloads) as txn:
        raw = bytearray(txn.get(tier_key(A, keys[1])))
        raw[100] ^= 0xFF
        txn.put(tier_key(A, keys[1]), bytes(raw))
    env.close()
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=8 * BLOCK))
    store = TieredStore([nvme])
    assert store.get(A, keys) == [data(keys[0]), None]
    assert store.stats().counters["checksum_failures"] == 1
    assert store.lookup(A, keys).hit_blocks == 1
    store.close()


def test_the_demo_runs_end_to_end(tmp_path: Path) -> None:
    settings = load_settings(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "dram.capacity_bytes": "64MiB",
            "dram.prefault": "false",
            "nvme.capacity_bytes": "1GiB",
        },
    )
    lines: list[str] = []
    run_demo(settings, lines.append)
    text = "\n".join(lines)
    assert "request 2: 128 of 142 blocks hit" in text
    assert "same prompt, new weights: 0 hits" in text
    assert "another tenant's salt: 0 hits" in text
    assert "after restart: restored 128 blocks byte for byte" in text
    store = open_store(settings)  # the folder is reusable after the demo
    assert store.stats().blocks > 0
    store.close()


def test_retention_counts_from_the_first_store_across_restarts(tmp_path: Path) -> None:
    now = [1_800_000_000.0]
    config = StoreConfig(retention_s={"tenant-a": 100.0})

    def open_at() -> TieredStore:
        dram = DramTier(DramConfig(capacity_bytes=4 * BLOCK, page_bytes=BLOCK, prefault=False))
        nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=32 * BLOCK))
        return TieredStore([dram, nvme], config, wall_clock=lambda: now[0])

    keys = chain(3, "kept")
    store = open_at()
    store.put(A, keys, [data(k) for k in keys])
    store.close()  # spilled to nvme with their birth time in the metadata
    now[0] += 60
    store = open_at()
    assert store.lookup(A, keys).hit_blocks == 3
    store.close()
    now[0] += 41  # 101 s after the first store, not 41 s after the restart
    store = open_at()
    try:
        assert store.lookup(A, keys).hit_blocks == 0
    finally:
        store.close()


def test_a_killed_servers_blocks_keep_their_birth_time_in_the_journal() -> None:
    """What salvage copies into nvme after a kill -9 is the journal's metadata: a block written
    in place (reserve, commit) or put must carry its birth time there, or its retention would
    count again from the restart."""
    name = f"kvstore-test-{os.getpid()}-birth"
    born = 1_800_000_000.0
    dram = DramTier(DramConfig(capacity_bytes=16 * BLOCK, page_bytes=BLOCK, prefault=False), name)
    store = TieredStore([dram], StoreConfig(), wall_clock=lambda: born)
    try:
        written, put = chain(2, "in place"), chain(2, "put")
        reservation = store.reserve(A, written, [BLOCK] * 2)
        for k, slot in zip(written, reservation.slots, strict=True):
            assert slot is not None
            dram.slot_view(slot)[:] = data(k)
        assert store.commit(reservation.reservation_id) == 2
        store.put(A, put, [data(k) for k in put])
        with salvage(name) as blocks:
            births = {TierKey(r.key): parse_meta(r.meta)[2] for r, _ in blocks}
        assert births == {tier_key(A, k): born for k in written + put}
    finally:
        store.close()
