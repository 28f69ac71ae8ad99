"""Opening an ``nvme`` tier's LMDB environment: its flags, and the crash policy applied at open.

    open_env(folder, config) -> OpenedEnv(env, headers, payloads, found, no_room, damaged_to)
        ``found``: every key of the ``headers`` database with its parsed header (None where the
        header does not parse); the tier rebuilds its index from it. ``no_room``: why writes
        are off from the start (None: they are not). ``damaged_to``: where a damaged
        environment was moved (None: none was). Raises MediumNoRoom or TierCorrupt.

The caller holds the folder's lock (``nvme_folder.lock_folder``) and calls open_env once, before
its writer thread starts; the environment is then the caller's to close. On return everything
in the environment is synced and the unclean marker says clean.

Flags, measured on this 2-core machine with a throwaway script (2 MiB values, 16 per write
transaction, 512 MiB per run, two runs): default flags 385-404 MB/s; writemap + map_async +
sync=False + metasync=False 1.82-1.84 GB/s into the page cache (780-830 MB/s counting a final
sync); sync=True + metasync=True 590-675 MB/s with writemap, 490-530 MB/s without. So both
modes use writemap; they differ in when data reaches the disk:

    "cache"    writemap, map_async, sync=False, metasync=False; the writer calls
               env.sync(True) every ``sync_interval_s`` while there are unsynced commits.
    "durable"  writemap, sync=True, metasync=True: every commit is on disk when it returns.

What a crash loses:

    process crash (SIGKILL), either mode: only the puts still queued. Committed pages live in
        the kernel's page cache (a shared file mapping) and reach the disk without us.
    power loss or kernel crash, "durable": only the puts still queued (given a disk that
        honours flushes).
    power loss or kernel crash, "cache": every commit since the last sync, and possibly the
        whole B-tree: without sync the disk may keep pages of later transactions but not the
        meta page, or the reverse. The marker guards this: the writer marks it dirty (fsynced)
        before the first commit after a sync and clean after the sync. An open that finds a
        dirty marker from an earlier boot discards the environment and starts empty (the
        folder is a cache); a clean marker means the last sync covered every commit.

A damaged environment (LMDB cannot open it, or its trees cannot be walked: pages scribbled
between two starts, say) is moved aside to ``<folder>.damaged-<time>`` (kept for an operator to
look at, named in one log line, ``damaged_to``) and the tier starts empty, in either mode.
Blocks it does not detect as damage are still checked on every read (xxh3 of each block).

A full or read-only file system is not damage (``tiers.nvme_room``): an existing environment is
opened and served with writes off (``no_room`` says why; read-only when the file system is),
and one that cannot even be created raises MediumNoRoom: the server then starts without the tier.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import NamedTuple

import lmdb

from tiers import nvme_folder, nvme_room
from tiers.base import BlockHeader, TierKey
from tiers.errors import MediumNoRoom, TierCorrupt
from tiers.nvme_config import NvmeConfig

log = logging.getLogger("tiers.nvme")  # the tier's name: its logs stay under one logger

MAX_READERS = 512  # reader slots of lock.mdb (64 B each: nvme_room.LOCK_BYTES holds them)
Found = tuple[TierKey, BlockHeader | None]  # a key in the header database; None: unreadable


class OpenedEnv(NamedTuple):
    env: lmdb.Environment
    headers: lmdb._Database
    payloads: lmdb._Database
    found: list[Found]
    no_room: str | None = None
    damaged_to: Path | None = None


def open_env(folder: Path, config: NvmeConfig) -> OpenedEnv:
    """Open the environment and read every header, applying the crash policy."""
    cache_mode = config.durability == "cache"
    marker = nvme_folder.read_marker(folder)
    this_boot = nvme_folder.boot_id()
    rebooted = marker is not None and (not this_boot or marker.get("boot_id") != this_boot)
    if cache_mode and marker is not None and marker.get("dirty") and rebooted:
        log.warning(
            "nvme tier %s: unsynced writes before a power loss or OS crash; discarding the cache", folder
        )
        try:
            nvme_folder.wipe_environment(folder)
        except OSError as exc:
            raise MediumNoRoom(f"nvme tier {folder}: cannot discard its torn cache: {exc.strerror}") from exc
    try:
        return _open_lmdb(folder, config)
    except lmdb.Error as exc:
        if nvme_room.is_no_room(exc) or nvme_room.read_only(folder):
            raise MediumNoRoom(f"nvme tier {folder} cannot be opened: {exc}") from exc
        damaged_to = nvme_folder.move_aside(folder)
        log.warning(
            "nvme tier %s: its LMDB environment is damaged (%s); moved it to %s for inspection "
            "and starting with an empty nvme tier",
            folder,
            exc,
            damaged_to,
        )
    try:
        return _open_lmdb(folder, config)._replace(damaged_to=damaged_to)
    except lmdb.Error as exc:
        if nvme_room.is_no_room(exc):
            raise MediumNoRoom(f"nvme tier {folder} cannot be created: {exc}") from exc
        raise TierCorrupt(f"nvme tier {folder} cannot be opened: {exc}") from exc


def reopen_env(folder: Path, config: NvmeConfig) -> OpenedEnv:
    """The environment of a tier that had it open read-only (and has closed it), once its file
    system takes writes again: writable where it opens so, else read-only again. Never moved
    aside: it was read a moment ago."""
    try:
        return _open_lmdb(folder, config)
    except (lmdb.Error, MediumNoRoom, OSError) as exc:
        log.warning("nvme tier %s: cannot open it writable (%s); read-only again", folder, exc)
        return _open_read_only(folder, config)


def _open_lmdb(folder: Path, config: NvmeConfig) -> OpenedEnv:
    if nvme_room.read_only(folder):
        return _open_read_only(folder, config)
    try:
        nvme_room.prepare_lock_file(folder)  # its reader table is written through a mapping
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return _open_read_only(folder, config)
        raise MediumNoRoom(f"nvme tier {folder}: no room for lock.mdb: {exc.strerror}") from exc
    durable = config.durability == "durable"
    map_size = config.effective_map_size_bytes
    nvme_folder.warn_if_disk_short(folder, map_size)
    env = lmdb.open(
        str(folder),
        map_size=map_size,
        max_dbs=2,
        writemap=True,
        map_async=not durable,
        sync=durable,
        metasync=durable,
        max_readers=MAX_READERS,
        max_spare_txns=16,
        mode=0o600,
    )
    no_room: str | None = None
    try:
        headers = env.open_db(b"headers")
        payloads = env.open_db(b"payloads")
        found = _scan(env, headers, payloads)
        # A killed owner may have left its commits only in the page cache: sync them
        # before the marker calls the folder clean.
        env.sync(True)
        try:
            nvme_folder.write_marker(folder, dirty=False)
        except OSError as exc:
            if not nvme_room.is_no_room(exc):
                raise
            no_room = f"no room for its marker file: {exc.strerror}"
    except BaseException:
        env.close()
        raise
    return OpenedEnv(env, headers, payloads, found, no_room)


def _open_read_only(folder: Path, config: NvmeConfig) -> OpenedEnv:
    """An environment on a read-only file system, for reads only (LMDB then keeps no lock
    file). One that does not exist cannot be made: MediumNoRoom."""
    if not (folder / "data.mdb").exists():
        raise MediumNoRoom(f"nvme tier {folder}: read-only file system")
    env = lmdb.open(
        str(folder),
        map_size=config.effective_map_size_bytes,
        max_dbs=2,
        readonly=True,
        max_readers=MAX_READERS,
        max_spare_txns=16,
    )
    try:
        headers = env.open_db(b"headers", create=False)
        payloads = env.open_db(b"payloads", create=False)
        found = _scan(env, headers, payloads)
    except lmdb.NotFoundError as exc:  # made but never written
        env.close()
        raise MediumNoRoom(f"nvme tier {folder}: read-only file system") from exc
    except BaseException:
        env.close()
        raise
    return OpenedEnv(
        env, headers, payloads, found, "read-only file system (writes resume once it is writable)"
    )


def _scan(env: lmdb.Environment, headers: lmdb._Database, payloads: lmdb._Database) -> list[Found]:
    """Every key of the header database with its parsed header. The payload tree is walked
    too, its keys only (no value page is touched): a damaged branch or leaf page in either
    tree raises here, at open, rather than in a read."""
    with env.begin(buffers=True) as txn:
        found = [(TierKey(bytes(key)), BlockHeader.unpack(raw)) for key, raw in txn.cursor(db=headers)]
        for _ in txn.cursor(db=payloads).iternext(keys=True, values=False):
            pass
    return found
