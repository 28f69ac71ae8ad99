"""Pins: the one owner of every block's pin count, and of what happens when it reaches zero.

A pinned block is never evicted or freed. Pins come from leases a client holds (``grant`` ...
``release``, or expiry), from a reservation keeping its parent (``hold`` ... ``unhold``), and
from the store's own transient holds while a copy runs outside its lock (the same two calls;
``hold_many`` for the blocks of one restore, released by ``unhold_many``).

On the last unhold of a block:
    doomed (deleted while pinned)   -> ``on_free(block)``: its copies and entry go now
    parked (skipped by eviction)    -> pushed on its heaps again, a candidate once more

``doom(block)`` deletes now when nothing pins the block, else marks it doomed (invisible from
then on). A pin count going negative raises.

Lease lifetimes: a client's ``ttl_s`` is capped by ``max_lease_ttl_s``; None takes the default.
Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from kvstore.errors import InvalidArgument
from kvstore.leases import Lease, LeaseTable
from kvstore.store.eviction import Eviction
from kvstore.store.model import Block, StoreConfig


class Pins:
    """See the module docstring."""

    def __init__(
        self,
        config: StoreConfig,
        clock: Callable[[], float],
        eviction: Eviction,
        on_free: Callable[[Block], None],
    ) -> None:
        self._config = config
        self._eviction = eviction
        self._on_free = on_free
        self.leases: LeaseTable[Block] = LeaseTable(clock)

    def ttl(self, ttl_s: float | None) -> float:
        """A client's lease lifetime: the default when unset, capped by ``max_lease_ttl_s``."""
        if ttl_s is None:
            return min(self._config.lease_ttl_s, self._config.max_lease_ttl_s)
        if not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidArgument(f"a lease lifetime must be a positive number of seconds, got {ttl_s}")
        return min(ttl_s, self._config.max_lease_ttl_s)

    def hold(self, block: Block) -> None:
        block.pins += 1

    def hold_many(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            block.pins += 1

    def unhold(self, block: Block) -> None:
        if block.pins <= 0:
            raise AssertionError(f"pin count of block {block.key.hex()} would go negative")
        block.pins -= 1
        if block.pins == 0:
            if block.doomed:
                self._on_free(block)
            elif block.parked:
                block.parked = False
                self._eviction.push(block)

    def unhold_many(self, blocks: Iterable[Block]) -> None:
        """``unhold`` of each (the blocks of one restore)."""
        for block in blocks:
            self.unhold(block)

    def doom(self, block: Block) -> None:
        if block.pins:
            block.doomed = True
        else:
            self._on_free(block)

    def grant(self, blocks: Sequence[Block], ttl_s: float | None, owner: str = "") -> Lease:
        lease = self.leases.grant(blocks, self.ttl(ttl_s), owner)
        for block in blocks:
            self.hold(block)
        return lease

    def release(self, lease_id: int, owner: str = "") -> None:
        for block in self.leases.release(lease_id, owner):
            self.unhold(block)

    def expire(self) -> int:
        """Collect expired leases; how many there were."""
        expired = 0
        for blocks in self.leases.expire():
            expired += 1
            for block in blocks:
                self.unhold(block)
        return expired
