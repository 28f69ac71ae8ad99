"""Room on the file system for an ``nvme`` tier's LMDB files, reserved before LMDB writes into it.

Under writemap LMDB writes its pages through a shared mapping of ``data.mdb``, a sparse file as
long as the map, and its reader table through a mapping of ``lock.mdb``. A page the file system
cannot back (full, over quota) turns such a write into SIGBUS, which kills the process with no
log line (measured: a 64 MiB ext4 loop mount and a 64 MiB tmpfs, both dead within half a
second of writing). So no page is written through a mapping before its blocks are allocated:

    prepare_lock_file(folder)       before lmdb.open: lock.mdb allocated whole (LMDB keeps a
                                    lock file at least as large as it needs)
    DiskRoom(folder, map_size_bytes, page_bytes)
      .ensure(end_bytes)            before a commit that could write pages up to ``end_bytes``:
                                    data.mdb allocated that far (posix_fallocate, STEP_BYTES
                                    ahead so that most commits cost a comparison); raises
                                    NoRoom when the file system cannot
      .commit_end(env, stored_bytes, ops)  how far a commit of that many bytes and operations
                                    can write: past LMDB's last page, the values' pages plus
                                    a copied B-tree path per operation (an upper bound: LMDB
                                    takes freed pages first)

Why not drop writemap instead (a full disk is then ENOSPC from write(2)): an A/B of raw LMDB
here, 256 MiB in batches of 64 values, the final sync counted, median of five interleaved
runs: 2 MiB values 1.05 GB/s with writemap, 1.04 with writemap and this reservation, 0.38
without writemap; 256 KiB 0.73 / 0.78 / 0.59 GB/s. Dropping it would cost 20-60%. What the
reservation itself costs (ext4 here): ``env.info()`` 9 us a commit, ``posix_fallocate`` of the
next 64 MiB 0.05 ms; the nvme write rows of ``kvstore bench tiers`` with and without it differ
by less than their run-to-run noise on this shared disk (ratios to raw LMDB 0.3-1.05 either way).

An ext4 remounted read-only on an error (errors=remount-ro) does not fault mapped writes on this
kernel (6.18, measured with trigger_fs_error): they fail at the sync, which the writer reports.

Threads: DiskRoom belongs to the writer thread; prepare_lock_file runs before it starts.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb

STEP_BYTES = 64 << 20  # reserved ahead of need, so that a commit rarely calls fallocate
PATH_PAGES = 16  # pages one put or delete may copy: two trees' paths (depth <= 4) and splits
MARGIN_BYTES = 1 << 20  # the free-page list and the meta bookkeeping of a commit
LOCK_BYTES = 128 << 10  # lock.mdb for 512 readers is 33 KiB (64 B a reader slot)
# The errors that say the medium has no room or takes no writes: the tier degrades, not dies.
# How often a degraded writer looks for room again.
PROBE_S = 1.0
# Room a degraded writer asks for before it takes writes again: a few blocks' worth, not a
# batch (32 MiB would keep a small disk degraded for good); a batch finding less commits what fits.
PROBE_BYTES = 8 << 20
# Reserved past what a put commit needs, so that deletes still commit once puts find no room.
DELETE_ROOM_BYTES = 8 << 20
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


class NoRoom(Exception):
    """The file system cannot back the pages a commit needs; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_no_room(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError or an LMDB error) says the medium is full or read-only."""
    if isinstance(exc, OSError):
        return exc.errno in NO_ROOM_ERRNOS
    if isinstance(exc, lmdb.DiskError | lmdb.ReadonlyError):
        return True
    text = str(exc)
    return any(os.strerror(code) in text for code in NO_ROOM_ERRNOS)


def read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def prepare_lock_file(folder: Path) -> None:
    """Allocate lock.mdb before LMDB maps it; raises OSError (ENOSPC, EROFS) when it cannot
    and the file is not already as large."""
    path = folder / "lock.mdb"
    try:
        if path.stat().st_blocks * 512 >= LOCK_BYTES:
            return  # allocated by an earlier start: a full disk still opens
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, LOCK_BYTES)
    finally:
        os.close(fd)


class DiskRoom:
    """The allocated length of data.mdb; see the module docstring."""

    def __init__(self, folder: Path, map_size_bytes: int, page_bytes: int) -> None:
        self._path = folder / "data.mdb"
        self._map_size = map_size_bytes
        self._page = page_bytes
        self._reserved = 0  # bytes from the start of data.mdb known to be allocated

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def commit_end(self, env: lmdb.Environment, stored_bytes: int, ops: int) -> int:
        pages = env.info()["last_pgno"] + 1
        return pages * self._page + stored_bytes + ops * (PATH_PAGES * self._page + 64) + MARGIN_BYTES

    def ensure(self, end_bytes: int) -> None:
        end = min(end_bytes, self._map_size)  # past the map LMDB raises MapFullError, no fault
        if end <= self._reserved:
            return
        if read_only(self._path.parent):
            raise NoRoom("read-only file system")
        try:
            fd = os.open(self._path, os.O_RDWR)
        except OSError as exc:
            raise NoRoom(f"cannot open {self._path} to reserve room: {exc.strerror}") from exc
        try:
            for target in (min(end + STEP_BYTES, self._map_size), end):  # ahead, else just enough
                try:
                    os.posix_fallocate(fd, 0, target)
                except OSError as exc:
                    if not is_no_room(exc) or target == end:
                        raise NoRoom(f"cannot reserve {end} bytes of {self._path}: {exc.strerror}") from exc
                    continue
                self._reserved = target
                return
        finally:
            os.close(fd)
