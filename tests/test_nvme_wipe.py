"""Deletion that deletes, with encryption off, on a real ``kvstore serve``: blocks stored into
nvme and then deleted by a client, or evicted from a full nvme tier, leave no copy of their
bytes in LMDB's ``data.mdb`` once the server has synced (closed). Before ``tiers.nvme_wipe``,
every deleted block's pattern was still there (LMDB frees pages, it does not clear them)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.server.datadir import remove_shm_files
from tests.service_fixtures import BLOCK, MODEL, chain
from tiers.base import TierKey
from tiers.nvme import NvmeConfig, NvmeTier


def pattern(i: int) -> bytes:
    return b"WIPE%08d" % i  # 12 bytes, unique per block


def block(i: int) -> bytes:
    unit = pattern(i)
    return unit * (BLOCK // len(unit)) + bytes(BLOCK % len(unit))


def test_deleted_and_evicted_nvme_blocks_leave_no_bytes_in_data_mdb() -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"))
    settings = {
        "dram.capacity_bytes": "1MiB",  # 128 blocks: the rest is demoted to nvme
        "dram.page_bytes": "256KiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "4MiB",  # 512 blocks: the first chains are evicted from it
    }
    try:
        server = ServerProcess(settings, folder)
        try:
            with connect(server.unix) as kv:
                fp = kv.register(MODEL)
                chains = [chain(64, f"wipe{c}") for c in range(12)]  # 768 blocks of 8 KiB
                for c, keys in enumerate(chains):
                    assert kv.write(fp, keys, [block(c * 64 + i) for i in range(64)]) == 64
                deleted = chains[-3]  # a recent chain: in nvme or dram, deleted by the client
                assert kv.delete(fp, deleted) == 64
                held = {
                    c * 64 + i
                    for c, keys in enumerate(chains)
                    for i, tier in enumerate(kv.lookup_tiers(fp, keys).tiers)
                    if tier in ("dram", "nvme")
                }
        finally:
            server.stop()  # drains, commits and syncs nvme
        data = (folder / "nvme" / "data.mdb").read_bytes()
        gone = [i for i in range(12 * 64) if i not in held]
        assert len(gone) >= 64 + 128, f"too few blocks went: {len(gone)}"
        assert any(data.count(pattern(i)) for i in held), "no block reached nvme: the test proves nothing"
        left = {i: n for i in gone if (n := data.count(pattern(i)))}
        assert not left, f"{len(left)} of {len(gone)} deleted or evicted blocks still readable in data.mdb"
    finally:
        remove_shm_files(folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("durability", ["cache", "durable"])
def test_a_replaced_or_deleted_value_is_cleared_in_either_mode(tmp_path: Path, durability: str) -> None:
    """At the tier: 48 blocks stored, 16 replaced by other bytes under the same keys, 16 deleted
    (one of them replaced again just before), the rest kept: after the tier closes,
    data.mdb holds the kept blocks and the new bytes, nothing of the old or deleted ones."""
    config = NvmeConfig(path=tmp_path / "nvme", capacity_bytes=64 << 20, durability=durability)
    tier = NvmeTier(config)
    try:
        keys = [TierKey(b"wipe-%04d" % i) for i in range(48)]
        for i, k in enumerate(keys):
            tier.put(k, block(i), b"\x01" * 32)
        tier.flush()
        for i, k in enumerate(keys[:16]):
            tier.put(k, block(1000 + i), b"\x01" * 32)
        tier.put(keys[20], block(2000), b"\x01" * 32)  # then deleted at once
        for k in keys[16:32]:
            tier.delete(k)
        tier.flush()
    finally:
        tier.close()
    data = (tmp_path / "nvme" / "data.mdb").read_bytes()
    assert all(data.count(pattern(i)) for i in range(32, 48))  # kept
    assert all(data.count(pattern(1000 + i)) for i in range(16))  # the new bytes
    left = [i for i in [*range(32), 2000] if data.count(pattern(i))]
    assert not left, f"{len(left)} replaced or deleted values still in data.mdb: {left}"
