"""The store's lower rooms (index, eviction, pins, placement, pacing, governance), built and
wired in one place, with what they share: the lock and the counters. The facade (``core``) and
salvage build them here; every room then gets the ones it uses, by name, in its constructor.

The lock rule (the store's, tested in tests/test_store_threads.py):
    under the lock   index, heap, pin and lease edits; copies between memory tiers and into a
                     tier's write queue (a bounded memcpy: puts, promotion of a block a reader
                     already holds in memory, demotion out of the arena, spill on close); a full
                     write queue is never waited for here but by spill, write-through, demote
    outside it       reads from a medium into a caller's buffer (``get_into``), promotion of a
                     block from a slower tier into the arena (``resolve``), the wait a throttled
                     tier adds, each under a pin that keeps its block; write-behind and cleaner
                     puts into the disk (of bytes copied out under the lock, nothing pinned:
                     ``behind.CopyDown``); and
                     a write's wait for a disk that is behind (``Pacing.pace``)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

from kvstore.errors import Unavailable
from kvstore.store.counts import Counts
from kvstore.store.eviction import Eviction
from kvstore.store.governance import Governance
from kvstore.store.held import RoomLine
from kvstore.store.index import BlockIndex
from kvstore.store.model import StoreConfig
from kvstore.store.pacing import Pacing
from kvstore.store.pins import Pins
from kvstore.store.placement import Placement
from tiers import Tier, TierError


@dataclass(frozen=True)
class StoreParts:
    """The lower rooms, wired (``wire``); each one's docstring says what it owns."""

    lock: Locked
    counts: Counts
    index: BlockIndex
    eviction: Eviction
    pins: Pins
    placement: Placement
    pacing: Pacing
    governance: Governance
    expire: Expiry


def wire(
    tiers: Sequence[Tier], config: StoreConfig, clock: Callable[[], float], wall_clock: Callable[[], float]
) -> StoreParts:
    """The lower rooms over ``tiers``. ``wall_clock`` gives birth times and retention deadlines."""
    lock = Locked(threading.RLock())
    counts = Counts()
    index = BlockIndex(wall_clock, lambda ns: config.retention_s.get(ns, config.default_retention_s))
    eviction = Eviction(index, len(tiers))
    # a freed block's copies go (placement is built after the pins that call this)
    pins = Pins(config, clock, eviction, on_free=lambda block: placement.drop(block))
    line = RoomLine()  # paced writes waiting for arena room, in order
    placement = Placement(
        tiers, index, eviction, pins, counts, line, lambda: expire()
    )  # expired leases and reservations go before anything is evicted
    pacing = Pacing(tiers, placement, eviction, line, counts, lock.rlock)
    governance = Governance(config, index, wall_clock, counts, placement.drop, pins.doom)
    expire = Expiry(governance, pins, counts)
    return StoreParts(lock, counts, index, eviction, pins, placement, pacing, governance, expire)


class Expiry:
    """``expire()``: collect what has run out: retention, leases, and what rooms added with
    ``also`` (the arena's uncommitted reservations). Under the lock."""

    def __init__(self, governance: Governance, pins: Pins, counts: Counts) -> None:
        self._governance = governance
        self._pins = pins
        self._counts = counts
        self._also: list[Callable[[], None]] = []

    def also(self, collect: Callable[[], None]) -> None:
        self._also.append(collect)

    def __call__(self) -> None:
        self._governance.sweep()
        for collect in self._also:
            collect()
        expired = self._pins.expire()
        if expired:
            self._counts["leases_expired"] += expired


class Locked:
    """``with``: the store lock held, and tier errors translated as ``translated`` does. One
    object serves every call (reentrant, as the lock is): every store call takes the lock, and
    a generator context manager costs ten times as much to enter and leave."""

    __slots__ = ("_lock", "rlock")

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self.rlock = lock  # the lock itself, untranslated (pacing; a Condition)

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()
        if kind is not None and issubclass(kind, TierError):
            raise Unavailable(f"a tier failed: {exc}") from exc


@contextmanager
def translated() -> Iterator[None]:
    """Tier errors that escape a store call become kvstore.errors here, the one place they
    are: a medium that failed or closed is Unavailable."""
    try:
        yield
    except TierError as exc:
        raise Unavailable(f"a tier failed: {exc}") from exc
