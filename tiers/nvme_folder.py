"""The folder an ``nvme`` tier owns: its owner lock and its unclean-shutdown marker.

    lock_folder(folder)          -> an open file holding an exclusive flock; close it to release.
                                    Raises TierUnavailable when another process holds it.
    read_marker(folder)          -> the marker a previous owner left (None after a clean close)
    write_marker(folder, dirty)     replaces the marker durably (fsync, rename, fsync the folder)
    remove_marker(folder)           records a clean close
    wipe_environment(folder)        deletes the LMDB files, nothing else
    move_aside(folder)           -> moves the LMDB files to ``<folder>.damaged-<time>``, kept
    warn_if_disk_short(folder, n)   logs when the file system cannot hold an n-byte map

The marker holds ``boot_id`` (the kernel's id of the current boot) and ``dirty`` (commits may
exist that were never synced). A marker that survives to the next open says the previous owner
did not close cleanly; a dirty one from another boot says its unsynced pages may be torn.

Threads: these are plain functions over files; the tier calls write_marker from its writer
thread only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import IO

from tiers.durable import fsync_dir
from tiers.errors import MediumNoRoom, TierUnavailable

log = logging.getLogger(__name__)

LOCK_FILE = "kvstore-nvme.lock"
MARKER_FILE = "kvstore-nvme.unclean"
LMDB_FILES = ("data.mdb", "lock.mdb")
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def lock_folder(folder: Path) -> IO[bytes]:
    """Hold an exclusive flock on the folder's lock file for the tier's lifetime."""
    handle: IO[bytes]
    try:
        handle = os.fdopen(os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+b")
    except OSError as exc:  # a read-only file system: a flock needs no write access
        if exc.errno != errno.EROFS:
            raise
        try:
            handle = open(folder / LOCK_FILE, "rb")  # noqa: SIM115 - held open until close()
        except FileNotFoundError:
            raise MediumNoRoom(f"nvme folder {folder} is on a read-only file system") from exc
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        handle.close()
        raise TierUnavailable(f"nvme folder {folder} is in use by another process") from exc
    return handle


def boot_id() -> str:
    """This boot's id, or "" when the kernel does not say."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""  # unknown: every dirty marker then looks like a power loss (the safe side)


def read_marker(folder: Path) -> dict[str, object] | None:
    """The previous owner's marker: None after a clean close; dirty when unreadable."""
    try:
        text = (folder / MARKER_FILE).read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {"dirty": True}
    try:
        found = json.loads(text)
    except ValueError:
        return {"dirty": True}  # torn by a crash while being written
    return found if isinstance(found, dict) else {"dirty": True}


def write_marker(folder: Path, *, dirty: bool) -> None:
    """Replace the marker durably: write, fsync, rename, fsync the folder. On a full file
    system (a new file needs a block it cannot have) the marker is overwritten in place
    instead: a write torn by a crash then reads as dirty, the safe side."""
    text = json.dumps({"boot_id": boot_id(), "dirty": dirty, "pid": os.getpid()})
    tmp = folder / (MARKER_FILE + ".tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not _overwrite(folder / MARKER_FILE, text):
            raise
        return
    os.replace(tmp, folder / MARKER_FILE)
    fsync_dir(folder)


def _overwrite(path: Path, text: str) -> bool:
    """Write ``text`` over an existing file's first block, padded to its length (no new block
    needed); whether it could."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        data = text.encode().ljust(size)  # JSON ignores the trailing blanks
        if len(data) > max(size, 512):
            return False
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_marker(folder: Path) -> None:
    (folder / MARKER_FILE).unlink(missing_ok=True)


def wipe_environment(folder: Path) -> None:
    for name in LMDB_FILES:
        (folder / name).unlink(missing_ok=True)


def move_aside(folder: Path) -> Path:
    """Move the LMDB files and the marker into a new sibling folder
    ``<folder>.damaged-<UTC time>`` (the same file system: a rename), kept for inspection."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = folder.with_name(f"{folder.name}.damaged-{stamp}")
    n = 1
    while target.exists():  # two damaged starts in one second
        target = folder.with_name(f"{folder.name}.damaged-{stamp}-{n}")
        n += 1
    target.mkdir(mode=0o700)
    for name in (*LMDB_FILES, MARKER_FILE):
        if (folder / name).exists():
            os.rename(folder / name, target / name)
    return target


def warn_if_disk_short(folder: Path, map_size: int) -> None:
    data = folder / "data.mdb"
    held = data.stat().st_blocks * 512 if data.exists() else 0
    free = shutil.disk_usage(folder).free
    if free + held < map_size:
        log.warning(
            "nvme tier %s: map of %d bytes but only %d bytes free on its file system; "
            "writes to it stop (the tier degrades, reads go on) if it fills",
            folder,
            map_size,
            free + held,
        )
