"""The audit log fails closed: a real ``kvstore serve`` whose audit log sits on a full file system
(a 1 MiB tmpfs, filled) refuses deletes, invalidations, demotions and shreds, and does none of
them; with room again they go through, each recorded before it took effect. A torn tail (a crash
mid-record, a full disk) is detected and skipped when the log is read."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.errors import AuditNotWritten, FailedPrecondition
from kvstore.keys import Fingerprint
from kvstore.server.audit import AuditLog, read_audit
from kvstore.server.datadir import remove_shm_files
from tests.service_fixtures import MODEL, blocks_for, chain


def fill(folder: Path) -> Path:
    """A file that takes every free byte of ``folder``'s file system."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\0" * 4096
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                chunk = chunk[: len(chunk) // 2]
                if not chunk:
                    return filler
    finally:
        os.close(fd)


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A 1 MiB tmpfs of its own (root only)."""
    mount = Path(tempfile.mkdtemp(prefix="kvaudit-", dir="/tmp"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a small tmpfs for the audit log (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()


def test_admin_actions_are_refused_and_not_done_while_the_audit_log_cannot_be_written(small_fs: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))  # short: Unix socket paths are short
    log_path = small_fs / "audit.log"
    settings = {
        "dram.capacity_bytes": "4MiB",
        "dram.page_bytes": "1MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "64MiB",
        "nvme.encryption_keys_dir": str(folder / "keys"),
        "server.audit_log": str(log_path),
        "store.write_through": "true",  # sealed into nvme as stored: a key file, and nothing audited yet
    }
    server = None
    try:
        server = ServerProcess(settings, folder)
        with connect(server.unix) as kv:  # the Unix socket's tenant "local", an admin
            fp = Fingerprint(kv.register(MODEL))
            keys = chain(40, salt="audited-full-disk")
            kv.put(fp, keys, blocks_for(keys))
            key_file = folder / "keys" / f"{b't/local'.hex()}.key"
            assert key_file.exists() and log_path.stat().st_size == 0
            filler = fill(small_fs)  # no room, not even in the log's last page (it has none)

            refused = 0
            for key in keys[1:]:  # each a delete of its own, as a client deleting blocks sends them
                with pytest.raises(AuditNotWritten, match=r"refused and not done.*No space left"):
                    kv.delete(fp, [key])
                refused += 1
            with pytest.raises(AuditNotWritten, match="make room there"):
                kv.invalidate(fp)
            with pytest.raises(FailedPrecondition, match="audit record"):
                kv.demote("dram")
            with pytest.raises(AuditNotWritten):
                kv.shred("local")
            assert refused == 39
            assert kv.exists(fp, keys) == [True] * 40  # none of it happened
            assert len(kv.get(fp, keys)) == 40 and key_file.exists()
            assert read_audit(log_path).skipped == 0  # no torn record left behind either

            filler.unlink()
            assert kv.delete(fp, keys[39:]) == 1
            assert kv.invalidate(fp) == 39
            assert kv.exists(fp, keys) == [False] * 40
        read = read_audit(log_path)
        assert read.skipped == 0
        assert [(a["action"], a["phase"], a["outcome"]) for a in read.actions] == [
            ("delete", "done", 1),
            ("invalidate", "done", 39),
        ]
        assert read.actions[0]["key_hashes"] == [keys[39].hex()]
    finally:
        if server is not None:
            server.stop()
        remove_shm_files(folder)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_torn_tail_is_skipped_when_read_and_the_next_record_starts_whole(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = AuditLog(str(path))
    for n in range(3):
        with audit.action("ops", "invalidate", namespace=f"t/tenant-{n}") as done:
            done(n)
    audit.close()
    whole = path.read_bytes()
    assert read_audit(path).skipped == 0 and len(read_audit(path).actions) == 3

    os.truncate(path, len(whole) - 20)  # a crash part way through the last record (the 3rd done)
    read = read_audit(path)
    assert read.skipped == 1
    assert [(a["namespace"], a["phase"]) for a in read.actions] == [
        ("t/tenant-0", "done"),
        ("t/tenant-1", "done"),
        ("t/tenant-2", "intent"),  # attempted; its outcome was lost with the torn line
    ]

    audit = AuditLog(str(path))  # the restart appends after the torn tail, on a line of its own
    with audit.action("ops", "delete", namespace="t/tenant-3", keys=[b"\1" * 32]) as done:
        done(1)
    audit.close()
    read = read_audit(path)
    assert read.skipped == 1
    assert [a["namespace"] for a in read.actions] == ["t/tenant-0", "t/tenant-1", "t/tenant-2", "t/tenant-3"]
    assert read.actions[-1]["outcome"] == 1 and read.actions[-1]["keys"] == 1

    damaged = path.read_bytes().replace(b'"t/tenant-1"', b'"t/tenant-9"', 1)  # a changed byte
    path.write_bytes(damaged)
    assert read_audit(path).skipped == 2

    shown = subprocess.run(
        [sys.executable, "-m", "kvstore", "audit", "--file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert [json.loads(line)["namespace"] for line in shown.stdout.splitlines()] == [
        "t/tenant-0",
        "t/tenant-1",  # its done record alone: the intent is the damaged line
        "t/tenant-2",
        "t/tenant-3",
    ]
    assert shown.stderr.strip() == "2 torn or damaged records skipped"
