"""The tiered block store: what lives where, who may see it, and what goes when space runs out.

Blocks are stored under (scope, key): a ``Scope`` is a namespace (a tenant, or a shared scope a
tenant was granted) plus the model fingerprint. Tiers are ordered fastest first (``hbm``,
``dram``, ``nvme``); the store keeps one index of every block and which tiers hold a copy.

Calls and their order:
    lookup(scope, keys)            length of the present prefix and the tier of each hit block
    put(scope, keys, blocks)       store a chain (keys[i-1] is the parent of keys[i])
    get_into(scope, key, out)      copy one block into the caller's buffer; None for a miss
    pin(scope, keys, ttl_s)        -> Lease; pinned blocks are never evicted or freed
    release(lease_id)              ends a lease (LeaseNotFound twice, LeaseExpired if late)
    delete(scope, keys) / invalidate(namespace, fingerprint)
    stats()                        counters and per-tier occupancy
    close()

Same-host data plane (the `dram` arena, which another process maps by name):
    resolve(scope, keys, ttl_s)    -> Resolved: arena slots of the present prefix, pinned under
                                   a lease; blocks found only in other tiers are copied into
                                   the arena first. The caller reads the slots, then release().
    reserve(scope, keys, sizes)    -> Reservation: arena slots for new blocks (None for keys
                                   already present); the caller writes them, then
    commit(reservation_id)         publishes them, or abort(reservation_id) gives them back.
                                   An uncommitted reservation expires like a lease.

Placement: new blocks land in the first tier; with ``write_through`` the persistent tier gets a
copy at once (the put waits for it); with ``write_behind`` a thread copies each new block there
soon after (``kvstore.write_behind``: bounded, a full queue drops and counts), so a
crash loses only what is still queued; otherwise only on demotion and on a clean close. A hit in
a slower tier is promoted to the first tier.

Eviction demotes a block to the next tier while there is one, and drops it from the last. It is
prefix-aware — a block is never evicted from a tier while a child of it sits in that tier or a
faster one, because a child without its parent is unreachable — and cost-aware: among the
eligible blocks it takes the one with the lowest GreedyDual-Size-Frequency priority
(aging + hits x recompute cost / bytes), where recompute cost grows with the block's depth in its
chain (attention over a longer prefix). Pinned blocks are never candidates.

Quotas: a tenant's blocks may hold at most its quota of bytes (each block counted once, in
whichever tiers it sits). A put over quota first drops that tenant's own coldest blocks; if all of
them are pinned it raises QuotaExceeded. One tenant can push others' blocks down a tier, never
out of the store.

Threads: one lock guards the index; copies into a caller's buffer on ``get_into`` run outside it,
under a transient pin, so a slow reader never blocks other requests. Tier errors are translated
into ``kvstore.errors`` here and nowhere else.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.errors import FailedPrecondition, InvalidArgument, QuotaExceeded, StoreFull
from kvstore.keys import BlockKey, Fingerprint, check_key
from kvstore.leases import Lease, LeaseTable
from kvstore.write_behind import WriteBehind
from tiers import BytesLike, Tier, TierError, TierFull, TierKey, TierUsage
from tiers.dram import DramTier
from tiers.slab import Slot as ArenaSlotView

log = logging.getLogger(__name__)

MAX_NAMESPACE_BYTES = 255
RETENTION_SWEEP_S = 1.0


@dataclass(frozen=True)
class Scope:
    """Where a block lives: a namespace (tenant or granted shared scope) and a model fingerprint."""

    namespace: str
    fingerprint: Fingerprint
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self) -> None:
        # Every index probe hashes a scope: compute it once.
        object.__setattr__(self, "_hash", hash((self.namespace, self.fingerprint)))
        encoded = self.namespace.encode()
        if not encoded or len(encoded) > MAX_NAMESPACE_BYTES:
            raise InvalidArgument(f"namespace must be 1..{MAX_NAMESPACE_BYTES} UTF-8 bytes")
        try:
            check_key(self.fingerprint)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc


BlockId = tuple[Scope, BlockKey]


def tier_key(scope: Scope, key: BlockKey) -> TierKey:
    ns = scope.namespace.encode()
    return TierKey(bytes([len(ns)]) + ns + scope.fingerprint + key)


def namespace_of_tier_key(raw: bytes) -> str:
    """The namespace a tier key belongs to (what its encryption key is chosen by)."""
    return bytes(raw[1 : 1 + raw[0]]).decode(errors="replace") if raw else ""


def parse_tier_key(raw: bytes) -> BlockId | None:
    """The block id encoded in a tier key, or None for a key the store did not write."""
    if not raw:
        return None
    n = raw[0]
    if len(raw) != 1 + n + 64:
        return None
    try:
        ns = raw[1 : 1 + n].decode()
        scope = Scope(ns, Fingerprint(bytes(raw[1 + n : 33 + n])))
    except (UnicodeDecodeError, InvalidArgument):
        return None
    return scope, BlockKey(bytes(raw[33 + n :]))


@dataclass(frozen=True)
class StoreConfig:
    write_through: bool = False
    promote_on_hit: bool = True
    lease_ttl_s: float = 5.0
    max_lease_ttl_s: float = 120.0  # a client's pin or reservation lasts at most this long
    max_block_bytes: int = 64 << 20  # larger blocks are refused before anything is evicted
    quota_bytes: Mapping[str, int] = field(default_factory=dict)  # namespace -> bytes
    retention_s: Mapping[str, float] = field(default_factory=dict)  # namespace -> seconds a block lives
    default_retention_s: float | None = None  # for namespaces not listed; None = until evicted
    default_quota_bytes: int | None = None  # for namespaces not listed; None = unlimited
    attention_cost_per_block: float = 0.02  # recompute cost of block i = 1 + this * i
    persist_on_close: bool = True  # a clean close copies volatile-only blocks to the persistent tier
    write_behind: bool = False  # copy new blocks to the persistent tier on a thread, soon after
    write_behind_max_bytes: int = 1 << 30  # bytes queued at most; a crash loses at most these


@dataclass(frozen=True)
class LookupResult:
    """``hit_blocks`` leading keys are present; ``tiers[i]`` names the tier serving block i."""

    hit_blocks: int
    tiers: tuple[str, ...]
    lease: Lease | None = None


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierUsage, ...]
    counters: Mapping[str, int]
    namespace_bytes: Mapping[str, int]
    namespace_counters: Mapping[str, Mapping[str, int]]
    blocks: int
    leases: int
    absent_tiers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArenaSlot:
    """Where a block's bytes sit in the `dram` arena."""

    offset: int
    size_bytes: int


@dataclass(frozen=True)
class Resolved:
    """Arena slots of the present prefix, pinned by ``lease`` (None when nothing hit)."""

    slots: tuple[ArenaSlot, ...]
    tiers: tuple[str, ...]
    lease: Lease | None


@dataclass(frozen=True)
class Reservation:
    """Arena slots to write new blocks into; ``slots[i]`` is None where nothing is to be written
    (already present, or being written by another client, or no room)."""

    reservation_id: int
    slots: tuple[ArenaSlot | None, ...]
    expires_at_s: float


@dataclass(eq=False)
class _Pending:
    scope: Scope
    keys: tuple[BlockKey, ...]
    slots: tuple[ArenaSlot | None, ...]
    parent: BlockKey | None
    first_depth: int
    pinned_parent: _Block | None


@dataclass(eq=False)
class _Block:
    scope: Scope
    key: BlockKey
    tkey: TierKey
    size_bytes: int
    parent: BlockKey | None
    depth: int
    cost: float
    tiers: set[int] = field(default_factory=set)
    pins: int = 0
    hits: int = 0
    priority: float = 0.0
    version: int = 0
    doomed: bool = False  # deleted while pinned: invisible, freed on the last release
    parked: bool = False  # popped from a heap while pinned: push it again on the last release
    stored_at_s: float = 0.0  # wall clock (time.time) when first stored; kept in its meta
    expires_at_s: float = math.inf  # retention: invisible from then on, removed by the sweep

    @property
    def fastest(self) -> int:
        return min(self.tiers)

    @property
    def meta(self) -> bytes:
        """Chain links and birth time kept with the bytes, so a restart restores prefix-aware
        eviction and retention."""
        return _META.pack(self.depth, self.stored_at_s) + (self.parent or b"")


class TieredStore:
    """See the module docstring."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        persistent: Sequence[bool] | None = None,
        absent_tiers: Sequence[str] = (),
        on_close: Callable[[], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = list(tiers)
        self.config = config or StoreConfig()
        self.absent_tiers = tuple(absent_tiers)  # "hbm: no CUDA", for logs and stats
        self._on_close = on_close  # after the tiers closed (the builder's data-folder lock)
        self._wall = wall_clock  # retention spans restarts: wall time, not the lease clock
        self._by_age: dict[str, collections.deque[BlockId]] = {}  # retained namespaces, oldest first
        self._next_sweep_s = 0.0
        self._persistent = list(persistent) if persistent is not None else [t.name == "nvme" for t in tiers]
        self._lock = threading.RLock()
        self._blocks: dict[BlockId, _Block] = {}
        self._by_namespace: dict[str, dict[BlockId, _Block]] = {}
        self._ns_bytes: Counter[str] = Counter()
        # parent id -> keys of its children in the index; kept even while the parent is absent,
        # so a parent stored after its child still knows it has one.
        self._children: dict[BlockId, set[BlockKey]] = {}
        self._scopes: dict[Scope, Scope] = {}
        self._ns_reserved: Counter[str] = Counter()  # bytes in uncommitted reservations
        self._heaps: list[list[tuple[float, int, int, BlockId]]] = [[] for _ in tiers]
        self._aging = [0.0 for _ in tiers]
        self._seq = 0
        self._closed = False
        self._served_counter = [f"get_{t.name}_blocks" for t in self.tiers]
        self.leases: LeaseTable[_Block] = LeaseTable(clock)
        self._reservations: LeaseTable[_Pending] = LeaseTable(clock)
        self._arena_index = next((i for i, t in enumerate(self.tiers) if isinstance(t, DramTier)), None)
        self.counters: Counter[str] = Counter()
        self._ns_counters: dict[str, Counter[str]] = {}
        self._rebuild()
        self._persistent_index = next((t for t, p in enumerate(self._persistent) if p), None)
        self._write_behind: WriteBehind[BlockId] | None = None
        if self.config.write_behind and not self.config.write_through and self._persistent_index is not None:
            self._write_behind = WriteBehind(self._copy_behind, self.config.write_behind_max_bytes)

    # ----------------------------------------------------------------- queries

    def lookup(
        self, scope: Scope, keys: Sequence[BlockKey], pin_ttl_s: float | None = None, owner: str = ""
    ) -> LookupResult:
        """The longest run of present blocks from ``keys[0]``; pins them when ``pin_ttl_s``."""
        _check_keys(keys)
        with self._lock:
            self._sweep_retention()
            scope = self._intern(scope)
            tiers: list[str] = []
            hits: list[_Block] = []
            for key in keys:
                block = self._visible((scope, key))
                if block is None:
                    break
                tiers.append(self.tiers[block.fastest].name)
                hits.append(block)
            self._count(scope, "lookup_hit_blocks", len(hits))
            self._count(scope, "lookup_miss_blocks", len(keys) - len(hits))
            lease = None
            if pin_ttl_s is not None and hits:
                self._expire_leases()  # a lookup that pins must not let expired pins pile up
                lease = self._pin(hits, pin_ttl_s, owner)
            return LookupResult(len(hits), tuple(tiers), lease)

    def exists(self, scope: Scope, keys: Sequence[BlockKey]) -> list[bool]:
        _check_keys(keys)
        with self._lock:
            scope = self._intern(scope)
            return [self._visible((scope, key)) is not None for key in keys]

    def get_into(self, scope: Scope, key: BlockKey, out: memoryview) -> int | None:
        """Copy the block into ``out``; its length, or None for a miss (recompute it)."""
        return self.get_into_many(scope, [key], [out])[0]

    def get_into_many(
        self, scope: Scope, keys: Sequence[BlockKey], outs: Sequence[memoryview]
    ) -> list[int | None]:
        """Copy each block into its buffer; per block its length, or None for a miss.

        One restore is one call: the index is consulted once, the copies run without the lock
        under transient pins, and blocks served from a slower tier are promoted afterwards.
        """
        _check_keys(keys)
        if len(keys) != len(outs):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} buffers")
        plan: list[tuple[_Block, int] | None] = []
        throttle_s = 0.0
        with self._lock:
            scope = self._intern(scope)
            for key, out in zip(keys, outs, strict=True):
                block = self._visible((scope, key))
                if block is None:
                    plan.append(None)
                    continue
                if len(out) < block.size_bytes:
                    for planned in plan:
                        if planned is not None:
                            self._unpin(planned[0])
                    raise InvalidArgument(
                        f"buffer of {len(out)} B is smaller than the {block.size_bytes} B block"
                    )
                block.pins += 1  # transient: the copy below runs without the lock
                self._touch(block)
                plan.append((block, block.fastest))
                throttle_s += self._throttle_s(block.fastest, block.size_bytes)
        if throttle_s:
            time.sleep(throttle_s)
        sizes: list[int | None] = []
        try:
            for planned, out in zip(plan, outs, strict=True):
                sizes.append(None if planned is None else self._read(planned[0], planned[1], out))
        finally:
            with self._lock:
                for i, planned in enumerate(plan):
                    if planned is None:
                        continue
                    block, source = planned
                    self._unpin(block)
                    if i < len(sizes):
                        self._after_read(block, source, outs[i], sizes[i])
                hits = sum(1 for n in sizes if n is not None)
                self._count(scope, "get_hit_blocks", hits)
                self._count(scope, "get_miss_blocks", len(keys) - hits)
        return sizes

    def _after_read(self, block: _Block, source: int, out: memoryview, n: int | None) -> None:
        if n is None:
            self.counters["checksum_failures"] += 1
            self._forget_tier(block, source)
            return
        self.counters[self._served_counter[source]] += 1
        live = self._blocks.get((block.scope, block.key)) is block and not block.doomed
        if source > 0 and self.config.promote_on_hit and live:
            self._place(block, out[:n], lowest=0, highest=0)
            if 0 in block.tiers:
                self.counters["promotions"] += 1

    def get(self, scope: Scope, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Convenience for scripts and tests: each block's bytes, or None for a miss."""
        out: list[bytes | None] = []
        for key in keys:
            with self._lock:
                block = self._visible((scope, key))
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
        """Store a chain of blocks; ``keys[i-1]`` (or ``parent`` for i=0) is each one's parent.

        Blocks already present are skipped. Returns how many were stored. ``first_depth`` is the
        index of keys[0] in its full chain when the parent is not stored here (defaults to the
        parent's depth + 1, or 0 without a parent).
        """
        _check_keys(keys)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks")
        self._check_sizes([len(memoryview(b)) for b in blocks])
        stored = 0
        with self._lock:
            scope = self._intern(scope)
            self._expire_leases()
            prev = parent
            depth = first_depth if first_depth is not None else self._depth_after(scope, parent)
            for key, data in zip(keys, blocks, strict=True):
                ident = (scope, key)
                existing = self._blocks.get(ident)
                if existing is not None:
                    # A doomed block (deleted while a reader holds it) keeps its storage until
                    # released; a new copy under the same key waits until then.
                    self.counters["put_doomed_blocks" if existing.doomed else "put_dedup_blocks"] += 1
                else:
                    block = _Block(
                        scope,
                        key,
                        tier_key(scope, key),
                        len(data),
                        prev,
                        depth,
                        1.0 + self.config.attention_cost_per_block * depth,
                    )
                    # Pin the parent while the child finds room: evicting it now would make
                    # the child unreachable dead weight.
                    parent_block = self._visible((scope, prev)) if prev is not None else None
                    if parent_block is not None:
                        parent_block.pins += 1
                    # A child never lands in a faster tier than its parent: a chain stays
                    # fast at its head and slow at its tail, the order a restore reads it in.
                    lowest = parent_block.fastest if parent_block is not None else 0
                    try:
                        self._enforce_quota(scope, block.size_bytes, stored, len(keys))
                        self._place(block, data, lowest=lowest, highest=len(self.tiers) - 1)
                    finally:
                        if parent_block is not None:
                            self._unpin(parent_block)
                    if not block.tiers:
                        raise StoreFull(
                            f"no tier can take a {block.size_bytes} B block: all are full of pinned blocks "
                            f"(stored {stored} of {len(keys)} blocks of this chain)"
                        )
                    self._admit(block)
                    if self.config.write_through:
                        for t, persistent in enumerate(self._persistent):
                            if persistent and t not in block.tiers:
                                self._place(block, data, lowest=t, highest=t)
                    self._behind(block)
                    stored += 1
                    self._count(scope, "put_blocks")
                prev = key
                depth += 1
        return stored

    def delete(self, scope: Scope, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; pinned ones vanish now and are freed on their last release."""
        _check_keys(keys)
        with self._lock:
            scope = self._intern(scope)
            removed = 0
            for key in keys:
                block = self._visible((scope, key))
                if block is not None:
                    self._doom(block)
                    removed += 1
            self.counters["deleted_blocks"] += removed
            return removed

    def invalidate(self, namespace: str | None = None, fingerprint: Fingerprint | None = None) -> int:
        """Remove every block of a namespace, of a fingerprint, of both, or (neither) everything."""
        with self._lock:
            pool: Iterable[_Block]
            if namespace is not None:
                pool = list(self._by_namespace.get(namespace, {}).values())
            else:
                pool = list(self._blocks.values())
            victims = [
                b
                for b in pool
                if not b.doomed and (fingerprint is None or b.scope.fingerprint == fingerprint)
            ]
            for block in victims:
                self._doom(block)
            self.counters["invalidated_blocks"] += len(victims)
            log.info(
                "invalidated %d blocks (namespace=%s, fingerprint=%s)",
                len(victims),
                namespace or "*",
                fingerprint.hex() if fingerprint else "*",
            )
            return len(victims)

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
            self._expire_leases()
            pool = (
                self._by_namespace.get(namespace, {}).values()
                if namespace is not None
                else self._blocks.values()
            )
            chosen = [
                b
                for b in pool
                if t in b.tiers
                and not b.doomed
                and (fingerprint is None or b.scope.fingerprint == fingerprint)
            ]
            moved = 0
            for block in sorted(chosen, key=lambda b: -b.depth):
                if not self._evictable_from(block, t):
                    continue  # pinned, or a child stays here
                if len(block.tiers) == 1:
                    data = self._bytes_of(block, t)
                    if data is None:
                        continue
                    self._place(block, data, lowest=t + 1, highest=len(self.tiers) - 1, evict=False)
                    if len(block.tiers) == 1:
                        continue
                    self.counters["demotions"] += 1
                self._forget_tier(block, t)
                moved += 1
            log.info("demoted %d of %d blocks out of %s", moved, len(chosen), tier)
            return moved

    # ----------------------------------------------------------------- leases

    def pin(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Lease:
        """Pin present blocks among ``keys`` until release or ``ttl_s`` (default from config)."""
        _check_keys(keys)
        with self._lock:
            scope = self._intern(scope)
            self._expire_leases()
            present = [b for b in (self._visible((scope, k)) for k in keys) if b is not None]
            return self._pin(present, ttl_s, owner)

    def release(self, lease_id: int, owner: str = "") -> None:
        with self._lock:
            self._expire_leases()
            for block in self.leases.release(lease_id, owner):
                self._unpin(block)

    def _check_sizes(self, sizes: Iterable[int]) -> None:
        """Refuse impossible sizes up front: a block announced huge must not evict anything."""
        for size in sizes:
            if size < 0:
                raise InvalidArgument("block sizes must not be negative")
            if size > self.config.max_block_bytes:
                raise InvalidArgument(
                    f"a block of {size} B is larger than store.max_block_bytes ({self.config.max_block_bytes} B)"
                )

    def _ttl(self, ttl_s: float | None) -> float:
        """A client's lease lifetime: the default when unset, capped by ``max_lease_ttl_s``."""
        if ttl_s is None:
            return min(self.config.lease_ttl_s, self.config.max_lease_ttl_s)
        if not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidArgument(f"a lease lifetime must be a positive number of seconds, got {ttl_s}")
        return min(ttl_s, self.config.max_lease_ttl_s)

    def _pin(self, blocks: Sequence[_Block], ttl_s: float | None, owner: str = "") -> Lease:
        lease = self.leases.grant(blocks, self._ttl(ttl_s), owner)
        for block in blocks:
            block.pins += 1
        return lease

    def _expire_leases(self) -> None:
        self._sweep_retention()
        for (pending,) in self._reservations.expire():
            self.counters["reservations_expired"] += 1
            self._abort_pending(pending)
        for blocks in self.leases.expire():
            self.counters["leases_expired"] += 1
            for block in blocks:
                self._unpin(block)

    def _unpin(self, block: _Block) -> None:
        if block.pins <= 0:
            raise AssertionError(f"pin count of block {block.key.hex()} would go negative")
        block.pins -= 1
        if block.pins == 0:
            if block.doomed:
                self._drop(block)
            elif block.parked:
                block.parked = False
                self._push_all(block)

    # ----------------------------------------------------------------- same-host arena

    @property
    def arena(self) -> DramTier | None:
        """The `dram` tier whose arena same-host clients map, or None without one."""
        return None if self._arena_index is None else self._require_arena()[1]

    def _require_arena(self) -> tuple[int, DramTier]:
        if self._arena_index is None:
            raise FailedPrecondition("this store has no dram arena for same-host clients")
        tier = self.tiers[self._arena_index]
        assert isinstance(tier, DramTier)
        return self._arena_index, tier

    def resolve(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Resolved:
        """Pin the present prefix and make sure each block has an arena copy to read in place."""
        _check_keys(keys)
        ttl_s = self._ttl(ttl_s)
        a, arena = self._require_arena()
        throttle_s = 0.0
        with self._lock:
            scope = self._intern(scope)
            self._expire_leases()
            blocks: list[_Block] = []
            sources: list[str] = []  # the tier each block was found in, before any promotion
            for key in keys:
                block = self._visible((scope, key))
                if block is None:
                    break
                block.pins += 1  # before promotion: making room for the next must not evict it
                source = block.fastest
                if a not in block.tiers and not self._copy_into_arena(block, a, arena):
                    self._unpin(block)
                    break
                blocks.append(block)
                sources.append(self.tiers[source].name)
                throttle_s += self._throttle_s(source, block.size_bytes)
            for block in blocks:
                self._touch(block)
                self._unpin(block)
            self._count(scope, "lookup_hit_blocks", len(blocks))
            self._count(scope, "lookup_miss_blocks", len(keys) - len(blocks))
            lease = self._pin(blocks, ttl_s, owner) if blocks else None
            slots = []
            for block in blocks:
                slot = arena.locate(block.tkey)
                assert slot is not None, "a pinned block lost its arena slot"
                slots.append(ArenaSlot(slot.offset, slot.size_bytes))
            resolved = Resolved(tuple(slots), tuple(sources), lease)
        if throttle_s:
            time.sleep(throttle_s)  # outside the lock: a throttled read delays only its reader
        return resolved

    def _copy_into_arena(self, block: _Block, a: int, arena: DramTier) -> bool:
        """Promote ``block`` into the arena straight from its fastest copy (one copy)."""
        if not self._make_room(a, block.size_bytes):
            return False
        try:
            slot = arena.reserve(block.tkey, block.size_bytes, block.scope.fingerprint, block.meta)
        except TierError:
            return False
        source = block.fastest
        n = self._read(block, source, arena.slot_view(slot))
        if n != block.size_bytes:
            arena.abort(block.tkey)
            if n is None:
                self.counters["checksum_failures"] += 1
                self._forget_tier(block, source)
            return False
        arena.commit(block.tkey)
        block.tiers.add(a)
        block.version += 1
        self._push_all(block)
        self.counters["promotions"] += 1
        return True

    def reserve(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        sizes: Sequence[int],
        parent: BlockKey | None = None,
        ttl_s: float | None = None,
        owner: str = "",
    ) -> Reservation:
        """Arena slots for the new blocks of a chain; see the module docstring."""
        _check_keys(keys)
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        self._check_sizes(sizes)
        ttl_s = self._ttl(ttl_s)
        a, arena = self._require_arena()
        with self._lock:
            scope = self._intern(scope)
            self._expire_leases()
            pinned_parent = self._visible((scope, parent)) if parent is not None else None
            if pinned_parent is not None:
                pinned_parent.pins += 1  # its child is on the way: keep it until commit
            slots: list[ArenaSlot | None] = []
            for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                slot = None
                if self._visible((scope, key)) is None:
                    try:
                        self._enforce_quota(scope, size, i, len(keys))
                    except QuotaExceeded:
                        slots.extend([None] * (len(keys) - i))  # the rest of the chain cannot hang on
                        break
                    if self._make_room(a, size):
                        try:
                            taken = arena.reserve(tier_key(scope, key), size, scope.fingerprint)
                            slot = ArenaSlot(taken.offset, taken.size_bytes)
                            self._ns_reserved[scope.namespace] += size
                        except TierError:
                            slot = None  # another client is writing this key, or no room after all
                slots.append(slot)
            pending = _Pending(
                scope, tuple(keys), tuple(slots), parent, self._depth_after(scope, parent), pinned_parent
            )
            lease = self._reservations.grant([pending], self._ttl(ttl_s), owner)
            return Reservation(lease.lease_id, pending.slots, lease.expires_at_s)

    def commit(self, reservation_id: int, owner: str = "") -> int:
        """Publish a reservation's written slots as blocks; how many were stored."""
        a, arena = self._require_arena()
        with self._lock:
            self._expire_leases()
            (pending,) = self._reservations.release(reservation_id, owner)
            self._unreserve(pending)
            stored = 0
            prev = pending.parent
            for i, (key, slot) in enumerate(zip(pending.keys, pending.slots, strict=True)):
                if slot is not None:
                    tkey = tier_key(pending.scope, key)
                    existing = self._blocks.get((pending.scope, key))
                    if existing is not None:
                        arena.abort(tkey)  # stored meanwhile by another path
                    else:
                        depth = pending.first_depth + i
                        block = _Block(
                            pending.scope,
                            key,
                            tkey,
                            slot.size_bytes,
                            prev,
                            depth,
                            1.0 + self.config.attention_cost_per_block * depth,
                        )
                        arena.commit(tkey, meta=block.meta)
                        block.tiers.add(a)
                        self._admit(block)
                        if self.config.write_through:
                            view = arena.slot_view(ArenaSlotView(slot.offset, slot.size_bytes))
                            for t, persistent in enumerate(self._persistent):
                                if persistent:
                                    self._place(block, view, lowest=t, highest=t)
                        self._behind(block)
                        stored += 1
                        self._count(pending.scope, "put_blocks")
                prev = key
            if pending.pinned_parent is not None:
                self._unpin(pending.pinned_parent)
            return stored

    def abort(self, reservation_id: int, owner: str = "") -> None:
        """Give back a reservation's slots without storing anything."""
        with self._lock:
            self._expire_leases()
            (pending,) = self._reservations.release(reservation_id, owner)
            self._abort_pending(pending)

    def _abort_pending(self, pending: _Pending) -> None:
        _, arena = self._require_arena()
        self._unreserve(pending)
        for key, slot in zip(pending.keys, pending.slots, strict=True):
            if slot is not None:
                arena.abort(tier_key(pending.scope, key))
        if pending.pinned_parent is not None:
            self._unpin(pending.pinned_parent)

    def _unreserve(self, pending: _Pending) -> None:
        ns = pending.scope.namespace
        self._ns_reserved[ns] -= sum(slot.size_bytes for slot in pending.slots if slot is not None)
        if self._ns_reserved[ns] < 0:
            raise AssertionError(f"reserved bytes of {ns} would go negative")
        if not self._ns_reserved[ns]:
            del self._ns_reserved[ns]

    # ----------------------------------------------------------------- stats

    def stats(self) -> StoreStats:
        with self._lock:
            usages = []
            for tier in self.tiers:
                usage = tier.usage()
                usages.append(usage)
            return StoreStats(
                tiers=tuple(usages),
                counters=dict(self.counters),
                namespace_bytes=dict(self._ns_bytes),
                namespace_counters={ns: dict(c) for ns, c in self._ns_counters.items()},
                blocks=sum(1 for b in self._blocks.values() if not b.doomed),
                leases=len(self.leases),
                absent_tiers=self.absent_tiers,
            )

    def tier_of(self, scope: Scope, key: BlockKey) -> str | None:
        with self._lock:
            block = self._visible((scope, key))
            return None if block is None else self.tiers[block.fastest].name

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        """Spill volatile-only blocks to the persistent tier (``persist_on_close``), then close."""
        if self._write_behind is not None:
            self._write_behind.close()  # before the lock: its thread takes it for every block
        with self._lock:
            if self._closed:
                return
            if self.config.persist_on_close:
                self._spill()
            self._closed = True
            try:
                for tier in self.tiers:
                    tier.close()
            finally:
                if self._on_close is not None:
                    self._on_close()

    def _behind(self, block: _Block) -> None:
        """Queue a new block for the write-behind copy (under the lock; never blocks)."""
        wb, p = self._write_behind, self._persistent_index
        if wb is None or p is None or p in block.tiers:
            return
        if wb.offer((block.scope, block.key), block.size_bytes):
            self.counters["write_behind_queued_blocks"] += 1
        else:
            self.counters["write_behind_dropped_blocks"] += 1

    def _copy_behind(self, ident: BlockId) -> None:
        """The write-behind thread's step: copy one block to the persistent tier. The block is
        pinned for the copy, which runs outside the lock (the tier's put may wait for its writer)."""
        p = self._persistent_index
        assert p is not None
        with self._lock:
            block = self._visible(ident)
            if self._closed or block is None or p in block.tiers or not self._make_room(p, block.size_bytes):
                return
            view = self._bytes_of(block, block.fastest)
            if view is None:
                return
            block.pins += 1  # its slot stays put (and allocated) until the copy is done
        copied = False
        try:
            self.tiers[p].put(block.tkey, view, block.scope.fingerprint, block.meta)
            copied = True
        except TierError as exc:  # full after all, or closing: the block stays volatile
            log.debug("write-behind of a %d B block: %s", block.size_bytes, exc)
        finally:
            with self._lock:
                if copied and block.doomed:
                    self.tiers[p].delete(block.tkey)  # deleted while copying: the copy goes too
                elif copied:
                    block.tiers.add(p)
                    block.version += 1
                    self._push_all(block)
                    self.counters["write_behind_blocks"] += 1
                self._unpin(block)

    def _spill(self) -> None:
        """Copy every block held only by volatile tiers down to the first persistent one.

        Parents go first, so that if the persistent tier fills up, what it keeps is prefixes.
        """
        persistent = [t for t, p in enumerate(self._persistent) if p]
        if not persistent:
            return
        target = persistent[0]
        todo = [
            b for b in self._blocks.values() if not b.doomed and not any(self._persistent[t] for t in b.tiers)
        ]
        todo.sort(key=lambda b: (b.depth, -b.priority))
        spilled = 0
        for block in todo:
            data = self._bytes_of(block, block.fastest)
            if data is None:
                continue
            block.pins += 1  # keep it from being chosen to make room for itself
            try:
                self._place(block, data, lowest=target, highest=target)
            finally:
                block.pins -= 1
            spilled += target in block.tiers
        self.flush()
        log.info(
            "spilled %d of %d volatile blocks to %s on close", spilled, len(todo), self.tiers[target].name
        )

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _intern(self, scope: Scope) -> Scope:
        """The one Scope object the index uses for this scope: index probes then compare keys
        by identity instead of calling the dataclass __eq__ per block."""
        return self._scopes.setdefault(scope, scope)

    def _visible(self, ident: BlockId) -> _Block | None:
        block = self._blocks.get(ident)
        if block is None or block.doomed:
            return None
        if block.expires_at_s != math.inf and block.expires_at_s <= self._wall():
            return None  # past its retention: gone for readers now, for the tiers at the sweep
        return block

    def _count(self, scope: Scope, name: str, n: int = 1) -> None:
        self.counters[name] += n
        self._ns_counters.setdefault(scope.namespace, Counter())[name] += n

    def _depth_after(self, scope: Scope, parent: BlockKey | None) -> int:
        if parent is None:
            return 0
        block = self._blocks.get((scope, parent))
        return 0 if block is None else block.depth + 1

    def _admit(self, block: _Block) -> None:
        ident = (block.scope, block.key)
        if not block.stored_at_s:
            block.stored_at_s = self._wall()
        retention = self._retention_of(block.scope.namespace)
        if retention is not None:
            block.expires_at_s = block.stored_at_s + retention
            self._by_age.setdefault(block.scope.namespace, collections.deque()).append(ident)
        self._blocks[ident] = block
        self._by_namespace.setdefault(block.scope.namespace, {})[ident] = block
        self._ns_bytes[block.scope.namespace] += block.size_bytes
        if block.parent is not None:
            self._children.setdefault((block.scope, block.parent), set()).add(block.key)
        self._touch(block)

    def _touch(self, block: _Block) -> None:
        """A hit or a fresh put: raise the block's GDSF priority in every tier holding it."""
        block.hits += 1
        aging = max((self._aging[t] for t in block.tiers), default=0.0)
        block.priority = aging + block.hits * block.cost / max(block.size_bytes, 1)
        block.version += 1
        self._push_all(block)

    def _push_all(self, block: _Block) -> None:
        for t in block.tiers:
            self._seq += 1
            heap = self._heaps[t]
            heapq.heappush(heap, (block.priority, self._seq, block.version, (block.scope, block.key)))
            if len(heap) > 4 * len(self._blocks) + 1024:
                self._compact_heap(t)

    def _compact_heap(self, t: int) -> None:
        """Drop stale entries (every hit pushes a fresh one) so heaps stay O(blocks)."""
        heap = []
        for ident, block in self._blocks.items():
            if t in block.tiers:
                self._seq += 1
                heap.append((block.priority, self._seq, block.version, ident))
        heapq.heapify(heap)
        self._heaps[t] = heap

    def _evictable_from(self, block: _Block, t: int) -> bool:
        if block.pins or t not in block.tiers:
            return False
        for child_key in self._children.get((block.scope, block.key), ()):
            child = self._blocks.get((block.scope, child_key))
            if child is not None and child.tiers and child.fastest <= t:
                return False
        return True

    def _pop_victim(self, t: int) -> _Block | None:
        heap = self._heaps[t]
        while heap:
            priority, _, version, ident = heapq.heappop(heap)
            block = self._blocks.get(ident)
            if block is None or block.version != version:
                continue  # stale entry: the block changed since and has a newer one
            if not self._evictable_from(block, t):
                # Pushed again when it becomes eligible: on its last release if pinned, when
                # its last child here leaves otherwise.
                block.parked = block.parked or block.pins > 0
                continue
            self._aging[t] = max(self._aging[t], priority)
            return block
        return None

    def _make_room(self, t: int, size_bytes: int) -> bool:
        """Evict from tier ``t`` until a block of ``size_bytes`` fits; whether it does."""
        self._expire_leases()
        tier = self.tiers[t]
        stuck: list[_Block] = []  # could neither move down nor go: back in the heap afterwards
        try:
            while not tier.can_store(size_bytes):
                victim = self._pop_victim(t)
                if victim is None:
                    return False
                if not self._evict(victim, t):
                    stuck.append(victim)
            return True
        finally:
            for block in stuck:
                self._push_all(block)

    def _evict(self, block: _Block, t: int) -> bool:
        """Demote ``block`` from tier ``t`` to the next tier with room, or drop it; False when
        it can do neither (no room below, and dropping it would strand a resident child)."""
        if len(block.tiers) == 1 and t + 1 < len(self.tiers):
            data = self._bytes_of(block, t)
            if data is not None:
                self._place(block, data, lowest=t + 1, highest=len(self.tiers) - 1)
                if len(block.tiers) > 1:
                    self.counters["demotions"] += 1
                elif self._children.get((block.scope, block.key)):
                    return False
        self.counters[f"evicted_{self.tiers[t].name}_blocks"] += 1
        self._forget_tier(block, t)
        return True

    def _place(self, block: _Block, data: BytesLike, lowest: int, highest: int, evict: bool = True) -> None:
        """Put a copy into the first tier in [lowest, highest] that has room, or (``evict``)
        can make room."""
        for t in range(lowest, highest + 1):
            if t in block.tiers:
                return
            if not (
                self._make_room(t, block.size_bytes) if evict else self.tiers[t].can_store(block.size_bytes)
            ):
                continue
            try:
                self.tiers[t].put(block.tkey, data, block.scope.fingerprint, block.meta)
            except TierFull:
                continue
            except TierError as exc:
                log.warning("tier %s refused a %d B block: %s", self.tiers[t].name, block.size_bytes, exc)
                continue
            block.tiers.add(t)
            block.version += 1
            self._push_all(block)
            return

    def _bytes_of(self, block: _Block, t: int) -> memoryview | None:
        """The block's bytes in tier ``t`` for copying to another tier; None when unreadable.

        From the arena this is the slot itself (the copy into the next tier is then the only
        one); it stays valid while the caller holds the store lock and the block its slot.
        """
        tier = self.tiers[t]
        if isinstance(tier, DramTier):
            slot = tier.locate(block.tkey)
            if slot is not None:
                return tier.slot_view(slot)
        scratch = memoryview(bytearray(block.size_bytes))
        n = self._read(block, t, scratch)
        return None if n is None else scratch[:n]

    def _throttle_s(self, t: int, nbytes: int) -> float:
        """The delay a throttled tier adds to serving ``nbytes`` (benchmarks; 0 when off)."""
        rate = self.tiers[t].throttle_bytes_per_s
        return nbytes / rate if rate > 0 else 0.0

    def _read(self, block: _Block, t: int, out: memoryview) -> int | None:
        try:
            return self.tiers[t].get_into(block.tkey, out)
        except TierError as exc:
            log.warning("reading a block from %s failed: %s", self.tiers[t].name, exc)
            return None

    def _forget_tier(self, block: _Block, t: int) -> None:
        """Block ``block`` no longer has a copy in tier ``t``."""
        if t in block.tiers:
            block.tiers.discard(t)
            self.tiers[t].delete(block.tkey)
            block.version += 1
            self._push_all(block)
        if not block.tiers:
            self._remove(block)
        self._push_parent(block)

    def _push_parent(self, block: _Block) -> None:
        if block.parent is not None:
            parent = self._blocks.get((block.scope, block.parent))
            if parent is not None:
                self._push_all(parent)

    def _doom(self, block: _Block) -> None:
        if block.pins:
            block.doomed = True
        else:
            self._drop(block)

    def _drop(self, block: _Block) -> None:
        for t in sorted(block.tiers):
            self.tiers[t].delete(block.tkey)
        block.tiers.clear()
        self._remove(block)
        self._push_parent(block)

    def _remove(self, block: _Block) -> None:
        ident = (block.scope, block.key)
        if self._blocks.get(ident) is not block:
            return
        del self._blocks[ident]
        ns = block.scope.namespace
        del self._by_namespace[ns][ident]
        self._ns_bytes[ns] -= block.size_bytes
        if not self._ns_bytes[ns]:
            del self._ns_bytes[ns]
        if block.parent is not None:
            siblings = self._children.get((block.scope, block.parent))
            if siblings is not None:
                siblings.discard(block.key)
                if not siblings:
                    del self._children[(block.scope, block.parent)]

    def _retention_of(self, namespace: str) -> float | None:
        return self.config.retention_s.get(namespace, self.config.default_retention_s)

    def _sweep_retention(self) -> None:
        """Remove blocks past their namespace's retention from every tier; at most every
        RETENTION_SWEEP_S (called from every operation that collects expired leases)."""
        if not self._by_age:
            return  # no namespace has a retention: nothing to sweep, no clock to read
        now = self._wall()
        if now < self._next_sweep_s:
            return
        self._next_sweep_s = now + RETENTION_SWEEP_S
        for queue in self._by_age.values():
            while queue:
                block = self._blocks.get(queue[0])
                if block is not None and not block.doomed and block.expires_at_s > now:
                    break  # stored later than everything behind it: nothing more is due
                queue.popleft()
                if block is not None and not block.doomed and block.expires_at_s <= now:
                    self._doom(block)
                    self.counters["retention_expired_blocks"] += 1

    def _quota_of(self, namespace: str) -> int | None:
        return self.config.quota_bytes.get(namespace, self.config.default_quota_bytes)

    def _enforce_quota(self, scope: Scope, size_bytes: int, stored: int, chain: int) -> None:
        quota = self._quota_of(scope.namespace)
        if quota is None:
            return
        if size_bytes > quota:
            raise QuotaExceeded(
                f"a {size_bytes} B block exceeds namespace {scope.namespace!r}'s quota of {quota} B"
            )
        # Reserved-but-uncommitted arena slots count too: a quota bounds what a tenant holds.
        while self._ns_bytes[scope.namespace] + self._ns_reserved[scope.namespace] + size_bytes > quota:
            held = self._by_namespace.get(scope.namespace, {})
            candidates = [b for b in held.values() if self._leaf_anywhere(b)]
            if not candidates:
                self.counters["quota_rejections"] += 1
                raise QuotaExceeded(
                    f"namespace {scope.namespace!r} holds {self._ns_bytes[scope.namespace]} B of its "
                    f"{quota} B quota in pinned blocks or this chain's own prefix (stored {stored} "
                    f"of {chain} blocks); release leases or raise the quota"
                )
            victim = min(candidates, key=lambda b: b.priority)
            self.counters["quota_evictions"] += 1
            self._drop(victim)

    def _leaf_anywhere(self, block: _Block) -> bool:
        return not block.pins and not block.doomed and not self._children.get((block.scope, block.key))

    def _rebuild(self) -> None:
        """Index what the persistent tiers already hold: the cache survives restarts."""
        found = 0
        for t, tier in enumerate(self.tiers):
            unnamed = 0
            for stored in tier.scan():
                ident = parse_tier_key(stored.key)
                if ident is None or ident[0].fingerprint != stored.fingerprint:
                    unnamed += 1
                    tier.delete(stored.key)
                    continue
                block = self._blocks.get(ident)
                if block is None:
                    depth, parent, stored_at_s = _parse_meta(stored.meta)
                    block = _Block(
                        ident[0],
                        ident[1],
                        stored.key,
                        stored.size_bytes,
                        parent,
                        depth,
                        1.0 + self.config.attention_cost_per_block * depth,
                        stored_at_s=stored_at_s,
                    )
                    block.tiers.add(t)
                    self._admit(block)
                    found += 1
                else:
                    block.tiers.add(t)
                    self._push_all(block)
            if unnamed:
                log.warning("tier %s held %d blocks the store cannot name; deleted them", tier.name, unnamed)
        for queue in self._by_age.values():  # disk order is no age order
            ordered = sorted(queue, key=lambda ident: self._blocks[ident].expires_at_s)
            queue.clear()
            queue.extend(ordered)
        if found:
            log.info("rebuilt the index: %d blocks found on persistent tiers", found)

    def fingerprint_usage(self, namespace: str | None = None) -> dict[Fingerprint, tuple[int, int]]:
        """(blocks, bytes) per model fingerprint, of one namespace or of all (for ``stats``)."""
        with self._lock:
            blocks = (
                self._blocks.values() if namespace is None else self._by_namespace.get(namespace, {}).values()
            )
            usage: dict[Fingerprint, list[int]] = {}
            for b in blocks:
                if not b.doomed:
                    entry = usage.setdefault(b.scope.fingerprint, [0, 0])
                    entry[0] += 1
                    entry[1] += b.size_bytes
        return {fp: (n, nbytes) for fp, (n, nbytes) in usage.items()}

    def tier_usage_of(self, namespace: str) -> dict[str, tuple[int, int]]:
        """(blocks, bytes) one namespace holds in each tier (a non-admin's ``stats``)."""
        usage = {tier.name: [0, 0] for tier in self.tiers}
        with self._lock:
            for b in self._by_namespace.get(namespace, {}).values():
                if not b.doomed:
                    for t in b.tiers:
                        entry = usage[self.tiers[t].name]
                        entry[0] += 1
                        entry[1] += b.size_bytes
        return {name: (n, nbytes) for name, (n, nbytes) in usage.items()}

    def blocks(self) -> Iterator[tuple[Scope, BlockKey, str]]:
        """Every visible block with its fastest tier's name (for tests and tools)."""
        with self._lock:
            snapshot = [
                (b.scope, b.key, self.tiers[b.fastest].name) for b in self._blocks.values() if not b.doomed
            ]
        return iter(snapshot)


_META = struct.Struct("<Id")  # depth, stored_at_s; then the parent key if any
_OLD_META = struct.Struct("<I")  # before retention: depth only


def _parse_meta(meta: bytes) -> tuple[int, BlockKey | None, float]:
    """(depth, parent, stored_at_s) from a block's stored metadata; (0, None, 0.0) when absent
    or unreadable (stored_at_s 0.0: unknown, counted from now)."""
    for layout, has_time in ((_META, True), (_OLD_META, False)):
        if len(meta) in (layout.size, layout.size + 32):
            fields = layout.unpack_from(meta)
            parent = BlockKey(meta[layout.size :]) if len(meta) > layout.size else None
            return int(fields[0]), parent, float(fields[1]) if has_time else 0.0
    return 0, None, 0.0


def _check_keys(keys: Sequence[BlockKey]) -> None:
    if all(type(key) is bytes and len(key) == 32 for key in keys):
        return
    for key in keys:
        try:
            check_key(key)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
