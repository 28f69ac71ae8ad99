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

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, QuotaExceeded
from kvstore.keys import BlockKey
from kvstore.leases import LeaseTable
from kvstore.store.counts import Counts
from kvstore.store.eviction import Eviction
from kvstore.store.governance import Governance
from kvstore.store.held import Held
from kvstore.store.index import BlockIndex
from kvstore.store.model import (
    ArenaSlot,
    Block,
    BlockId,
    Reservation,
    Resolved,
    Scope,
    StoreConfig,
    check_keys,
    check_sizes,
    new_block,
    tier_key_prefix,
)
from kvstore.store.pacing import PACE_S, Pacing
from kvstore.store.parts import Expiry, Locked
from kvstore.store.pins import Pins
from kvstore.store.placement import Placement
from tiers import InPlaceTier, Tier, TierError, TierKey
from tiers.throttle import throttle_of

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
        a: int,
        tiers: Sequence[Tier],
        config: StoreConfig,
        lock: Locked,
        counts: Counts,
        index: BlockIndex,
        eviction: Eviction,
        pins: Pins,
        placement: Placement,
        governance: Governance,
        expire: Expiry,
        pacing: Pacing,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        on_new_blocks: Callable[[Sequence[Block], Callable[[Block], memoryview]], None],
    ) -> None:
        """``a``: the arena's place in ``tiers``; ``wall_clock``: birth times."""
        arena = tiers[a].as_arena()
        if arena is None:
            raise ValueError(f"tier {tiers[a].name} is not an arena")
        self.a = a
        self.arena = arena
        self._tiers = tiers
        self._throttles = [throttle_of(tier) for tier in tiers]  # a read in place waits beside its copy
        self._config = config
        self._lock = lock
        self._changed = threading.Condition(lock.rlock)  # a promotion finished
        self._counts = counts
        self._index = index
        self._eviction = eviction
        self._pins = pins
        self._placement = placement
        self._governance = governance
        self._expire = expire
        self._pacing = pacing
        self._wall = wall_clock
        self._on_new_blocks = on_new_blocks  # under the lock: write-through and write-behind
        self._reservations: LeaseTable[_Pending] = LeaseTable(clock)
        self._promoting: set[BlockId] = set()
        expire.also(self._expire_reservations)

    def _expire_reservations(self) -> None:
        for (pending,) in self._reservations.expire():
            self._counts["reservations_expired"] += 1
            self._abort_pending(pending)

    # ----------------------------------------------------------------- reads in place

    def resolve(
        self, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None = None, owner: str = ""
    ) -> Resolved:
        """Pin the present prefix and make sure each block has an arena copy to read in place."""
        check_keys(keys)
        ttl_s = self._pins.ttl(ttl_s)
        a, arena = self.a, self.arena
        held: list[Block] = []  # the prefix so far, each under a transient hold
        sources: list[str] = []  # the tier each block was found in, before any promotion
        delay_s = 0.0
        with self._lock:
            scope = self._index.intern(scope)
            self._expire()
        done = False
        deadline = time.monotonic() + PACE_S  # for room in the arena that waits on the disk
        # The room a promotion waited for is held for it (``kvstore.store.held``), as a paced
        # write's is: no writer or other resolve takes it between the wait and the promotion.
        room: Held | None = None
        try:
            while not done:
                promotions: list[_Promotion] = []
                room_coming = 0  # bytes of arena room a promotion waits for (retired slots)
                with self._lock:
                    while len(held) < len(keys):
                        block = self._index.visible((scope, keys[len(held)]))
                        if block is None:
                            done = True
                            break
                        if a not in block.tiers and block.ident in self._promoting:
                            if promotions:
                                break  # copy ours first; then wait for theirs
                            self._changed.wait(PROMOTION_WAIT_S)
                            continue
                        self._pins.hold(block)  # before promotion: making room for the next must not evict it
                        source = block.fastest
                        if a not in block.tiers:
                            self._pacing.use(room)  # the room waited for, taken under this hold
                            room = None
                            promotion = self._start_promotion(block, a, arena)
                            if promotion is None:
                                self._pins.unhold(block)
                                # Room on its way (victims waiting for the disk): wait outside the
                                # lock, then go on from this block; else the prefix ends here.
                                room_coming = block.size_bytes if time.monotonic() < deadline else 0
                                done = not room_coming
                                break
                            promotions.append(promotion)
                        elif (throttle := self._throttles[source]) is not None:
                            delay_s += throttle.in_place_read_s(block.size_bytes)
                        held.append(block)
                        sources.append(self._tiers[source].name)
                    else:
                        done = True
                if promotions:
                    failed_at = self._finish_promotions(promotions, arena, a)
                    if failed_at is not None:
                        cut = held.index(failed_at)
                        with self._lock:
                            for block in held[cut:]:
                                self._pins.unhold(block)
                        del held[cut:], sources[cut:]
                        done = True
                if room_coming and not done:
                    room = self._pacing.wait_retired(a, room_coming, deadline - time.monotonic())
                    done = room is None
        finally:
            if room is not None:  # left before it took its room (an exception): the room goes back
                with self._lock:
                    self._pacing.use(room)
        with self._lock:
            # The lease first, then the transient holds go: a block deleted while this call
            # copied outside the lock is doomed, and must stay until the lease ends.
            lease = self._pins.grant(held, ttl_s, owner) if held else None
            self._eviction.hit_many(held)  # each is in the heaps already: a promotion pushed it
            for block in held:
                self._pins.unhold(block)
            self._counts.count(scope, "lookup_hit_blocks", len(held))
            self._counts.count(scope, "lookup_miss_blocks", len(keys) - len(held))
            slots = []
            for block in held:
                slot = arena.locate(block.tkey)
                assert slot is not None, "a pinned block lost its arena slot"
                slots.append(slot)
            resolved = Resolved(tuple(slots), tuple(sources), lease)
        _wait(delay_s)  # a throttled arena delays only its reader
        return resolved

    def _start_promotion(self, block: Block, a: int, arena: InPlaceTier) -> _Promotion | None:
        """Under the lock: an arena slot for ``block``, to fill outside it; None without room."""
        if not self._placement.make_room(a, block.size_bytes):
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
        sizes = [self._placement.read(x.block, x.source, arena.slot_view(x.slot)) for x in promotions]
        failed: Block | None = None
        with self._lock:
            for x, n in zip(promotions, sizes, strict=True):
                self._promoting.discard(x.block.ident)
                if n != x.block.size_bytes:
                    arena.abort(x.block.tkey)
                    if n is None:
                        self._placement.failed_read(x.block, x.source)
                    failed = failed or x.block
                    continue
                arena.commit(x.block.tkey)
                self._placement.added(x.block, a)
                self._counts["promotions"] += 1
            self._changed.notify_all()
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
        check_keys(keys)
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        check_sizes(sizes, self._config.max_block_bytes)
        ttl_s = self._pins.ttl(ttl_s)
        a, arena = self.a, self.arena
        with self._lock:
            needed = self._governance.new_sizes(self._index.intern(scope), keys, sizes)
        held = self._pacing.pace(a, needed, PACE_S)  # a disk that is behind slows this writer only
        with self._lock:
            self._pacing.use(held)  # the room it waited for, taken by _take_slots under this same hold
            scope = self._index.intern(scope)
            self._expire()
            pinned_parent = self._index.visible((scope, parent)) if parent is not None else None
            if pinned_parent is not None:
                self._pins.hold(pinned_parent)  # its child is on the way: keep it until commit
            prefix = tier_key_prefix(scope)
            tkeys = tuple([TierKey(prefix + key) for key in keys])
            wanted: list[int] = []  # the blocks to give a slot, their bytes held against the quota
            limited = self._governance.limited(scope.namespace)
            for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                existing = self._governance.vacate((scope, key))
                if existing is not None:
                    if existing.doomed:
                        self._counts["put_doomed_blocks"] += 1  # no slot: the writer skips this block
                    continue
                if limited:
                    try:
                        self._governance.check(scope, size, i, len(keys))
                    except QuotaExceeded:
                        break  # the rest of the chain cannot hang on
                    self._governance.reserve(scope.namespace, size)
                wanted.append(i)
            if not limited and wanted:  # no quota to check block by block: held in one sum
                self._governance.reserve(scope.namespace, sum(sizes[i] for i in wanted))
            try:
                taken = self._take_slots(a, arena, [(tkeys[i], sizes[i]) for i in wanted], scope.fingerprint)
            except BaseException:  # the arena closing under us: nothing of this call may stay held
                self._governance.unreserve(scope.namespace, sum(sizes[i] for i in wanted))
                if pinned_parent is not None:
                    self._pins.unhold(pinned_parent)
                raise
            slots: list[ArenaSlot | None] = [None] * len(keys)
            for i, slot in zip(wanted, taken, strict=True):
                if slot is None:
                    self._governance.unreserve(scope.namespace, sizes[i])
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
            self._placement.make_room(a, size, _room_for(arena, size, run - first), size * (run - first))
            slots += arena.reserve_many(items[first:], fingerprint) or [None]
        return slots

    def commit(self, reservation_id: int, owner: str = "", checksums: Sequence[int] = ()) -> int:
        """Publish a reservation's written slots as blocks; how many were stored. ``checksums``:
        the writer's xxh3-64 of each given slot's block, in order (kept from the commit on, as
        the server's own copies keep theirs), or none (the dram tier's hasher takes them)."""
        a, arena = self.a, self.arena
        with self._lock:
            self._expire()
            (pending,) = self._reservations.release(reservation_id, owner)
            given = sum(slot is not None for slot in pending.slots)
            if checksums and len(checksums) != given:
                self._abort_pending(pending)
                raise InvalidArgument(
                    f"a commit of {given} written slots carries {len(checksums)} checksums; nothing stored"
                )
            self._unreserve(pending)
            sums = iter(checksums)
            scope = pending.scope
            # The parent as it stands now: a pipelined write reserves a chunk before the chunk
            # holding its parent is committed.
            first_depth = self._index.depth_after(scope, pending.parent)
            now = self._wall()  # in the journal's record of each block: salvage keeps its birth
            blocks: list[Block] = []
            written: list[int | None] = []  # the writer's checksum of each block in blocks
            prev = pending.parent
            for i, (key, tkey, slot) in enumerate(
                zip(pending.keys, pending.tkeys, pending.slots, strict=True)
            ):
                if slot is not None:
                    checksum = next(sums, None)
                    if self._index.get((scope, key)) is not None:
                        arena.abort(tkey)  # stored meanwhile by another path
                    else:
                        block = new_block(
                            self._config, scope, key, slot.size_bytes, prev, first_depth + i, tkey, now
                        )
                        block.tiers.add(a)
                        blocks.append(block)
                        written.append(checksum)
                prev = key
            arena.commit_many([(block.tkey, block.meta) for block in blocks], written if checksums else None)
            self._index.admit_many(blocks)
            if self._placement.changes is not None:
                self._placement.changes.stored(blocks, a)
            self._eviction.touch_many(blocks)
            self._on_new_blocks(blocks, lambda block: slot_bytes(arena, block))
            self._counts.count(scope, "put_blocks", len(blocks))
            if pending.pinned_parent is not None:
                self._pins.unhold(pending.pinned_parent)
            return len(blocks)

    def abort(self, reservation_id: int, owner: str = "") -> None:
        """Give back a reservation's slots without storing anything."""
        with self._lock:
            self._expire()
            (pending,) = self._reservations.release(reservation_id, owner)
            self._abort_pending(pending)

    def _abort_pending(self, pending: _Pending) -> None:
        arena = self.arena
        self._unreserve(pending)
        for tkey, slot in zip(pending.tkeys, pending.slots, strict=True):
            if slot is not None:
                arena.abort(tkey)
        if pending.pinned_parent is not None:
            self._pins.unhold(pending.pinned_parent)

    def _unreserve(self, pending: _Pending) -> None:
        self._governance.unreserve(
            pending.scope.namespace, sum(slot.size_bytes for slot in pending.slots if slot is not None)
        )


def _wait(seconds: float) -> None:
    """A throttled arena's delay, waited out beside the reader (never under the lock)."""
    if seconds:
        time.sleep(seconds)


def _room_for(arena: InPlaceTier, size_bytes: int, count: int) -> Callable[[], bool]:
    """Whether the arena has a slot for each of ``count`` blocks of ``size_bytes``."""
    return lambda: arena.room_for(size_bytes, count) >= count


def slot_bytes(arena: InPlaceTier, block: Block) -> memoryview:
    """The arena bytes of a block just committed there (under the lock: it cannot move)."""
    slot = arena.locate(block.tkey)
    if slot is None:
        raise KeyError(f"block {block.key.hex()} has no slot in the arena")
    return arena.slot_view(slot)
