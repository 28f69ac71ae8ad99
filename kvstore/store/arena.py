"""The same-host data plane: two-phase calls on the `dram` arena, which other processes map.

    resolve(scope, keys, ttl_s)    -> Resolved: arena slots of the present prefix, pinned under
                                   a lease; blocks found only in other tiers are copied into
                                   the arena first. The caller reads the slots, then releases.
    reserve(scope, keys, sizes)    -> Reservation: arena slots for new blocks (None for keys
                                   already present, or deleted while a reader still holds
                                   them); the caller writes them, then
    commit(reservation_id)         publishes them, or abort(reservation_id) gives them back.
                                   An uncommitted reservation expires like a lease.

Promotion runs outside the store lock: under it, ``resolve`` pins the block and reserves an
arena slot; the copy from the slower tier then runs without it, so a slow medium delays only
this reader; under the lock again the slot is committed (or aborted when the read failed its
checks, which ends the prefix there). A block another resolve is promoting is waited for, after
this one's own copies are done (two resolves never wait on each other).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, QuotaExceeded
from kvstore.keys import BlockKey
from kvstore.leases import LeaseTable
from kvstore.store.model import (
    ArenaSlot,
    Block,
    BlockId,
    Reservation,
    Resolved,
    Scope,
    check_keys,
    check_sizes,
    new_block,
    tier_key_prefix,
)
from kvstore.store.parts import StoreParts
from kvstore.store.placement import PACE_S
from tiers import InPlaceTier, TierError, TierKey

PROMOTION_WAIT_S = 0.05  # how often a resolve waiting on another's promotion looks again


@dataclass(eq=False)
class _Pending:
    scope: Scope
    keys: tuple[BlockKey, ...]
    tkeys: tuple[TierKey, ...]  # each key's name in the arena, computed once
    slots: tuple[ArenaSlot | None, ...]
    parent: BlockKey | None
    pinned_parent: Block | None


@dataclass(eq=False)
class _Promotion:
    block: Block
    slot: ArenaSlot
    source: int


class ArenaCalls:
    """See the module docstring. Thread-safe: every call takes the store lock itself."""

    def __init__(
        self,
        parts: StoreParts,
        clock: Callable[[], float],
        on_new_blocks: Callable[[Sequence[Block], Callable[[Block], memoryview]], None],
    ) -> None:
        self._p = parts
        self._on_new_blocks = on_new_blocks  # under the lock: write-through and write-behind
        self._reservations: LeaseTable[_Pending] = LeaseTable(clock)
        self._promoting: set[BlockId] = set()
        parts.expire_reservations = self._expire_reservations

    def _expire_reservations(self) -> None:
        for (pending,) in self._reservations.expire():
            self._p.counters["reservations_expired"] += 1
            self._abort_pending(pending)

    # ----------------------------------------------------------------- reads in place

    def resolve(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Resolved:
        """Pin the present prefix and make sure each block has an arena copy to read in place."""
        p = self._p
        check_keys(keys)
        ttl_s = p.pins.ttl(ttl_s)
        a, arena = p.arena()
        held: list[Block] = []  # the prefix so far, each under a transient hold
        sources: list[str] = []  # the tier each block was found in, before any promotion
        delay_s = 0.0
        with p.locked():
            scope = p.index.intern(scope)
            p.expire()
        done = False
        deadline = time.monotonic() + PACE_S  # for room in the arena that waits on the disk
        while not done:
            promotions: list[_Promotion] = []
            room_coming = 0  # bytes of arena room a promotion waits for (retired slots)
            with p.locked():
                while len(held) < len(keys):
                    block = p.index.visible((scope, keys[len(held)]))
                    if block is None:
                        done = True
                        break
                    if a not in block.tiers and block.ident in self._promoting:
                        if promotions:
                            break  # copy ours first; then wait for theirs
                        p.changed.wait(PROMOTION_WAIT_S)
                        continue
                    p.pins.hold(block)  # before promotion: making room for the next must not evict it
                    source = block.fastest
                    if a not in block.tiers:
                        promotion = self._start_promotion(block, a, arena)
                        if promotion is None:
                            p.pins.unhold(block)
                            # Room on its way (victims waiting for the disk): wait outside the
                            # lock, then go on from this block; else the prefix ends here.
                            room_coming = block.size_bytes if time.monotonic() < deadline else 0
                            done = not room_coming
                            break
                        promotions.append(promotion)
                    else:
                        delay_s += p.tiers[source].in_place_read_s(block.size_bytes)
                    held.append(block)
                    sources.append(p.tiers[source].name)
                else:
                    done = True
            if promotions:
                failed_at = self._finish_promotions(promotions, arena, a)
                if failed_at is not None:
                    cut = held.index(failed_at)
                    with p.locked():
                        for block in held[cut:]:
                            p.pins.unhold(block)
                    del held[cut:], sources[cut:]
                    done = True
            if room_coming and not done:
                done = not p.placement.wait_retired(a, room_coming, deadline - time.monotonic())
        with p.locked():
            # The lease first, then the transient holds go: a block deleted while this call
            # copied outside the lock is doomed, and must stay until the lease ends.
            lease = p.pins.grant(held, ttl_s, owner) if held else None
            p.eviction.hit_many(held)  # each is in the heaps already: a promotion pushed it
            for block in held:
                p.pins.unhold(block)
            p.count(scope, "lookup_hit_blocks", len(held))
            p.count(scope, "lookup_miss_blocks", len(keys) - len(held))
            slots = []
            for block in held:
                slot = arena.locate(block.tkey)
                assert slot is not None, "a pinned block lost its arena slot"
                slots.append(slot)
            resolved = Resolved(tuple(slots), tuple(sources), lease)
        p.wait(delay_s)  # a throttled arena delays only its reader
        return resolved

    def _start_promotion(self, block: Block, a: int, arena: InPlaceTier) -> _Promotion | None:
        """Under the lock: an arena slot for ``block``, to fill outside it; None without room."""
        if not self._p.placement.make_room(a, block.size_bytes):
            return None
        try:
            slot = arena.reserve(block.tkey, block.size_bytes, block.scope.fingerprint, block.meta)
        except TierError:
            return None
        self._promoting.add(block.ident)
        return _Promotion(block, slot, block.fastest)

    def _finish_promotions(self, promotions: list[_Promotion], arena: InPlaceTier, a: int) -> Block | None:
        """Copy each block into its slot (outside the lock), then publish the slots; the first
        block whose read failed, or None."""
        p = self._p
        sizes = [p.placement.read(x.block, x.source, arena.slot_view(x.slot)) for x in promotions]
        failed: Block | None = None
        with p.locked():
            for x, n in zip(promotions, sizes, strict=True):
                self._promoting.discard(x.block.ident)
                if n != x.block.size_bytes:
                    arena.abort(x.block.tkey)
                    if n is None:
                        p.placement.failed_read(x.block, x.source)
                    failed = failed or x.block
                    continue
                arena.commit(x.block.tkey)
                p.placement.added(x.block, a)
                p.counters["promotions"] += 1
            p.changed.notify_all()
        return failed

    # ----------------------------------------------------------------- writes in place

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
        p = self._p
        check_keys(keys)
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        check_sizes(sizes, p.config.max_block_bytes)
        ttl_s = p.pins.ttl(ttl_s)
        a, arena = p.arena()
        with p.locked():
            needed = p.new_sizes(p.index.intern(scope), keys, sizes)
        held = p.placement.pace(a, needed, PACE_S)  # a disk that is behind slows this writer only
        with p.locked():
            p.placement.use(held)  # the room it waited for, taken by _take_slots under this same hold
            scope = p.index.intern(scope)
            p.expire()
            pinned_parent = p.index.visible((scope, parent)) if parent is not None else None
            if pinned_parent is not None:
                p.pins.hold(pinned_parent)  # its child is on the way: keep it until commit
            prefix = tier_key_prefix(scope)
            tkeys = tuple([TierKey(prefix + key) for key in keys])
            wanted: list[int] = []  # the blocks to give a slot, their bytes held against the quota
            limited = p.governance.limited(scope.namespace)
            for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                existing = p.vacate((scope, key))
                if existing is not None:
                    if existing.doomed:
                        p.counters["put_doomed_blocks"] += 1  # no slot: the writer skips this block
                    continue
                if limited:
                    try:
                        p.governance.check(scope, size, i, len(keys))
                    except QuotaExceeded:
                        break  # the rest of the chain cannot hang on
                    p.governance.reserve(scope.namespace, size)
                wanted.append(i)
            if not limited and wanted:  # no quota to check block by block: held in one sum
                p.governance.reserve(scope.namespace, sum(sizes[i] for i in wanted))
            try:
                taken = self._take_slots(a, arena, [(tkeys[i], sizes[i]) for i in wanted], scope.fingerprint)
            except BaseException:  # the arena closing under us: nothing of this call may stay held
                p.governance.unreserve(scope.namespace, sum(sizes[i] for i in wanted))
                if pinned_parent is not None:
                    p.pins.unhold(pinned_parent)
                raise
            slots: list[ArenaSlot | None] = [None] * len(keys)
            for i, slot in zip(wanted, taken, strict=True):
                if slot is None:
                    p.governance.unreserve(scope.namespace, sizes[i])
                slots[i] = slot
            pending = _Pending(scope, tuple(keys), tkeys, tuple(slots), parent, pinned_parent)
            lease = self._reservations.grant([pending], ttl_s, owner)
            return Reservation(lease.lease_id, pending.slots, lease.expires_at_s)

    def _take_slots(
        self, a: int, arena: InPlaceTier, items: list[tuple[TierKey, int]], fingerprint: bytes
    ) -> list[ArenaSlot | None]:
        """Under the lock: a reserved arena slot for each (key, size) of new blocks, making room
        where the arena has none; None for one it cannot make room for, or whose key another
        client is writing. The slots are asked for first, all in one call, so the usual case
        (room) costs one call into the tier."""
        slots = arena.reserve_many(items, fingerprint)
        while len(slots) < len(items):  # the arena is full at items[len(slots)]
            first = len(slots)
            size = items[first][1]
            run = first + 1  # the blocks of this size from here: room for all of them at once
            while run < len(items) and items[run][1] == size:
                run += 1
            # As far as eviction gets (pinned blocks may stop it short): what fits is reserved.
            self._p.placement.make_room(a, size, _room_for(arena, size, run - first), size * (run - first))
            slots += arena.reserve_many(items[first:], fingerprint) or [None]
        return slots

    def commit(self, reservation_id: int, owner: str = "") -> int:
        """Publish a reservation's written slots as blocks; how many were stored."""
        p = self._p
        a, arena = p.arena()
        with p.locked():
            p.expire()
            (pending,) = self._reservations.release(reservation_id, owner)
            self._unreserve(pending)
            scope = pending.scope
            # The parent as it stands now: a pipelined write reserves a chunk before the chunk
            # holding its parent is committed.
            first_depth = p.index.depth_after(scope, pending.parent)
            now = p.wall()  # in the journal's record of each block: salvage keeps its birth
            blocks: list[Block] = []
            prev = pending.parent
            for i, (key, tkey, slot) in enumerate(
                zip(pending.keys, pending.tkeys, pending.slots, strict=True)
            ):
                if slot is not None:
                    if p.index.get((scope, key)) is not None:
                        arena.abort(tkey)  # stored meanwhile by another path
                    else:
                        block = new_block(
                            p.config, scope, key, slot.size_bytes, prev, first_depth + i, tkey, now
                        )
                        block.tiers.add(a)
                        blocks.append(block)
                prev = key
            arena.commit_many([(block.tkey, block.meta) for block in blocks])
            p.index.admit_many(blocks)
            if p.placement.changes is not None:
                p.placement.changes.stored(blocks, a)
            p.eviction.touch_many(blocks)
            self._on_new_blocks(blocks, lambda block: slot_bytes(arena, block))
            p.count(scope, "put_blocks", len(blocks))
            if pending.pinned_parent is not None:
                p.pins.unhold(pending.pinned_parent)
            return len(blocks)

    def abort(self, reservation_id: int, owner: str = "") -> None:
        """Give back a reservation's slots without storing anything."""
        with self._p.locked():
            self._p.expire()
            (pending,) = self._reservations.release(reservation_id, owner)
            self._abort_pending(pending)

    def _abort_pending(self, pending: _Pending) -> None:
        _, arena = self._p.arena()
        self._unreserve(pending)
        for tkey, slot in zip(pending.tkeys, pending.slots, strict=True):
            if slot is not None:
                arena.abort(tkey)
        if pending.pinned_parent is not None:
            self._p.pins.unhold(pending.pinned_parent)

    def _unreserve(self, pending: _Pending) -> None:
        self._p.governance.unreserve(
            pending.scope.namespace, sum(slot.size_bytes for slot in pending.slots if slot is not None)
        )


def _room_for(arena: InPlaceTier, size_bytes: int, count: int) -> Callable[[], bool]:
    """Whether the arena has a slot for each of ``count`` blocks of ``size_bytes``."""
    return lambda: arena.room_for(size_bytes, count) >= count


def slot_bytes(arena: InPlaceTier, block: Block) -> memoryview:
    """The arena bytes of a block just committed there (under the lock: it cannot move)."""
    slot = arena.locate(block.tkey)
    if slot is None:
        raise KeyError(f"block {block.key.hex()} has no slot in the arena")
    return arena.slot_view(slot)
