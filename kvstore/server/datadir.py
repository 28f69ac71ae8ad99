"""One server per data folder, and an arena that never outlives the server that made it.

``DataDir.open(path)`` creates the folder (mode 0700) if needed and takes an exclusive
``flock`` on ``<path>/kvstore.lock``. The kernel drops the lock when the process ends, however
it ends (SIGKILL, OOM kill), so holding it proves that no other live process uses the folder;
a second ``kvstore serve`` on the same folder is refused with the holder's pid.

The folder's `dram` arena is named ``kvstore-<folder id>-<start id>`` in ``/dev/shm``: the
folder id is random, made the first time and kept in ``<path>/arena-id`` (so two folders never
share a name, even across containers that share ``/dev/shm``); the start id is new at every
start (so a client still mapping a dead server's arena sees a different name and re-attaches).
While the lock is held, any arena with this folder's id is a dead predecessor's (``leftovers``):
the builder salvages its committed blocks into `nvme` (``tiers.dram.salvage``, by the arena's
journal; room made there as the spill on close makes it: ``kvstore.store.salvage``), then
``remove_leftovers`` deletes it, so a crash leaks an arena only until the next start on the same
folder and loses none of its acknowledged blocks. An arena whose blocks `nvme` refused (a failed
medium) is kept (``keep``) and salvaged again at the next start.

Thread rules: open and close from one thread. ``close`` releases the lock; call it after the
tiers are closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import FailedPrecondition, InvalidArgument
from tiers.dram import SHM_DIR

log = logging.getLogger(__name__)

LOCK_FILE = "kvstore.lock"
ARENA_ID_FILE = "arena-id"
ARENA_PREFIX = "kvstore-"


@dataclass
class DataDir:
    path: Path
    arena_name: str  # for this start's dram arena
    leftovers: list[str] = field(default_factory=list)  # dead predecessors' arenas, still there
    _lock_fd: int | None = None
    _prefix: str = ""

    @classmethod
    def open(cls, path: str | Path) -> DataDir:
        """Create (if needed) and lock the folder; see the module docstring."""
        folder = Path(path).expanduser()
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not folder.is_dir():
                raise NotADirectoryError(str(folder))
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except (NotADirectoryError, FileExistsError):
            raise InvalidArgument(
                f"data_dir {folder} cannot be a folder: it or a folder above it is a file; "
                "give --data-dir another path"
            ) from None
        except PermissionError:
            raise InvalidArgument(
                f"data_dir {folder} is not writable by this user; give --data-dir a folder you own"
            ) from None
        except OSError as exc:
            raise InvalidArgument(f"data_dir {folder} cannot be used: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise FailedPrecondition(
                f"data_dir {folder} is in use by another kvstore process"
                + (f" (pid {holder})" if holder else "")
                + "; stop it first, or give this one another --data-dir"
            ) from None
        with contextlib.suppress(OSError):  # the pid is for the message above; a full disk has no room
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        folder_id = _folder_id(folder)
        data_dir = cls(folder, f"{ARENA_PREFIX}{folder_id}-{secrets.token_hex(4)}", _lock_fd=fd)
        data_dir._prefix = f"{ARENA_PREFIX}{folder_id}-"
        data_dir.leftovers = [n for n in _files_with(data_dir._prefix) if "." not in n]
        return data_dir

    def remove_leftovers(self, keep: Sequence[str] = ()) -> None:
        """Delete the dead predecessors' arenas and their journals, but those in ``keep`` (their
        salvage is not done: the next start tries again)."""
        for name in _files_with(self._prefix):
            if name.startswith(self.arena_name) or name.split(".")[0] in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                if "." not in name:
                    log.warning("removed arena /dev/shm/%s left behind by a kvstore process that died", name)
        self.leftovers = []

    def close(self) -> None:
        """Release the lock; idempotent."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)
            self._lock_fd = None


def _read_pid(fd: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    return 0


def _folder_id(folder: Path) -> str:
    path = folder / ARENA_ID_FILE
    with contextlib.suppress(FileNotFoundError, ValueError):
        text = path.read_text().strip()
        if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
            return text
    folder_id = secrets.token_hex(8)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(folder_id + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # a full or read-only disk: an id of the folder itself, kept by its inode
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        stat = folder.stat()
        folder_id = hashlib.blake2b(f"{stat.st_dev}:{stat.st_ino}".encode(), digest_size=8).hexdigest()
        log.warning("cannot write %s (%s); naming the arena after the folder instead", path, exc.strerror)
    return folder_id


def _files_with(prefix: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_shm_files(path: str | Path) -> list[str]:
    """Remove the arenas and journals in /dev/shm of a data folder no process holds, before the
    folder itself is deleted (after which nothing could name them); the names removed."""
    folder = Path(path)
    try:
        folder_id = (folder / ARENA_ID_FILE).read_text().strip()
        fd = os.open(folder / LOCK_FILE, os.O_RDWR)
    except OSError:
        return []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return []  # a live server's: not ours to remove
    finally:
        os.close(fd)
    removed = []
    for name in _files_with(f"{ARENA_PREFIX}{folder_id}-"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    return removed
