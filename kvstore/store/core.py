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

The rooms behind it: ``index`` (what is where), ``eviction`` (GDSF victims), ``pins`` (the one
owner of pin counts), ``placement`` (room, demotion, spill), ``governance`` (quotas,
retention), ``arena`` (two-phase same-host calls). ``parts`` says what runs under the lock.
Tier errors that escape a call become ``Unavailable`` there, nowhere else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter

from kvstore.errors import InvalidArgument, StoreFull
from kvstore.keys import BlockKey, Fingerprint
from kvstore.leases import Lease, LeaseTable
from kvstore.store.arena import ArenaCalls
from kvstore.store.behind import PersistBehind
from kvstore.store.changes import BlockChanges
from kvstore.store.cleaner import Cleaner
from kvstore.store.invalidations import MARK_FINGERPRINT, mark_name, mark_value
from kvstore.store.model import (
    ArenaSlot,
    Block,
    LookupResult,
    Reservation,
    Resolved,
    Scope,
    StoreConfig,
    StoreStats,
    check_keys,
    check_sizes,
    new_block,
)
from kvstore.store.parts import StoreParts, translated
from kvstore.store.placement import DEMOTE_WAIT_S, PACE_S, PACE_SLICE_BYTES, slices
from kvstore.store.rebuild import rebuild
from kvstore.store.remote import RemoteCalls
from tiers import BytesLike, InPlaceTier, Tier
from tiers.remote import RemoteTier

log = logging.getLogger("kvstore.store")
_TIERS_OF = attrgetter("tiers")
REMOTE = "remote"  # the tier name lookups report for blocks found only in the remote tier


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
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.config = config or StoreConfig()
        self._p = StoreParts(tiers, self.config, clock, wall_clock, persistent)
        self.tiers = self._p.tiers
        self.absent_tiers = tuple(absent_tiers)  # "hbm: no CUDA", for logs and stats
        self._on_close = on_close  # after the tiers closed (the builder's data-folder lock)
        self._arena = ArenaCalls(self._p, clock, self._stored_new_many)
        self._closed = False
        rebuild(self._p)
        self._persistent_index = next((t for t, p in enumerate(self._p.persistent) if p), None)
        self._write_behind: PersistBehind | None = None
        if self.config.write_behind and not self.config.write_through and self._persistent_index is not None:
            self._write_behind = PersistBehind(
                self._p, self._persistent_index, self.config.write_behind_max_bytes, lambda: self._closed
            )
        self._remote = (
            None
            if remote is None
            else RemoteCalls(remote, self._p, self._put_local, remote_queue_bytes, invalidation_poll_s)
        )
        self._cleaner: Cleaner | None = None
        a, disk = self._p.arena_index, self._persistent_index
        cleans = self.config.clean_ahead > 0 and not self.config.write_through
        if cleans and a is not None and disk is not None and disk > a:
            self._cleaner = Cleaner(self._p, a, disk, self.config.clean_ahead, lambda: self._closed)

    def listen(self, changes: BlockChanges) -> None:
        """Tell ``changes`` of every copy stored or gone from now on (kvstore.store.changes)."""
        with self._p.locked():
            self._p.placement.changes = changes

    @property
    def has_remote(self) -> bool:
        """Whether a lookup may ask the fleet's remote tier (a network call) past its local prefix."""
        return self._remote is not None

    @property
    def leases(self) -> LeaseTable[Block]:
        return self._p.pins.leases

    # ----------------------------------------------------------------- queries

    def lookup(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        pin_ttl_s: float | None = None,
        owner: str = "",
        slots: bool = False,
    ) -> LookupResult:
        """The longest run of present blocks from ``keys[0]``; pins them when ``pin_ttl_s``, and
        then, with ``slots``, tells where each one the arena holds lies in it (``LookupResult``):
        a reader copying those in place checks with ``lease_held`` after its copy that the
        lease held throughout (one call instead of a ``resolve``)."""
        p = self._p
        check_keys(keys)
        with p.locked():
            p.governance.sweep()
            scope = p.index.intern(scope)
            hits = p.index.prefix(scope, keys)
            names = [tier.name for tier in p.tiers]
            # each one's fastest tier, in C (a frame a block was a tenth of a lookup's time)
            tiers = list(map(names.__getitem__, map(min, map(_TIERS_OF, hits))))
            p.count(scope, "lookup_hit_blocks", len(hits))
            p.count(scope, "lookup_miss_blocks", len(keys) - len(hits))
            lease = None
            if pin_ttl_s is not None and hits:
                p.expire()  # a lookup that pins must not let expired pins pile up
                lease = p.pins.grant(hits, pin_ttl_s, owner)
            in_place = self._slots_of(hits) if slots and lease is not None else ()
        # Past the local prefix, the fleet's remote tier (outside the lock; it is not pinned:
        # a restore that finds a block gone there gets a shorter prefix)
        more = self._remote.more(scope, keys[len(hits) :]) if self._remote is not None else 0
        return LookupResult(len(hits) + more, (*tiers, *(REMOTE,) * more), lease, in_place)

    def _slots_of(self, blocks: Sequence[Block]) -> tuple[ArenaSlot | None, ...]:
        """Under the lock: each pinned block's arena slot, None where the arena holds no copy; no
        slots at all when the arena reads throttled (its delay is waited out in ``resolve``)."""
        p = self._p
        if p.arena_index is None:
            return ()
        a, arena = p.arena()
        if not blocks or p.tiers[a].in_place_read_s(blocks[0].size_bytes):
            return ()
        found = arena.locate_many([block.tkey for block in blocks])
        return tuple(slot if a in block.tiers else None for slot, block in zip(found, blocks, strict=True))

    def lease_held(self, lease_id: int, owner: str = "") -> bool:
        """Whether ``owner``'s lease ``lease_id`` still pins its blocks: neither released nor
        collected after expiry (a lease past its time still pins until collected). Held now
        means held since it was granted: an id is never granted twice."""
        with self._p.locked():
            return self._p.pins.leases.held(lease_id, owner)

    def exists(self, scope: Scope, keys: Sequence[BlockKey]) -> list[bool]:
        check_keys(keys)
        with self._p.locked():
            scope = self._p.index.intern(scope)
            return [self._p.index.visible((scope, key)) is not None for key in keys]

    def get_into(self, scope: Scope, key: BlockKey, out: memoryview) -> int | None:
        """Copy the block into ``out``; its length, or None for a miss (recompute it)."""
        return self.get_into_many(scope, [key], [out])[0]

    def get_into_many(
        self, scope: Scope, keys: Sequence[BlockKey], outs: Sequence[memoryview]
    ) -> list[int | None]:
        """Copy each block into its buffer; per block its length, or None for a miss.

        One restore is one call: the index is consulted once, the copies run without the lock
        under transient holds, and blocks served from a slower tier are promoted afterwards.
        """
        p = self._p
        check_keys(keys)
        if len(keys) != len(outs):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} buffers")
        if self._remote is not None:  # remote blocks continuing the local prefix come here first
            self._remote.read_through(scope, keys)
        # A few tight loops under one lock hold, before and after the copies: a 256 KiB block
        # copies in ~15 us, so each microsecond of bookkeeping per block shows.
        with p.locked():
            plan = p.index.visible_many(p.index.intern(scope), keys)
            at = [i for i, block in enumerate(plan) if block is not None]
            held = [block for block in plan if block is not None]
            for i, block in zip(at, held, strict=True):
                if len(outs[i]) < block.size_bytes:
                    raise InvalidArgument(
                        f"buffer of {len(outs[i])} B is smaller than the {block.size_bytes} B block"
                    )
            p.pins.hold_many(held)  # the copies below run without the lock
            p.eviction.hit_many(held)
            sources = [min(block.tiers) for block in held]
        into = [outs[i] for i in at]
        sizes: list[int | None] = []
        try:
            p.placement.read_many(held, sources, into, sizes)
        finally:
            with p.locked():
                self._after_reads(held, sources, into, sizes)
                hits = len(sizes) - sizes.count(None)
                p.count(scope, "get_hit_blocks", hits)
                p.count(scope, "get_miss_blocks", len(keys) - hits)
        result: list[int | None] = [None] * len(keys)
        for i, n in zip(at, sizes, strict=True):
            result[i] = n
        return result

    def _after_reads(
        self, held: list[Block], sources: list[int], outs: list[memoryview], sizes: list[int | None]
    ) -> None:
        """Under the lock, after the copies: each block's transient hold ends, then a copy that
        failed is forgotten and a hit from a slower tier is promoted. ``sizes`` is shorter than
        ``held`` when the copies stopped early: the rest only lose their hold."""
        p = self._p
        p.pins.unhold_many(held)
        fast_hits = 0
        for block, t, out, n in zip(held, sources, outs, sizes, strict=False):  # sizes may be short
            if t == 0 and n is not None:
                fast_hits += 1
            else:
                self._after_read(block, t, out, n)
        if fast_hits:
            p.counters[p.served_counter[0]] += fast_hits

    def _after_read(self, block: Block, source: int, out: memoryview, n: int | None) -> None:
        p = self._p
        if n is None:
            p.placement.failed_read(block, source)
            return
        p.counters[p.served_counter[source]] += 1
        if source > 0 and self.config.promote_on_hit and p.index.is_current(block):
            p.placement.place(block, out[:n], lowest=0, highest=0)
            if 0 in block.tiers:
                p.counters["promotions"] += 1

    def get(self, scope: Scope, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Convenience for scripts and tests: each block's bytes, or None for a miss."""
        if self._remote is not None:
            self._remote.read_through(scope, keys)
        out: list[bytes | None] = []
        for key in keys:
            with self._p.locked():
                block = self._p.index.visible((scope, key))
                size = block.size_bytes if block else 0
            buf = bytearray(size)
            n = self.get_into(scope, key, memoryview(buf)) if block else None
            out.append(None if n is None else bytes(buf[:n]))
        return out

    # ----------------------------------------------------------------- writes

    def put(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        blocks: Sequence[BytesLike],
        parent: BlockKey | None = None,
        first_depth: int | None = None,
    ) -> int:
        return self._put(scope, keys, blocks, parent, first_depth, to_remote=True)

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
        return self._put(scope, keys, blocks, parent, depth, to_remote=False, born=born)

    def _put(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        blocks: Sequence[BytesLike],
        parent: BlockKey | None,
        first_depth: int | None,
        to_remote: bool,
        born: Sequence[float] = (),
    ) -> int:
        """Store a chain of blocks; ``keys[i-1]`` (or ``parent`` for i=0) is each one's parent.
        ``born``: each block's birth time where a copy elsewhere had one (else: now).

        Blocks already present are skipped. Returns how many were stored. ``first_depth`` is the
        index of keys[0] in its full chain when the parent is not stored here (defaults to the
        parent's depth + 1, or 0 without a parent).
        """
        p = self._p
        check_keys(keys)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks")
        sizes = [len(memoryview(b)) for b in blocks]
        check_sizes(sizes, self.config.max_block_bytes)
        stored = 0
        with p.locked():
            scope = p.index.intern(scope)
            first_depth = first_depth if first_depth is not None else p.index.depth_after(scope, parent)
        # In slices, each paced before it takes the lock: a disk that is behind slows this
        # writer, slice by slice, and every other caller goes on between them (for the room of
        # its new blocks only: a block stored already needs none).
        for first, end in slices(sizes, PACE_SLICE_BYTES):
            with p.locked():
                needed = p.new_sizes(scope, keys[first:end], sizes[first:end])
            held = p.placement.pace(0, needed, PACE_S)
            with p.locked():
                p.placement.use(held)  # the room it waited for, taken below under this same hold
                p.expire()
                now = p.wall()  # each block's birth, in the metadata its tiers keep
                for i in range(first, end):
                    key = keys[i]
                    existing = p.vacate((scope, key))
                    if existing is not None:
                        # A doomed block (deleted while a reader holds it) keeps its storage
                        # until released; a new copy under the same key is not stored before then.
                        p.counters["put_doomed_blocks" if existing.doomed else "put_dedup_blocks"] += 1
                        continue
                    prev = keys[i - 1] if i else parent
                    birth = (born[i] if i < len(born) else 0.0) or now
                    block = new_block(
                        self.config, scope, key, sizes[i], prev, first_depth + i, stored_at_s=birth
                    )
                    self._put_one(block, blocks[i], stored, len(keys), to_remote)
                    stored += 1
                    p.count(scope, "put_blocks")
        return stored

    def _put_one(self, block: Block, data: BytesLike, stored: int, chain: int, to_remote: bool) -> None:
        p = self._p
        # Hold the parent while the child finds room: evicting it now would make the child
        # unreachable dead weight.
        parent = p.index.visible((block.scope, block.parent)) if block.parent is not None else None
        if parent is not None:
            p.pins.hold(parent)
        # A child never lands in a faster tier than its parent: a chain stays fast at its head
        # and slow at its tail, the order a restore reads it in.
        lowest = parent.fastest if parent is not None else 0
        try:
            p.governance.check(block.scope, block.size_bytes, stored, chain)
            p.placement.place(block, data, lowest=lowest, highest=len(p.tiers) - 1)
        finally:
            if parent is not None:
                p.pins.unhold(parent)
        if not block.tiers:
            raise StoreFull(
                f"no tier can take a {block.size_bytes} B block: all are full of pinned blocks "
                f"(stored {stored} of {chain} blocks of this chain)"
            )
        p.index.admit(block)
        p.eviction.touch(block)
        self._stored_new(block, data, to_remote)

    def _stored_new(self, block: Block, data: BytesLike, to_remote: bool = True) -> None:
        """A new block is in the index (under the lock): write-through or write-behind, and
        write-behind to the remote tier unless it came from there."""
        self._stored_new_many((block,), lambda _: data, to_remote)

    def _stored_new_many(
        self, blocks: Sequence[Block], data_of: Callable[[Block], BytesLike], to_remote: bool = True
    ) -> None:
        """``_stored_new`` of the blocks of one commit; ``data_of`` is read for write-through
        only (the usual commit asks nothing of each block's bytes)."""
        if self.config.write_through:
            for block in blocks:
                data = data_of(block)
                for t, persistent in enumerate(self._p.persistent):
                    if persistent and t not in block.tiers:
                        self._p.placement.place(block, data, lowest=t, highest=t, wait=True)
        if self._write_behind is not None:
            for block in blocks:
                self._write_behind.offer(block)
        if self._cleaner is not None:
            self._cleaner.poke()
        if self._remote is not None and to_remote:
            for block in blocks:
                self._remote.offer(block)

    def delete(self, scope: Scope, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; pinned ones vanish now and are freed on their last release."""
        p = self._p
        check_keys(keys)
        with p.locked():
            scope = p.index.intern(scope)
            removed = 0
            for key in keys:
                block = p.index.visible((scope, key))
                if block is not None:
                    p.pins.doom(block)
                    removed += 1
            p.counters["deleted_blocks"] += removed
        if self._remote is not None:
            self._remote.forget(scope, keys)
        return removed

    def invalidate(self, namespace: str | None = None, fingerprint: Fingerprint | None = None) -> int:
        """Remove every block of a namespace, of a fingerprint, of both, or (neither) everything."""
        p = self._p
        with p.locked():
            victims = [
                b
                for b in list(p.index.pool(namespace))
                if not b.doomed
                and (fingerprint is None or b.scope.fingerprint == fingerprint)
                and b.scope.fingerprint != MARK_FINGERPRINT  # the fleet's marks stay (below)
            ]
            for block in victims:
                p.pins.doom(block)
            if namespace is None and fingerprint is None and p.placement.changes is not None:
                p.placement.changes.cleared()  # one event instead of a removal per block
            p.counters["invalidated_blocks"] += len(victims)
            log.info(
                "invalidated %d blocks (namespace=%s, fingerprint=%s)",
                len(victims),
                namespace or "*",
                fingerprint.hex() if fingerprint else "*",
            )
            known = {b.scope.namespace for b in p.index.pool(None)} if namespace is None else set()
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
        p = self._p
        with p.locked():
            polled = {s.namespace for s in p.index.scopes() if s.fingerprint == MARK_FINGERPRINT}
            at_s = p.wall()
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
        p = self._p
        names = [t.name for t in p.tiers]
        if tier not in names:
            raise InvalidArgument(f"no tier {tier!r} here (tiers: {', '.join(names)})")
        t = names.index(tier)
        if t + 1 == len(p.tiers):
            raise InvalidArgument(f"{tier} is the slowest tier here: there is nowhere to demote to")
        with p.locked():
            p.expire()
            chosen = sorted(
                (
                    b
                    for b in p.index.pool(namespace)
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
            p.placement.wait_below(t, block.size_bytes, DEMOTE_WAIT_S)
            with p.locked():
                if p.index.is_current(block) and t in block.tiers:  # not deleted or moved meanwhile
                    moved += p.placement.demote(block, t)
        log.info("demoted %d of %d blocks out of %s", moved, len(chosen), tier)
        return moved

    # ----------------------------------------------------------------- leases

    def pin(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Lease:
        """Pin present blocks among ``keys`` until release or ``ttl_s`` (default from config)."""
        p = self._p
        check_keys(keys)
        with p.locked():
            scope = p.index.intern(scope)
            p.expire()
            present = [b for b in (p.index.visible((scope, k)) for k in keys) if b is not None]
            return p.pins.grant(present, ttl_s, owner)

    def release(self, lease_id: int, owner: str = "") -> None:
        with self._p.locked():
            self._p.expire()
            self._p.pins.release(lease_id, owner)

    # ----------------------------------------------------------------- same-host arena

    @property
    def arena(self) -> InPlaceTier | None:
        """The tier whose arena same-host clients map, or None without one."""
        return None if self._p.arena_index is None else self._p.arena()[1]

    def resolve(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Resolved:
        if self._remote is not None:  # remote blocks continuing the local prefix come here first
            self._remote.read_through(scope, keys)
        return self._arena.resolve(scope, keys, ttl_s, owner)

    def reserve(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        sizes: Sequence[int],
        parent: BlockKey | None = None,
        ttl_s: float | None = None,
        owner: str = "",
    ) -> Reservation:
        return self._arena.reserve(scope, keys, sizes, parent, ttl_s, owner)

    def commit(self, reservation_id: int, owner: str = "") -> int:
        return self._arena.commit(reservation_id, owner)

    def abort(self, reservation_id: int, owner: str = "") -> None:
        self._arena.abort(reservation_id, owner)

    # ----------------------------------------------------------------- stats

    def stats(self) -> StoreStats:
        p = self._p
        with p.locked():
            counters = dict(p.counters)
            if self._remote is not None:  # the backend's own figures, as remote_<what>
                usage = self._remote.usage()
                counters.update({f"remote_{k}": v for k, v in vars(usage).items() if isinstance(v, int)})
            return StoreStats(
                tiers=tuple(tier.usage() for tier in p.tiers),
                counters=counters,
                namespace_bytes=dict(p.index.namespace_bytes),
                namespace_counters={ns: dict(c) for ns, c in p.namespace_counters.items()},
                blocks=p.index.live_count(),
                leases=len(p.pins.leases),
                absent_tiers=self.absent_tiers,
            )

    def tier_of(self, scope: Scope, key: BlockKey) -> str | None:
        with self._p.locked():
            block = self._p.index.visible((scope, key))
            return None if block is None else self._p.tiers[block.fastest].name

    def fingerprint_usage(self, namespace: str | None = None) -> dict[Fingerprint, tuple[int, int]]:
        """(blocks, bytes) per model fingerprint, of one namespace or of all (for ``stats``)."""
        with self._p.locked():
            return self._p.index.fingerprint_usage(namespace)

    def tier_usage_of(self, namespace: str) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) one namespace holds in each tier (a non-admin's ``stats``)."""
        with self._p.locked():
            return self._p.index.tier_usage(namespace, [t.name for t in self._p.tiers])

    def blocks(self) -> Iterator[tuple[Scope, BlockKey, str]]:
        """Every visible block with its fastest tier's name (for tests and tools)."""
        p = self._p
        with p.locked():
            snapshot = [
                (b.scope, b.key, p.tiers[b.fastest].name) for b in p.index.blocks.values() if not b.doomed
            ]
        return iter(snapshot)

    def flush(self) -> None:
        with translated():  # not under the lock: a flush waits for the disk
            for tier in self._p.tiers:
                tier.flush()

    def close(self) -> None:
        """Spill volatile-only blocks to the persistent tier (``persist_on_close``), then close."""
        if self._cleaner is not None:
            self._cleaner.close()  # before the lock, as write-behind: a copy in flight takes it
        if self._write_behind is not None:
            self._write_behind.close()  # before the lock: its thread takes it for every block
        if self._remote is not None:
            self._remote.close()  # likewise: what is queued for the remote goes first (bounded)
        with self._p.locked():
            if self._closed:
                return
            if self.config.persist_on_close and self._persistent_index is not None:
                self._p.placement.spill(self._persistent_index, self._p.persistent)
            self._closed = True
            try:
                for tier in self._p.tiers:
                    tier.close()
            finally:
                if self._on_close is not None:
                    self._on_close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
