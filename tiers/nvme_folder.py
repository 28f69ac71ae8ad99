"""The folder an ``nvme`` tier owns: its owner lock and its unclean-shutdown marker.

    lock_folder(folder)          -> an open file holding an exclusive flock; close it to release.
                                    Raises TierUnavailable when another process holds it.
    read_marker(folder)          -> the marker a previous owner left (None after a clean close)
    write_marker(folder, dirty)     replaces the marker durably (fsync, rename, fsync the folder)
    remove_marker(folder)           records a clean close
    wipe_environment(folder)        deletes the LMDB files, nothing else
    warn_if_disk_short(folder, n)   logs when the file system cannot hold an n-byte map

The marker holds ``boot_id`` (the kernel's id of the current boot) and ``dirty`` (commits may
exist that were never synced). A marker that survives to the next open says the previous owner
did not close cleanly; a dirty one from another boot says its unsynced pages may be torn.

Threads: these are plain functions over files; the tier calls write_marker from its writer
thread only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import IO

from tiers.errors import TierUnavailable

log = logging.getLogger(__name__)

LOCK_FILE = "kvstore-nvme.lock"
MARKER_FILE = "kvstore-nvme.unclean"
LMDB_FILES = ("data.mdb", "lock.mdb")
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def lock_folder(folder: Path) -> IO[bytes]:
    """Hold an exclusive flock on the folder's lock file for the tier's lifetime."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    handle = os.fdopen(fd, "a+b")  # held open until close()
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
    """Replace the marker durably: write, fsync, rename, fsync the folder."""
    tmp = folder / (MARKER_FILE + ".tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
        json.dump({"boot_id": boot_id(), "dirty": dirty, "pid": os.getpid()}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MARKER_FILE)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_marker(folder: Path) -> None:
    (folder / MARKER_FILE).unlink(missing_ok=True)


def wipe_environment(folder: Path) -> None:
    for name in LMDB_FILES:
        (folder / name).unlink(missing_ok=True)


def warn_if_disk_short(folder: Path, map_size: int) -> None:
    data = folder / "data.mdb"
    held = data.stat().st_blocks * 512 if data.exists() else 0
    free = shutil.disk_usage(folder).free
    if free + held < map_size:
        log.warning(
            "nvme tier %s: map of %d bytes but only %d bytes free on its file system; "
            "a full disk faults (SIGBUS) under writemap",
            folder,
            map_size,
            free + held,
        )
