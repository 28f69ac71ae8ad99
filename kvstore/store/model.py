"""The store's vocabulary: scopes and block ids, tier keys, the index entry of a block, the
configuration, and the small frozen results the store's calls return.

Nothing here takes a lock or touches a tier.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, Fingerprint, check_key
from kvstore.leases import Lease
from tiers import Slot, TierKey, TierUsage

MAX_NAMESPACE_BYTES = 255

ArenaSlot = Slot
"""Where a block's bytes sit in the `dram` arena (offset, size_bytes)."""


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

# The fleet's invalidation marks and ledgers (kvstore.store.invalidations, ledger): a reserved
# fingerprint of every namespace, exempt from eviction, quotas and retention on a shared node.
MARK_FINGERPRINT = Fingerprint(hashlib.blake2b(b"kvstore invalidation marks", digest_size=32).digest())


def tier_key(scope: Scope, key: BlockKey) -> TierKey:
    return TierKey(tier_key_prefix(scope) + key)


def tier_key_prefix(scope: Scope) -> bytes:
    """What every tier key of ``scope`` starts with: ``tier_key(scope, key)`` is it + key."""
    ns = scope.namespace.encode()
    return bytes([len(ns)]) + ns + scope.fingerprint


def namespace_of_tier_key(raw: bytes) -> str:
    """The namespace a tier key belongs to (what its encryption key is chosen by)."""
    return bytes(raw[1 : 1 + raw[0]]).decode(errors="replace") if raw else ""


_PLAIN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-")


def shared_key_name(raw: bytes) -> bytes:
    """A tier key, or the start of one that ends with its namespace, as a shared store names it:
    the namespace percent-encoded (letters, digits and ``/._-`` stay), ``:``, then the rest. A
    namespace never contains an unescaped ``:``, so ``t/tenant-a:`` begins the keys of that
    namespace alone: what an invalidation scans for, and what a Redis ACL pattern can confine a
    tenant to (``~kvs:t/tenant-a:*``)."""
    if not raw:
        return b""
    n = raw[0]
    name = b"".join(bytes([c]) if c in _PLAIN else b"%%%02X" % c for c in raw[1 : 1 + n])
    return name + b":" + bytes(raw[1 + n :])


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
    """Placement, leases, quotas, retention and the copies kept on the persistent tier."""

    write_through: bool = False  # write the persistent tier on every put, not only on demotion
    promote_on_hit: bool = True  # copy a block hit in a slower tier into the fastest
    lease_ttl_s: float = 5.0  # default lifetime of a pin
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
    # While the arena has less than this fraction free, its next victims get a copy on the
    # persistent tier first, on a thread (kvstore.store.cleaner); 0 turns it off
    clean_ahead: float = 0.5

    def __post_init__(self) -> None:
        # Refused here, before a store builds anything (tiers, threads) it would have to undo.
        if not 0.0 <= self.clean_ahead <= 1.0:
            raise ValueError(f"clean_ahead must be in [0, 1] (0 = off), got {self.clean_ahead}")


@dataclass(frozen=True)
class LookupResult:
    """``hit_blocks`` leading keys are present; ``tiers[i]`` names the tier serving block i."""

    hit_blocks: int
    tiers: tuple[str, ...]
    lease: Lease | None = None
    # With ``slots``, a pinned lookup's arena slot of each local hit (None: the arena holds no
    # copy); none at all when the arena reads throttled. Read in place while ``lease`` holds
    slots: tuple[ArenaSlot | None, ...] = ()


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


@dataclass(eq=False, slots=True)
class Block:
    """One block in the index: where its copies are and what eviction and pins know of it.

    ``pins``, ``doomed`` and ``parked`` change only through ``Pins`` (kvstore.store.pins);
    ``tiers`` and ``version`` only through ``Placement`` and the arena calls; ``hits`` and
    ``priority`` only through ``Eviction.touch``.
    """

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
    version: int = 0  # bumped on every change that makes its heap entries stale
    doomed: bool = False  # deleted while pinned: invisible, freed on the last release
    parked: bool = False  # popped from a heap while pinned: push it again on the last release
    stored_at_s: float = 0.0  # wall clock (time.time) when first stored; kept in its meta
    expires_at_s: float = math.inf  # retention: invisible from then on, removed by the sweep

    @property
    def ident(self) -> BlockId:
        return (self.scope, self.key)

    @property
    def fastest(self) -> int:
        return min(self.tiers)

    @property
    def meta(self) -> bytes:
        """Chain links and birth time kept with the bytes, so a restart restores prefix-aware
        eviction and retention."""
        return _META.pack(self.depth, self.stored_at_s) + (self.parent or b"")


def new_block(
    config: StoreConfig,
    scope: Scope,
    key: BlockKey,
    size_bytes: int,
    parent: BlockKey | None,
    depth: int,
    tkey: TierKey | None = None,
    stored_at_s: float = 0.0,
) -> Block:
    """A fresh index entry; its recompute cost grows with its depth in the chain. ``tkey``:
    ``tier_key(scope, key)`` where the caller has it already. ``stored_at_s``: its birth time,
    set before its bytes reach a tier, whose metadata keeps it (0.0: set on admission)."""
    cost = 1.0 + config.attention_cost_per_block * depth
    return Block(
        scope, key, tkey or tier_key(scope, key), size_bytes, parent, depth, cost, stored_at_s=stored_at_s
    )


_META = struct.Struct("<Id")  # depth, stored_at_s; then the parent key if any
_OLD_META = struct.Struct("<I")  # before retention: depth only


def parse_meta(meta: bytes) -> tuple[int, BlockKey | None, float]:
    """(depth, parent, stored_at_s) from a block's stored metadata; (0, None, 0.0) when absent
    or unreadable (stored_at_s 0.0: unknown, counted from now)."""
    for layout, has_time in ((_META, True), (_OLD_META, False)):
        if len(meta) in (layout.size, layout.size + 32):
            fields = layout.unpack_from(meta)
            parent = BlockKey(meta[layout.size :]) if len(meta) > layout.size else None
            return int(fields[0]), parent, float(fields[1]) if has_time else 0.0
    return 0, None, 0.0


_BYTES, _KEY_LENGTH = frozenset({bytes}), frozenset({32})


def check_keys(keys: Sequence[BlockKey]) -> None:
    # The usual case in two passes in C, no frame a key (a lookup of 64 keys: ~2 us, where a
    # generator over them took ~8 under load)
    if set(map(type, keys)) <= _BYTES and set(map(len, keys)) <= _KEY_LENGTH:
        return
    for key in keys:
        try:
            check_key(key)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc


def check_sizes(sizes: Sequence[int], max_block_bytes: int) -> None:
    """Refuse impossible sizes up front: a block announced huge must not evict anything."""
    for size in sizes:
        if size < 0:
            raise InvalidArgument("block sizes must not be negative")
        if size > max_block_bytes:
            raise InvalidArgument(
                f"a block of {size} B is larger than store.max_block_bytes ({max_block_bytes} B)"
            )
