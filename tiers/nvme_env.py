"""Opening an ``nvme`` tier's LMDB environment: its flags, and the crash policy applied at open.

    open_env(folder, config) -> OpenedEnv(env, headers, payloads, found)
        ``found``: every key of the ``headers`` database with its parsed header (None where the
        header does not parse); the tier rebuilds its index from it. Raises TierCorrupt when
        the policy below says an operator should look first.

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

After an unclean shutdown (the marker is present) an environment LMDB cannot open is
discarded with a warning in "cache" mode; in "durable" mode, or after a clean close, it raises
TierCorrupt: an operator should look before data is thrown away.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import lmdb

from tiers import nvme_folder
from tiers.base import BlockHeader, TierKey
from tiers.errors import TierCorrupt

if TYPE_CHECKING:
    from tiers.nvme import NvmeConfig

log = logging.getLogger("tiers.nvme")  # the tier's name: its logs stay under one logger

Found = tuple[TierKey, BlockHeader | None]  # a key in the header database; None: unreadable


class OpenedEnv(NamedTuple):
    env: lmdb.Environment
    headers: lmdb._Database
    payloads: lmdb._Database
    found: list[Found]


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
        nvme_folder.wipe_environment(folder)
    try:
        return _open_lmdb(folder, config)
    except lmdb.Error as exc:
        if marker is None or not cache_mode:
            raise TierCorrupt(f"nvme tier {folder} cannot be opened: {exc}") from exc
        log.warning("nvme tier %s: unreadable after an unclean shutdown (%s); starting empty", folder, exc)
        nvme_folder.wipe_environment(folder)
    try:
        return _open_lmdb(folder, config)
    except lmdb.Error as exc:
        raise TierCorrupt(f"nvme tier {folder} cannot be opened: {exc}") from exc


def _open_lmdb(folder: Path, config: NvmeConfig) -> OpenedEnv:
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
        max_readers=512,
        max_spare_txns=16,
        mode=0o600,
    )
    try:
        headers = env.open_db(b"headers")
        payloads = env.open_db(b"payloads")
        found = _scan_headers(env, headers)
        # A killed owner may have left its commits only in the page cache: sync them
        # before the marker calls the folder clean.
        env.sync(True)
        nvme_folder.write_marker(folder, dirty=False)
    except BaseException:
        env.close()
        raise
    return OpenedEnv(env, headers, payloads, found)


def _scan_headers(env: lmdb.Environment, headers: lmdb._Database) -> list[Found]:
    """Every key of the header database with its parsed header; payload pages stay cold."""
    with env.begin(db=headers, buffers=True) as txn:
        return [(TierKey(bytes(key)), BlockHeader.unpack(raw)) for key, raw in txn.cursor()]
