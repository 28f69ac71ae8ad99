"""Assemble a tiered store from ``Settings``: the one place that knows the tier order.

``open_store`` locks the data folder (``kvstore.server.datadir``: one process per folder), salvages a
dead predecessor's arena into `nvme` (``kvstore.store.salvage``) and removes it unless `nvme`
refused some of its blocks, builds the tiers and hands the store the lock to release when it
closes. A failure part way closes what was already built, arena included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from kvstore.errors import FailedPrecondition
from kvstore.extras import require
from kvstore.secret_files import read_secret_file
from kvstore.server.config import Settings, enum_name
from kvstore.server.datadir import DataDir
from kvstore.store import TieredStore, namespace_of_tier_key
from kvstore.store.invalidations import MARK_FINGERPRINT
from kvstore.store.model import Block, StoreConfig, shared_key_name
from kvstore.store.salvage import Salvage
from tiers import Codec, Tier, TierError, TierUnavailable
from tiers.cipher import BlockCipher  # cryptography itself is imported when one is made
from tiers.dram import DramTier, salvage
from tiers.errors import ArenaNoRoom, MediumNoRoom
from tiers.nvme_room import is_no_room
from tiers.remote import RemoteTier
from tiers.sealed_remote import SealedRemote
from tiers.throttle import Throttled

log = logging.getLogger(__name__)


def build_tiers(
    settings: Settings, data_dir: DataDir | None = None, indexed: dict[int, list[Block]] | None = None
) -> tuple[list[Tier], list[str]]:
    """The configured tiers, fastest first, and a line for each configured tier that is absent.
    With ``data_dir``, the arena takes its name and keeps a journal, and the blocks of a dead
    predecessor's arena are salvaged into `nvme` first; ``indexed`` then gets what the salvage's
    index of `nvme` holds, at nvme's position, for the store to take over (``TieredStore``'s
    ``indexed``). On an error, the tiers built so far are closed before it propagates."""
    require_extras(settings)
    built: list[Tier] = []
    try:
        return _build_tiers(settings, data_dir, built, {} if indexed is None else indexed)
    except BaseException:
        for tier in built:
            with contextlib.suppress(Exception):
                tier.close()
        raise


def require_extras(settings: Settings) -> None:
    """The library of each configured optional feature is installed (``kvstore.extras``):
    checked before anything is opened, so a missing one is one line at start, nothing made."""
    if settings.hbm.enabled:
        require("torch", "hbm.enabled = true")
    if settings.nvme.enabled and settings.nvme.encryption_keys_dir:
        require("cryptography", "nvme.encryption_keys_dir")
    if settings.nvme.enabled and settings.nvme.codec is not Codec.NONE:
        require("zstandard", f"nvme.codec = {enum_name(settings.nvme.codec)}")
    if settings.remote.backend == "redis":
        require("redis", "remote.backend = redis")


def _build_tiers(
    settings: Settings, data_dir: DataDir | None, built: list[Tier], indexed: dict[int, list[Block]]
) -> tuple[list[Tier], list[str]]:
    absent: list[str] = []
    hbm: Tier | None = None
    if settings.hbm.enabled:
        from tiers.hbm import HbmTier

        try:
            hbm = HbmTier(settings.hbm)
            built.append(hbm)
        except TierUnavailable as exc:
            absent.append(f"hbm: {exc}")
    else:
        absent.append("hbm: disabled in the configuration ([hbm] enabled = false)")
    # nvme before dram: a dead predecessor's arena is salvaged into it before the new arena
    # takes its room in /dev/shm.
    nvme = _nvme(settings, absent) if settings.nvme.enabled else None
    if nvme is not None:
        built.append(nvme)
    elif not settings.nvme.enabled:
        absent.append("nvme: disabled in the configuration ([nvme] enabled = false)")
    changed: list[int] = []  # blocks a salvage found changed since their commit, per arena
    into: list[Salvage] = []  # nvme indexed once, at the first arena with blocks to salvage
    if data_dir is not None:
        kept = [
            name for name in data_dir.leftovers if not _salvage(name, nvme, settings.store, changed, into)
        ]
        data_dir.remove_leftovers(keep=kept)
    arena_name = data_dir.arena_name if data_dir is not None else None
    try:
        dram = DramTier(settings.dram, arena_name, gpu_copies=hbm is not None)
    except ArenaNoRoom as exc:
        raise FailedPrecondition(
            f"{exc}: lower dram.capacity_bytes (e.g. --set dram.capacity_bytes=32MiB) or give "
            f"{exc.folder} more room (docker run --shm-size=..., or a memory-backed volume in a pod)"
        ) from None
    except TierUnavailable as exc:
        raise FailedPrecondition(f"the dram tier cannot start: {exc}") from None
    built.append(dram)
    dram.count_checksum_failures(sum(changed))  # the arena's checksum failures, its predecessor's included
    tiers = [t for t in (hbm, dram, nvme) if t is not None]
    if into and into[0].trusted and nvme is not None:
        indexed[tiers.index(nvme)] = into[0].held()
    throttles = {"hbm": settings.hbm.throttle_bytes_per_s, "dram": settings.dram.throttle_bytes_per_s}
    throttles["nvme"] = settings.nvme.throttle_bytes_per_s
    return [Throttled(t, throttles[t.name]) if throttles.get(t.name) else t for t in tiers], absent


def _cipher(keys_dir: str) -> BlockCipher | None:
    if not keys_dir:
        return None
    try:
        return BlockCipher(keys_dir, namespace_of_tier_key)
    except OSError as exc:
        raise FailedPrecondition(f"nvme.encryption_keys_dir {keys_dir}: {exc.strerror or exc}") from None


def _sealed(remote: RemoteTier | None, tiers: list[Tier], keys_dir: str) -> RemoteTier | None:
    """The remote tier, its copies sealed under the nvme tier's cipher (the same keys, so a
    shred reaches them) when encryption is on: no plaintext copy leaves the host. With
    encryption on and no nvme tier to hold the cipher (off, or no room at start), no remote
    tier either, rather than plaintext copies."""
    for tier in tiers:
        cipher: BlockCipher | None = getattr(getattr(tier, "inner", tier), "cipher", None)
        if remote is not None and cipher is not None:
            return SealedRemote(remote, cipher, plain=frozenset([MARK_FINGERPRINT]))
    if remote is not None and keys_dir:
        log.warning(
            "remote tier off: encryption is on but the nvme tier is not, so its copies cannot be sealed"
        )
        remote.close()
        return None
    return remote


def _nvme(settings: Settings, absent: list[str]) -> Tier | None:
    """The nvme tier; None, said in one line and in ``absent``, where its file system is full
    or read-only and holds no environment to serve (one that opens there is served read-only)."""
    from tiers.nvme import NvmeTier

    try:
        # the section with its folder resolved under data_dir: the one field set at start
        config = dataclasses.replace(settings.nvme, path=str(settings.nvme_path))
        return NvmeTier(config, cipher=_cipher(config.encryption_keys_dir))
    except (MediumNoRoom, OSError) as exc:
        if isinstance(exc, OSError) and not is_no_room(exc):
            raise FailedPrecondition(f"the nvme tier at {settings.nvme_path} cannot start: {exc}") from None
        log.warning("nvme tier off: %s; serving without it until a restart finds room", exc)
        absent.append(f"nvme: off, {exc}")
        return None
    except TierError as exc:
        raise FailedPrecondition(f"the nvme tier at {settings.nvme_path} cannot start: {exc}") from None


def _salvage(
    arena_name: str,
    nvme: Tier | None,
    config: StoreConfig,
    changed: list[int] | None = None,
    into: list[Salvage] | None = None,
) -> bool:
    """Copy the committed blocks of a dead server's arena into `nvme` (by its journal), room
    made there as the spill on close makes it (``kvstore.store.salvage``); whether the arena may
    go. One it must keep still holds acknowledged blocks found nowhere else. ``changed`` gets
    the count of blocks dropped for failing the checksum they were committed with; ``into``
    holds the one ``Salvage`` of `nvme` every arena shares (made here at the first)."""
    with salvage(arena_name) as blocks:
        if not blocks:
            return True
        if nvme is None:
            log.warning(
                "a killed server left %d blocks in arena %s; without an nvme tier they are dropped",
                len(blocks),
                arena_name,
            )
            return True
        try:
            into = [] if into is None else into
            if not into or not into[0].trusted:  # a failed salvage leaves nvme's contents unknown
                into[:] = [Salvage(nvme, config)]
            result = into[0].into(blocks)
        except TierError as exc:
            log.warning(
                "salvage of arena %s failed (%s): arena kept with its %d blocks; the next start tries again",
                arena_name,
                exc,
                len(blocks),
            )
            return False
    log.warning(
        "a killed server left %d blocks in arena %s: %d copied to nvme (%d of its blocks evicted for "
        "room), %d were there already, %d unnamed dropped, %d changed since their commit dropped",
        result.blocks,
        arena_name,
        result.copied,
        result.evicted,
        result.present,
        result.unnamed,
        result.changed,
    )
    if changed is not None:
        changed.append(result.changed)
    if not result.complete:
        log.warning(
            "arena %s kept: nvme refused %d of its blocks, found nowhere else; the next start tries again",
            arena_name,
            result.refused,
        )
    return result.complete


def build_remote(settings: Settings) -> RemoteTier | None:
    """The fleet's shared tier under the local ones (``[remote]``), or None when there is none.
    Nothing is contacted here: a shared store that is down at start reads as misses."""
    r = settings.remote
    try:
        if r.backend == "redis":
            from tiers.redis_cluster import RedisClusterTier

            password = read_secret_file(r.password_file, "remote.password_file") if r.password_file else ""
            return RedisClusterTier(r, password, key_name=shared_key_name)
        if r.backend == "mooncake":
            try:
                import mooncake.store  # noqa: F401 - only whether it is there
            except ImportError:
                raise FailedPrecondition(
                    "remote.backend = mooncake needs the mooncake extra: pip install 'kvstore[mooncake]'"
                ) from None
            from tiers.mooncake import MooncakeTier

            return MooncakeTier(r, key_name=shared_key_name)
        if r.backend == "kvstore":
            from kvstore.remote.nodes import KvStoreNodesTier

            return KvStoreNodesTier(r)
        return None
    except ValueError as exc:
        raise FailedPrecondition(f"[remote]: {exc}") from None


def open_store(settings: Settings, data_dir: DataDir | None = None) -> TieredStore:
    """A store over the configured tiers; the persistent ones are indexed from disk. The data
    folder stays locked until the store closes: ``data_dir``, when the caller locked it first,
    is the store's from here on (closed with it, or on a failure here)."""
    if data_dir is None:
        data_dir = DataDir.open(settings.data_dir)
    indexed: dict[int, list[Block]] = {}  # what a salvage indexed already: not scanned again
    try:
        require_extras(settings)
        tiers, absent = build_tiers(settings, data_dir, indexed)
    except BaseException:
        data_dir.close()
        raise
    try:
        remote = _sealed(build_remote(settings), tiers, settings.nvme.encryption_keys_dir)
        return TieredStore(
            tiers,
            settings.store,
            absent_tiers=absent,
            indexed=indexed,
            on_close=data_dir.close,
            remote=remote,
            remote_queue_bytes=settings.remote.queue_bytes,
            invalidation_poll_s=settings.remote.invalidation_poll_s,
            # where this sidecar's fleet invalidations stopped: kept beside its nvme
            invalidation_record=data_dir.path / "invalidation-ledger.json",
        )
    except BaseException:
        for tier in tiers:
            with contextlib.suppress(Exception):
                tier.close()
        data_dir.close()
        raise
