"""The store's rooms, built and wired in one place, and what they share: the lock, the tiers,
the counters.

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
                     a write's wait for a disk that is behind (``Placement.pace``)
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from kvstore.errors import FailedPrecondition, Unavailable
from kvstore.keys import BlockKey
from kvstore.store.eviction import Eviction
from kvstore.store.governance import Governance
from kvstore.store.index import BlockIndex
from kvstore.store.model import Block, BlockId, Scope, StoreConfig
from kvstore.store.pins import Pins
from kvstore.store.placement import Placement
from tiers import InPlaceTier, Tier, TierError


class StoreParts:
    """Everything the store's calls work on. Each part's docstring says what it owns."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        persistent: Sequence[bool] | None,
    ) -> None:
        self.tiers = list(tiers)
        self.config = config
        self.lock = threading.RLock()
        self._locked = Locked(self.lock)
        self.changed = threading.Condition(self.lock)  # an arena promotion finished
        self.counters: Counter[str] = Counter()
        self.namespace_counters: dict[str, Counter[str]] = {}
        self.persistent = list(persistent) if persistent is not None else [t.persistent for t in tiers]
        self.wall = wall_clock  # birth times and retention deadlines
        self.index = BlockIndex(wall_clock, self._retention_of)
        self.eviction = Eviction(self.index, len(tiers))
        self.pins = Pins(config, clock, self.eviction, on_free=self._free)
        self.placement = Placement(
            self.tiers, self.index, self.eviction, self.pins, self.counters, self.expire, self.lock
        )
        self.governance = Governance(
            config, self.index, wall_clock, self.counters, self.placement.drop, self.pins.doom
        )
        self.arena_index = next((i for i, t in enumerate(tiers) if t.as_arena() is not None), None)
        self.expire_reservations: Callable[[], None] = lambda: None  # set by the arena calls
        self.served_counter = [f"get_{t.name}_blocks" for t in tiers]

    def _free(self, block: Block) -> None:
        self.placement.drop(block)  # the placement is built after the pins that call this

    def _retention_of(self, namespace: str) -> float | None:
        return self.config.retention_s.get(namespace, self.config.default_retention_s)

    def locked(self) -> Locked:
        """The store lock, with tier errors translated (see ``translated``)."""
        return self._locked

    def expire(self) -> None:
        """Collect what has run out: retention, uncommitted reservations, leases."""
        self.governance.sweep()
        self.expire_reservations()
        expired = self.pins.expire()
        if expired:
            self.counters["leases_expired"] += expired

    def vacate(self, ident: BlockId) -> Block | None:
        """Under the lock, before a new block goes under ``ident``: the entry that still stands
        in its way, or None. A block past its retention that the sweep has not reached yet goes
        now (as the sweep would), so the new one is stored instead of taken for a duplicate; a
        block deleted while a reader holds it (doomed) stands until that reader lets go, since
        its storage goes only then."""
        block = self.index.get(ident)
        if block is None or block.doomed or self.index.visible(ident) is not None:
            return block
        self.governance.retire(block)  # past its retention, as the sweep would find it
        return self.index.get(ident)

    def new_sizes(self, scope: Scope, keys: Sequence[BlockKey], sizes: Sequence[int]) -> list[int]:
        """Under the lock: the sizes of the blocks a write of ``keys`` would store, those with no
        entry standing in the way (``vacate``): what that write needs room for, and all its pacing
        should wait for. A second store of stored blocks needs none."""
        new: list[int] = []
        for key, size in zip(keys, sizes, strict=True):
            block = self.index.get((scope, key))
            if block is None or not (block.doomed or self.index.visible((scope, key)) is not None):
                new.append(size)
        return new

    def count(self, scope: Scope, name: str, n: int = 1) -> None:
        self.counters[name] += n
        counters = self.namespace_counters.get(scope.namespace)
        if counters is None:  # (not setdefault: that made a Counter on every call)
            counters = self.namespace_counters[scope.namespace] = Counter()
        counters[name] += n

    def arena(self) -> tuple[int, InPlaceTier]:
        if self.arena_index is None:
            raise FailedPrecondition("this store has no dram arena for same-host clients")
        arena = self.tiers[self.arena_index].as_arena()
        assert arena is not None
        return self.arena_index, arena

    @staticmethod
    def wait(seconds: float) -> None:
        """A throttled tier's delay, waited out beside the reader (never under the lock)."""
        if seconds:
            time.sleep(seconds)


class Locked:
    """``with``: the store lock held, and tier errors translated as ``translated`` does. One
    object serves every call (reentrant, as the lock is): every store call takes the lock, and
    a generator context manager costs ten times as much to enter and leave."""

    __slots__ = ("_lock",)

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock

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
