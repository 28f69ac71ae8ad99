"""A real ``kvstore serve`` started on a full file system (its nvme degraded from the start), or on
a read-only one (its nvme opened read-only), takes writes into nvme again once room returns or
the file system is writable again, without a restart. Mounting needs root; where it is not
possible the tests skip, saying why (``tests/test_nvme_full_disk.py``'s small file system)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from kvstore.client import connect
from kvstore.server.datadir import remove_shm_files
from tests.test_nvme_full_disk import (
    CHAIN,
    MODEL,
    SmallFs,
    chain,
    log_dir,
    metric,
    no_arena_left,
    payload,
    small_fs,
    start,
    wait_for,
)

__all__ = ["log_dir", "small_fs"]  # fixtures, used by name


def _stored_and_stopped(data_dir: Path, log_dir: Path, **settings: str) -> None:
    """A server on ``data_dir`` stores chain 0 and stops cleanly: the chain is in nvme."""
    server, _ = start(data_dir, log_dir, **settings)
    try:
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            kv.write(fp, chain(fp, 0), [payload(0, i) for i in range(CHAIN)])
    finally:
        assert server.stop() == 0


def test_a_start_on_a_full_disk_takes_writes_again_once_room_returns(
    small_fs: SmallFs, log_dir: Path
) -> None:
    data_dir = small_fs.path / "d"
    _stored_and_stopped(data_dir, log_dir)
    filler = small_fs.fill("filler")  # every block of it
    server, port = start(data_dir, log_dir)
    try:
        assert metric(port, "kvstore_tier_degraded") == 1
        filler.unlink()
        # Before: the probe's room reserved ahead took the blocks just freed, its marker then
        # found none, and the tier stayed degraded until a restart.
        assert wait_for(lambda: metric(port, "kvstore_tier_degraded") == 0), "writes never resumed"
        assert "writable again" in (data_dir / "serve.log").read_text()
        before = metric(port, "kvstore_tier_blocks")
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            for n in range(1, 5):  # 16 MiB through a 4 MiB dram: most of it goes down
                kv.write(fp, chain(fp, n), [payload(n, i) for i in range(CHAIN)])
            assert wait_for(lambda: metric(port, "kvstore_tier_blocks") >= before + 2 * CHAIN)
            got = kv.get(fp, chain(fp, 1))
            assert [bytes(v) for v in got] == [payload(1, i) for i in range(CHAIN)]
    finally:
        assert server.stop() == 0
    assert no_arena_left(data_dir)
    remove_shm_files(data_dir)


def test_a_start_on_a_read_only_file_system_takes_writes_once_it_is_writable_again(
    small_fs: SmallFs, log_dir: Path
) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    nvme = {"nvme.path": str(small_fs.path / "nvme")}
    try:
        _stored_and_stopped(data_dir, log_dir, **nvme)
        small_fs.remount("ro")
        server, port = start(data_dir, log_dir, **nvme)
        try:
            assert metric(port, "kvstore_tier_degraded") == 1  # opened read-only
            small_fs.remount("rw")
            # Before: "restart once it is writable", and only a restart took writes again.
            assert wait_for(lambda: metric(port, "kvstore_tier_degraded") == 0), "writes never resumed"
            assert "writable again" in (data_dir / "serve.log").read_text()
            before = metric(port, "kvstore_tier_blocks")
            with connect(server.unix) as kv:
                fp = kv.register(MODEL)
                for n in range(1, 5):
                    kv.write(fp, chain(fp, n), [payload(n, i) for i in range(CHAIN)])
                assert wait_for(lambda: metric(port, "kvstore_tier_blocks") >= before + 2 * CHAIN)
                for n in (0, 1):
                    got = kv.get(fp, chain(fp, n))
                    assert [bytes(v) for v in got] == [payload(n, i) for i in range(CHAIN)]
        finally:
            assert server.stop() == 0
        assert no_arena_left(data_dir)
    finally:
        small_fs.remount("rw")
        remove_shm_files(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
