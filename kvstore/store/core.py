"""The tiered store's facade: the calls every transport uses, each taking the store lock.

Blocks are stored under (scope, key): a ``Scope`` is a namespace (a tenant, or a shared scope a
tenant was granted) plus the model fingerprint. Tiers are ordered fastest first (``hbm``,
``dram``, ``nvme``); the index knows which tiers hold a copy of each block.

Calls and their order:
    lookup(scope, keys)            length of the present prefix and the tier of each hit block
    put(scope, keys, blocks)       store a chain (keys[i-1] is the parent of keys[i])
    get_into_many(scope, keys, outs)  copy blocks into the caller's buffers; None for a miss
    pin(scope, keys, ttl_s)        -> Lease; pinned blocks are never evicted or freed
    release(lease_id)              ends a lease (LeaseNotFound twice, LeaseExpired if late)
    delete(scope, keys) / invalidate(namespace, fingerprint) / demote(tier, ...)
    resolve / reserve / commit / abort   the same-host arena calls (kvstore.store.arena)
    stats()                        counters and per-tier occupancy
    close()                        spill volatile-only blocks to the persistent tier, then close

Placement: new blocks land in the first tier with room (a child never in a faster tier than its
parent); with ``write_through`` the persistent tier gets a copy at once (the put waits for it);
with ``write_behind`` a thread copies each new block there soon after (bounded: a full queue
drops and counts), so a crash loses only what is still queued; otherwise only on demotion and on
a clean close, and, while the arena is nearly full, ahead of demotion (``clean_ahead``, the
cleaner: kvstore.store.cleaner). A hit in a slower tier is promoted to the first tier.

The facade builds the rooms behind it (``parts`` wires the lower ones and says what runs under
the lock) and hands each the others it uses: ``reads`` (lookups, restores), ``writes`` (puts and
what follows a new block), ``arena`` (two-phase same-host calls), ``remote`` (the fleet's
tier), ``behind`` and ``cleaner`` (copies into the disk); deletion, invalidation, demotion,
leases and stats it does itself. Tier errors that escape a call become ``Unavailable`` there,
nowhere else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.keys import BlockKey, Fingerprint
from kvstore.leases import Lease, LeaseTable
from kvstore.store.arena import ArenaCalls
from kvstore.store.behind import CopyDown, PersistBehind
from kvstore.store.changes import BlockChanges
from kvstore.store.cleaner import Cleaner
from kvstore.store.invalidations import MARK_FINGERPRINT, mark_name, mark_value
from kvstore.store.model import (
    Block,
    LookupResult,
    Reservation,
    Resolved,
    Scope,
    StoreConfig,
    StoreStats,
    check_keys,
)
from kvstore.store.pacing import DEMOTE_WAIT_S
from kvstore.store.parts import translated, wire
from kvstore.store.reads import Reads
from kvstore.store.rebuild import rebuild
from kvstore.store.remote import RemoteCalls
from kvstore.store.writes import Writes
from tiers import BytesLike, InPlaceTier, Tier
from tiers.remote import RemoteTier

log = logging.getLogger("kvstore.store")


class TieredStore:
    """See the module docstring. Thread-safe."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        persistent: Sequence[bool] | None = None,
        absent_tiers: Sequence[str] = (),
        on_close: Callable[[], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        remote: RemoteTier | None = None,
        remote_queue_bytes: int = 256 << 20,
        invalidation_poll_s: float = 0.5,
        invalidation_record: Path | None = None,
        indexed: Mapping[int, Sequence[Block]] | None = None,
    ) -> None:
        """``indexed``: per tier position, that tier's blocks as an index built at this start
        already knows them (the salvage's of a dead arena): taken over, not scanned again."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.config = config = config or StoreConfig()
        self.tiers = tiers = list(tiers)
        self.absent_tiers = tuple(absent_tiers)  # "hbm: no CUDA", for logs and stats
        self._on_close = on_close  # after the tiers closed (the builder's data-folder lock)
        self._closed = False
        parts = wire(tiers, config, clock, wall_clock)
        self._lock, self._counts, self._index = parts.lock, parts.counts, parts.index
        self._pins, self._placement, self._expire = parts.pins, parts.placement, parts.expire
        self._pacing = parts.pacing
        self._wall = wall_clock
        rebuild(tiers, config, parts.index, parts.eviction, indexed)
        self._persistent = list(persistent) if persistent is not None else [t.persistent for t in tiers]
        self._persistent_index = next((t for t, p in enumerate(self._persistent) if p), None)
        disk = self._persistent_index
        a = next((i for i, t in enumerate(tiers) if t.as_arena() is not None), None)
        lower = (parts.lock, parts.index, parts.placement, parts.counts)

        def closed() -> bool:
            return self._closed

        write_behind: PersistBehind | None = None
        if config.write_behind and not config.write_through and disk is not None:
            copy = CopyDown(tiers, disk, *lower, "write_behind_blocks", closed)
            write_behind = PersistBehind(copy, parts.counts, config.write_behind_max_bytes)
        self._write_behind = write_behind
        self._cleaner: Cleaner | None = None
        cleans = config.clean_ahead > 0 and not config.write_through
        if cleans and a is not None and disk is not None and disk > a:
            copy = CopyDown(tiers, disk, *lower, "cleaned_blocks", closed)
            self._cleaner = Cleaner(
                tiers[a], a, copy, parts.lock, parts.index, parts.eviction, config.clean_ahead, closed
            )
        self._remote = (
            None
            if remote is None
            else RemoteCalls(
                remote,
                parts.lock,
                parts.counts,
                parts.index,
                parts.pins,
                parts.placement,
                parts.governance,
                wall_clock,
                self._put_local,
                remote_queue_bytes,
                invalidation_poll_s,
                invalidation_record,
            )
        )
        p = parts
        rooms = (p.lock, p.counts, p.index, p.eviction, p.pins, p.placement, p.governance, p.expire)
        self._writes = Writes(
            config,
            len(tiers) - 1,
            self._persistent,
            *rooms,
            p.pacing,
            wall_clock,
            self._write_behind,
            self._cleaner,
            self._remote,
        )
        self._arena = (
            None
            if a is None
            else ArenaCalls(
                a, tiers, config, *rooms, p.pacing, clock, wall_clock, self._writes.stored_new_many
            )
        )
        in_place = None if self._arena is None else (self._arena.a, self._arena.arena)
        self._reads = Reads(config, tiers, in_place, *rooms, self._remote)

    def listen(self, changes: BlockChanges) -> None:
        """Tell ``changes`` of every copy stored or gone from now on (kvstore.store.changes)."""
        with self._lock:
            self._placement.changes = changes

    @property
    def has_remote(self) -> bool:
        """Whether a lookup may ask the fleet's remote tier (a network call) past its local prefix."""
        return self._remote is not None

    @property
    def leases(self) -> LeaseTable[Block]:
        return self._pins.leases

    # ----------------------------------------------------------------- queries

    def lookup(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        pin_ttl_s: float | None = None,
        owner: str = "",
        slots: bool = False,
    ) -> LookupResult:
        return self._reads.lookup(scope, keys, pin_ttl_s, owner, slots)

    def lease_held(self, lease_id: int, owner: str = "") -> bool:
        """Whether ``owner``'s lease ``lease_id`` still pins its blocks: neither released nor
        collected after expiry (a lease past its time still pins until collected). Held now
        means held since it was granted: an id is never granted twice."""
        with self._lock:
            return self._pins.leases.held(lease_id, owner)

    def exists(self, scope: Scope, keys: Sequence[BlockKey]) -> list[bool]:
        check_keys(keys)
        with self._lock:
            scope = self._index.intern(scope)
            return [self._index.visible((scope, key)) is not None for key in keys]

    def get_into(self, scope: Scope, key: BlockKey, out: memoryview) -> int | None:
        return self._reads.get_into(scope, key, out)

    def get_into_many(
        self, scope: Scope, keys: Sequence[BlockKey], outs: Sequence[memoryview]
    ) -> list[int | None]:
        return self._reads.get_into_many(scope, keys, outs)

    def get(self, scope: Scope, keys: Sequence[BlockKey]) -> list[bytes | None]:
        return self._reads.get(scope, keys)

    def heads(self, scope: Scope, keys: Sequence[BlockKey], n: int) -> list[bytes]:
        return self._reads.heads(scope, keys, n)

    # ----------------------------------------------------------------- writes

    def put(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        blocks: Sequence[BytesLike],
        parent: BlockKey | None = None,
        first_depth: int | None = None,
    ) -> int:
        return self._writes.put(scope, keys, blocks, parent, first_depth)

    def _put_local(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        blocks: Sequence[BytesLike],
        parent: BlockKey | None,
        depth: int,
        born: Sequence[float],
    ) -> int:
        """A chain read through from the remote tier: stored here, not sent back there, each
        block keeping the birth time its remote copy carried (0.0: unknown, born now)."""
        return self._writes.put(scope, keys, blocks, parent, depth, to_remote=False, born=born)

    def delete(self, scope: Scope, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; pinned ones vanish now and are freed on their last release."""
        check_keys(keys)
        with self._lock:
            scope = self._index.intern(scope)
            removed = 0
            for key in keys:
                block = self._index.visible((scope, key))
                if block is not None:
                    self._pins.doom(block)
                    removed += 1
            self._counts["deleted_blocks"] += removed
        if self._remote is not None:
            self._remote.forget(scope, keys)
        return removed

    def invalidate(self, namespace: str | None = None, fingerprint: Fingerprint | None = None) -> int:
        """Remove every block of a namespace, of a fingerprint, of both, or (neither) everything."""
        with self._lock:
            victims = [
                b
                for b in list(self._index.pool(namespace))
                if not b.doomed
                and (fingerprint is None or b.scope.fingerprint == fingerprint)
                and b.scope.fingerprint != MARK_FINGERPRINT  # the fleet's marks stay (below)
            ]
            for block in victims:
                self._pins.doom(block)
            if namespace is None and fingerprint is None and self._placement.changes is not None:
                self._placement.changes.cleared()  # one event instead of a removal per block
            self._counts["invalidated_blocks"] += len(victims)
            log.info(
                "invalidated %d blocks (namespace=%s, fingerprint=%s)",
                len(victims),
                namespace or "*",
                fingerprint.hex() if fingerprint else "*",
            )
            known = {b.scope.namespace for b in self._index.pool(None)} if namespace is None else set()
        if self._remote is not None:
            self._remote.forget_namespace(
                namespace, fingerprint, known | {b.scope.namespace for b in victims}
            )
        else:
            self._mark_here(namespace, fingerprint)
        return len(victims)

    def _mark_here(self, namespace: str | None, fingerprint: Fingerprint | None) -> None:
        """A shared node's own invalidation reaches the fleet: its marks, stored here, for the
        namespaces whose marks sidecars poll here (kvstore.store.invalidations)."""
        with self._lock:
            polled = {s.namespace for s in self._index.scopes() if s.fingerprint == MARK_FINGERPRINT}
            at_s = self._wall()
        name = mark_name(fingerprint)
        for ns in sorted(polled if namespace is None else polled & {namespace}):
            scope = Scope(ns, MARK_FINGERPRINT)
            self.delete(scope, [name])  # a put keeps an existing copy: the older mark goes first
            self.put(scope, [name], [mark_value(at_s)])

    def demote(self, tier: str, namespace: str | None = None, fingerprint: Fingerprint | None = None) -> int:
        """Move every unpinned block of ``tier`` (of a namespace, a fingerprint, both, or all)
        down into the next tier with free room: DRAM emptied into NVMe before a maintenance
        window, or a restore from disk measured without a restart. Children go first, so no
        block leaves ahead of a descendant. Nothing is evicted or dropped to make room: a block
        the slower tiers cannot take as they are stays where it is. Returns the number of
        blocks that left ``tier``."""
        names = [t.name for t in self.tiers]
        if tier not in names:
            raise InvalidArgument(f"no tier {tier!r} here (tiers: {', '.join(names)})")
        t = names.index(tier)
        if t + 1 == len(self.tiers):
            raise InvalidArgument(f"{tier} is the slowest tier here: there is nowhere to demote to")
        with self._lock:
            self._expire()
            chosen = sorted(
                (
                    b
                    for b in self._index.pool(namespace)
                    if t in b.tiers
                    and not b.doomed
                    and (fingerprint is None or b.scope.fingerprint == fingerprint)
                ),
                key=lambda b: -b.depth,
            )
        # A block at a time, the lock let go in between and the disk waited for outside it: a
        # demote of a whole arena into a slow disk takes minutes, and every other caller goes on
        # meanwhile. (Under the lock it still waits if another writer filled the queue since.)
        moved = 0
        for block in chosen:
            self._pacing.wait_below(t, block.size_bytes, DEMOTE_WAIT_S)
            with self._lock:
                if self._index.is_current(block) and t in block.tiers:  # not deleted or moved meanwhile
                    moved += self._placement.demote(block, t)
        log.info("demoted %d of %d blocks out of %s", moved, len(chosen), tier)
        return moved

    # ----------------------------------------------------------------- leases

    def pin(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Lease:
        """Pin present blocks among ``keys`` until release or ``ttl_s`` (default from config)."""
        check_keys(keys)
        with self._lock:
            scope = self._index.intern(scope)
            self._expire()
            present = [b for b in (self._index.visible((scope, k)) for k in keys) if b is not None]
            return self._pins.grant(present, ttl_s, owner)

    def release(self, lease_id: int, owner: str = "") -> None:
        with self._lock:
            self._expire()
            self._pins.release(lease_id, owner)

    # ----------------------------------------------------------------- same-host arena

    @property
    def arena(self) -> InPlaceTier | None:
        """The tier whose arena same-host clients map, or None without one."""
        return None if self._arena is None else self._arena.arena

    def _in_place(self) -> ArenaCalls:
        if self._arena is None:
            raise FailedPrecondition("this store has no dram arena for same-host clients")
        return self._arena

    def resolve(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Resolved:
        if self._remote is not None:  # remote blocks continuing the local prefix come here first
            self._remote.read_through(scope, keys)
        return self._in_place().resolve(scope, keys, ttl_s, owner)

    def reserve(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        sizes: Sequence[int],
        parent: BlockKey | None = None,
        ttl_s: float | None = None,
        owner: str = "",
    ) -> Reservation:
        return self._in_place().reserve(scope, keys, sizes, parent, ttl_s, owner)

    def commit(self, reservation_id: int, owner: str = "", checksums: Sequence[int] = ()) -> int:
        """Publish a reservation's written slots (``Arena.commit``): ``checksums``, the writer's
        xxh3-64 of each given slot's block, in order, or none."""
        return self._in_place().commit(reservation_id, owner, checksums)

    def abort(self, reservation_id: int, owner: str = "") -> None:
        self._in_place().abort(reservation_id, owner)

    # ----------------------------------------------------------------- stats

    def stats(self) -> StoreStats:
        with self._lock:
            counters = dict(self._counts)
            if self._remote is not None:  # the backend's own figures, as remote_<what>
                usage = self._remote.usage()
                counters.update({f"remote_{k}": v for k, v in vars(usage).items() if isinstance(v, int)})
            return StoreStats(
                tiers=tuple(tier.usage() for tier in self.tiers),
                counters=counters,
                namespace_bytes=dict(self._index.namespace_bytes),
                namespace_counters={ns: dict(c) for ns, c in self._counts.by_namespace.items()},
                blocks=self._index.live_count(),
                leases=len(self._pins.leases),
                absent_tiers=self.absent_tiers,
            )

    def tier_of(self, scope: Scope, key: BlockKey) -> str | None:
        with self._lock:
            block = self._index.visible((scope, key))
            return None if block is None else self.tiers[block.fastest].name

    def fingerprint_usage(self, namespace: str | None = None) -> dict[Fingerprint, tuple[int, int]]:
        """(blocks, bytes) per model fingerprint, of one namespace or of all (for ``stats``)."""
        with self._lock:
            return self._index.fingerprint_usage(namespace)

    def tier_usage_of(self, namespace: str) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) one namespace holds in each tier (a non-admin's ``stats``)."""
        with self._lock:
            return self._index.tier_usage(namespace, [t.name for t in self.tiers])

    def blocks(self) -> Iterator[tuple[Scope, BlockKey, str]]:
        """Every visible block with its fastest tier's name (for tests and tools)."""
        with self._lock:
            snapshot = [
                (b.scope, b.key, self.tiers[b.fastest].name)
                for b in self._index.blocks.values()
                if not b.doomed
            ]
        return iter(snapshot)

    def flush(self) -> None:
        with translated():  # not under the lock: a flush waits for the disk
            for tier in self.tiers:
                tier.flush()

    def close(self) -> None:
        """Spill volatile-only blocks to the persistent tier (``persist_on_close``), then close."""
        if self._cleaner is not None:
            self._cleaner.close()  # before the lock, as write-behind: a copy in flight takes it
        if self._write_behind is not None:
            self._write_behind.close()  # before the lock: its thread takes it for every block
        if self._remote is not None:
            self._remote.close()  # likewise: what is queued for the remote goes first (bounded)
        with self._lock:
            if self._closed:
                return
            if self.config.persist_on_close and self._persistent_index is not None:
                self._placement.spill(self._persistent_index, self._persistent)
            self._closed = True
            try:
                for tier in self.tiers:
                    tier.close()
            finally:
                if self._on_close is not None:
                    self._on_close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
