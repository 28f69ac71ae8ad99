"""Pacing: a write that needs room in a full tier waits, outside the store lock, for a disk
that is behind, so that the writer, not every caller, waits for it.

Calls (store lock NOT held, but ``use``):
    pace(t, sizes, timeout)   before a write of blocks of ``sizes`` into tier t: wait for the
                              write queue of the tier below t that room in t will demote into,
                              when it is full, and for the disk to write what the victims'
                              retired slots wait for; the room it waited for in an arena comes
                              back ``Held``
    use(held)                 (lock held) first thing in the write that paced: the held room
                              goes back to the arena for that write to take, under that hold
    wait_retired(t, size, timeout)  for room already made (a promotion's victims retired):
                              wait in the same line for the disk to write them; ``Held`` room
    wait_below(t, size, timeout)    until the tiers below t can take ``size`` moved down out of
                              it without a full write queue (an operator's demote)

Retired slots (``Placement``): an arena block evicted while its copy below is still in the
disk's write queue keeps its slot until the disk has written that copy, so a kill -9 never loses
it with the queue; the write that wanted the room waits here for the disk, up to PACE_S, and past
it lets them go unwritten (counted).

Held room (``kvstore.store.held``): what a paced write waited for is its own. Paced writes
wait in line per arena, first come first served; slots that ``Placement.settle`` frees go to the
line first, held so that a writer beside it cannot take them between the wait and the write.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager

from kvstore.asleep import asleep
from kvstore.store.eviction import Eviction
from kvstore.store.held import Held, RoomLine
from kvstore.store.placement import Placement
from tiers import Tier, WriteQueue

PACE_S = 2.0  # the longest a write waits for the disk to take its victims (past it they are dropped)
PACE_LOOK_BLOCKS = 1024  # the most victims a paced write looks at (past them, all count as dirty)
DEMOTE_WAIT_S = 30.0  # an operator's demote waits this long for the disk outside the lock, a block at a time


class Pacing:
    """See the module docstring. Thread-safe: it takes the store lock itself, briefly."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        placement: Placement,
        eviction: Eviction,
        line: RoomLine,
        counters: Counter[str],
        lock: AbstractContextManager[object],
    ) -> None:
        """``line``: the paced writes waiting for arena room, shared with ``placement`` (whose
        ``settle`` hands what it frees to the line first); ``lock``: the store lock."""
        self._tiers = tiers
        self._queues = [tier.write_queue() for tier in tiers]
        self._placement = placement
        self._eviction = eviction
        self._line = line
        self._counters = counters
        self._lock = lock

    def pace(self, t: int, sizes: Sequence[int], timeout_s: float) -> Held | None:
        """Outside the lock, before a write that will need room in tier ``t`` for new blocks of
        ``sizes``: when making that room will demote into a tier whose write queue is full, wait
        (at most ``timeout_s``) for the queue to drain, so that the writer, not every caller,
        waits for the disk and its victims are demoted rather than dropped. Only the victims
        that would be demoted count: one with a copy below already (the cleaner's work) is
        evicted by forgetting its copy here, and a write whose victims are all clean does not
        wait for a busy disk at all. Advisory: it reads the tiers without the store lock (the
        victims under it, briefly, and only when the queue is full now), and the placements
        under it never wait whatever it found. In an arena whose victims' slots retire, the
        room it made or waited for comes back held (see the module docstring): the caller's
        next step is ``use`` under the lock; None when it holds nothing."""
        tier = self._tiers[t]
        size_bytes = sum(sizes)
        short = size_bytes - _free_bytes(tier)
        if short <= 0:
            return None  # room: the usual case
        with asleep():  # on the disk: the caller's request place serves another meanwhile
            return self._pace_short(t, sizes, short, timeout_s)

    def _pace_short(self, t: int, sizes: Sequence[int], short: int, timeout_s: float) -> Held | None:
        tier = self._tiers[t]
        size_bytes = sum(sizes)
        deadline = time.monotonic() + timeout_s
        if not self.wait_below(t, short, 0.0):
            with self._lock:
                victims = self._eviction.coldest(t, PACE_LOOK_BLOCKS, short)
            looked = sum(b.size_bytes for b in victims)
            dirty = sum(b.size_bytes for b in victims if len(b.tiers) == 1) + max(0, short - looked)
            if dirty > 0 and not self.wait_below(t, dirty, timeout_s):
                with self._lock:
                    self._timed_out(t, size_bytes)
                return None
        queue = self._placement.queue_below(t)
        arena = tier.as_arena()
        if queue is None or arena is None:
            return None
        # The victims' slots come free only once the disk has written their copies (retired,
        # ``Placement._let_go``): evict now, briefly under the lock, and wait for the disk here,
        # in line, so that the write finds its room instead of stopping short.
        return self._held_when_written(t, queue, Held(t, list(sizes)), deadline, size_bytes)

    def _held_when_written(
        self, t: int, queue: WriteQueue, held: Held, deadline: float, room_bytes: int = 0
    ) -> Held | None:
        """Outside the lock: ``held`` into the line, ``room_bytes`` of room made (victims
        retired), then wait for the disk to write what the room in line up to ``held`` waits
        for; ``held`` then holds its share (see the module docstring). Past ``deadline``, with
        ``room_bytes`` (a write), what retires goes unwritten; without, the wait just ends."""
        arena = self._tiers[t].as_arena()
        assert arena is not None
        try:
            with self._lock:
                self._line.join(held)
                if room_bytes:
                    tier = self._tiers[t]
                    self._placement.make_room(
                        t, room_bytes, lambda: _free_bytes(tier) >= room_bytes, room_bytes
                    )
                self._line.hold(t, arena)
            while held.sizes:
                with self._lock:
                    # The room of the writes ahead in line comes first, then this one's.
                    mark = arena.retiring_mark(self._line.wanted_through(held))
                if not mark:
                    break  # nothing retires: no room on its way; the write makes its own
                written = queue.wait_written(mark, max(0.0, deadline - time.monotonic()))
                with self._lock:
                    self._placement.settle(t)
                    if held.sizes and not written:  # out of time
                        if room_bytes:  # a write's victims: what retires goes unwritten
                            self._timed_out(t, self._line.wanted_through(held))
                        break
        except BaseException:
            with self._lock:
                self._line.let_go(held, arena)  # nothing of it stays held, and the line goes on
                self._line.hold(t, arena)
            raise
        with self._lock:
            if self._line.leave(held):  # it goes on with what it holds (perhaps nothing)
                self._line.hold(t, arena)  # and the writes behind it may have room now
        return held if held.keys else None

    def _timed_out(self, t: int, size_bytes: int) -> None:
        """Under the lock. A disk behind past the pace stalls nobody: victims are dropped rather
        than demoted, and ``size_bytes`` of retired slots go unwritten, as they went before slots
        retired (a kill -9 now would lose those blocks with the write queue)."""
        self._counters["pace_timeouts"] += 1
        arena = self._tiers[t].as_arena()
        if arena is not None and self._placement.queue_below(t) is not None:
            freed = arena.settle(arena.retiring_mark(size_bytes))
            self._counters["retired_slots_freed_unwritten"] += freed
            if freed:
                self._line.hold(t, arena)

    def wait_retired(self, t: int, size_bytes: int, timeout_s: float) -> Held | None:
        """Outside the lock, for room already made (victims retired, as a promotion's
        ``make_room`` leaves them): wait (at most ``timeout_s``) in the paced writes' line until
        the disk has written the copies that ``size_bytes`` of arena tier ``t``'s room waits for;
        that room comes back held (``use`` it under the lock next). None when it holds nothing:
        nothing retires (no room on its way), or the time ran out first."""
        queue = self._placement.queue_below(t)
        if queue is None or self._tiers[t].as_arena() is None:
            return None
        return self._held_when_written(t, queue, Held(t, [size_bytes]), time.monotonic() + timeout_s)

    def wait_below(self, t: int, size_bytes: int, timeout_s: float) -> bool:
        """Outside the lock: wait (at most ``timeout_s``) until the tiers below ``t`` can take
        ``size_bytes`` moved down out of it without a full write queue (a memory tier takes what
        it has room for first); False when the time ran out first."""
        short = size_bytes
        for below, queue in zip(self._tiers[t + 1 :], self._queues[t + 1 :], strict=True):
            if short <= 0:
                return True
            if below.persistent:  # a disk that queues nothing takes its puts as they come
                return queue is None or queue.wait_for_queue_room(short, timeout_s)
            short -= _free_bytes(below)
        return True

    def use(self, held: Held | None) -> None:
        """Under the lock, first thing in the write that paced: its held room goes back to the
        arena, for that write to take under this same hold of the lock (nobody else can)."""
        if held is not None:
            arena = self._tiers[held.t].as_arena()
            assert arena is not None
            self._line.let_go(held, arena)


def _free_bytes(tier: Tier) -> int:
    usage = tier.usage()
    return usage.capacity_bytes - usage.stored_bytes
