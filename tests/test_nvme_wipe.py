"""Deletion that deletes, with encryption off, on a real ``kvstore serve``: blocks stored into
nvme and then deleted by a client, or evicted from a full nvme tier, leave no copy of their
bytes in LMDB's ``data.mdb`` once the server has synced (closed). Before ``tiers.nvme_wipe``,
every deleted block's pattern was still there (LMDB frees pages, it does not clear them)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.server.datadir import remove_shm_files
from tests.service_fixtures import BLOCK, MODEL
from tests.test_service import chain


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
