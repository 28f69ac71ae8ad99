"""Reads: lookups and restores, each consulting the index once under the store lock, the copies
out of the tiers running outside it under transient holds (``Pins.hold_many``); a hit from a
slower tier is promoted to the first tier afterwards (``promote_on_hit``). Past the local
prefix, the fleet's remote tier is asked (``kvstore.store.remote``), outside the lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.store.counts import Counts
from kvstore.store.eviction import Eviction
from kvstore.store.governance import Governance
from kvstore.store.index import BlockIndex
from kvstore.store.model import ArenaSlot, Block, LookupResult, Scope, StoreConfig, check_keys
from kvstore.store.parts import Expiry, Locked
from kvstore.store.pins import Pins
from kvstore.store.placement import Placement
from kvstore.store.remote import RemoteCalls
from tiers import InPlaceTier, Tier
from tiers.throttle import throttle_of

_TIERS_OF = attrgetter("tiers")
REMOTE = "remote"  # the tier name lookups report for blocks found only in the remote tier


class Reads:
    """See the module docstring. Thread-safe: every call takes the store lock itself."""

    def __init__(
        self,
        config: StoreConfig,
        tiers: Sequence[Tier],
        arena: tuple[int, InPlaceTier] | None,
        lock: Locked,
        counts: Counts,
        index: BlockIndex,
        eviction: Eviction,
        pins: Pins,
        placement: Placement,
        governance: Governance,
        expire: Expiry,
        remote: RemoteCalls | None,
    ) -> None:
        """``arena``: the same-host arena's place in ``tiers`` and the arena, where there is one."""
        self._config = config
        self._tiers = tiers
        self._arena = arena
        self._lock = lock
        self._counts = counts
        self._index = index
        self._eviction = eviction
        self._pins = pins
        self._placement = placement
        self._governance = governance
        self._expire = expire
        self._remote = remote
        self._served_counter = [f"get_{t.name}_blocks" for t in tiers]
        self._arena_throttle = None if arena is None else throttle_of(tiers[arena[0]])

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
        check_keys(keys)
        with self._lock:
            self._governance.sweep()
            scope = self._index.intern(scope)
            hits = self._index.prefix(scope, keys)
            names = [tier.name for tier in self._tiers]
            # each one's fastest tier, in C (a frame a block was a tenth of a lookup's time)
            tiers = list(map(names.__getitem__, map(min, map(_TIERS_OF, hits))))
            self._counts.count(scope, "lookup_hit_blocks", len(hits))
            self._counts.count(scope, "lookup_miss_blocks", len(keys) - len(hits))
            lease = None
            if pin_ttl_s is not None and hits:
                self._expire()  # a lookup that pins must not let expired pins pile up
                lease = self._pins.grant(hits, pin_ttl_s, owner)
            in_place = self._slots_of(hits) if slots and lease is not None else ()
        # Past the local prefix, the fleet's remote tier (outside the lock; it is not pinned:
        # a restore that finds a block gone there gets a shorter prefix)
        more = self._remote.more(scope, keys[len(hits) :]) if self._remote is not None else 0
        return LookupResult(len(hits) + more, (*tiers, *(REMOTE,) * more), lease, in_place)

    def _slots_of(self, blocks: Sequence[Block]) -> tuple[ArenaSlot | None, ...]:
        """Under the lock: each pinned block's arena slot, None where the arena holds no copy; no
        slots at all when the arena reads throttled (its delay is waited out in ``resolve``)."""
        if self._arena is None:
            return ()
        a, arena = self._arena
        throttle = self._arena_throttle
        if not blocks or (throttle is not None and throttle.in_place_read_s(blocks[0].size_bytes)):
            return ()
        found = arena.locate_many([block.tkey for block in blocks])
        return tuple(slot if a in block.tiers else None for slot, block in zip(found, blocks, strict=True))

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
        check_keys(keys)
        if len(keys) != len(outs):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} buffers")
        if self._remote is not None:  # remote blocks continuing the local prefix come here first
            self._remote.read_through(scope, keys)
        # A few tight loops under one lock hold, before and after the copies: a 256 KiB block
        # copies in ~15 us, so each microsecond of bookkeeping per block shows.
        with self._lock:
            plan = self._index.visible_many(self._index.intern(scope), keys)
            at = [i for i, block in enumerate(plan) if block is not None]
            held = [block for block in plan if block is not None]
            for i, block in zip(at, held, strict=True):
                if len(outs[i]) < block.size_bytes:
                    raise InvalidArgument(
                        f"buffer of {len(outs[i])} B is smaller than the {block.size_bytes} B block"
                    )
            self._pins.hold_many(held)  # the copies below run without the lock
            self._eviction.hit_many(held)
            sources = [min(block.tiers) for block in held]
        into = [outs[i] for i in at]
        sizes: list[int | None] = []
        try:
            self._placement.read_many(held, sources, into, sizes)
        finally:
            with self._lock:
                self._after_reads(held, sources, into, sizes)
                hits = len(sizes) - sizes.count(None)
                self._counts.count(scope, "get_hit_blocks", hits)
                self._counts.count(scope, "get_miss_blocks", len(keys) - hits)
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
        self._pins.unhold_many(held)
        fast_hits = 0
        for block, t, out, n in zip(held, sources, outs, sizes, strict=False):  # sizes may be short
            if t == 0 and n is not None:
                fast_hits += 1
            else:
                self._after_read(block, t, out, n)
        if fast_hits:
            self._counts[self._served_counter[0]] += fast_hits

    def _after_read(self, block: Block, source: int, out: memoryview, n: int | None) -> None:
        if n is None:
            self._placement.failed_read(block, source)
            return
        self._counts[self._served_counter[source]] += 1
        if source > 0 and self._config.promote_on_hit and self._index.is_current(block):
            self._placement.place(block, out[:n], lowest=0, highest=0)
            if 0 in block.tiers:
                self._counts["promotions"] += 1

    def heads(self, scope: Scope, keys: Sequence[BlockKey], n: int) -> list[bytes]:
        """The first ``n`` bytes of each block of the present prefix of ``keys`` (fewer of a
        shorter block): what a sidecar checks of a shared node's copy (its header) before it
        promises it. Out of each block's fastest tier, the arena's slot sliced, a slower tier's
        value read whole (nvme: compressed or sealed, its head is not at its front); nothing is
        promoted or counted as a hit (nothing was restored). A copy that fails its tier's
        checks is forgotten there and ends the prefix; the remote tier is not asked."""
        check_keys(keys)
        with self._lock:
            held = self._index.prefix(self._index.intern(scope), keys)
            self._pins.hold_many(held)  # the reads below run without the lock
            sources = [min(block.tiers) for block in held]
        out: list[bytes] = []
        failed: tuple[Block, int] | None = None
        try:
            for block, t in zip(held, sources, strict=True):
                value = self._placement.bytes_of(block, t)
                if value is None:
                    failed = block, t
                    break
                out.append(bytes(value[:n]))
        finally:
            with self._lock:
                self._pins.unhold_many(held)
                if failed is not None:
                    self._placement.failed_read(*failed)
        return out

    def get(self, scope: Scope, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Convenience for scripts and tests: each block's bytes, or None for a miss."""
        if self._remote is not None:
            self._remote.read_through(scope, keys)
        out: list[bytes | None] = []
        for key in keys:
            with self._lock:
                block = self._index.visible((scope, key))
                size = block.size_bytes if block else 0
            buf = bytearray(size)
            n = self.get_into(scope, key, memoryview(buf)) if block else None
            out.append(None if n is None else bytes(buf[:n]))
        return out
