"""Per-namespace limits: byte quotas and retention.

Quotas: a tenant's blocks may hold at most its quota of bytes (each block counted once, in
whichever tiers it sits), and bytes in its uncommitted arena reservations count too. A put over
quota first drops that tenant's own coldest leaf blocks (no children, no pins); if none can go
it raises QuotaExceeded. One tenant can push others' blocks down a tier, never out of the store.

Retention: a namespace's blocks live at most its retention (``store.retention_s``, or the
default), counted from their birth time, which is kept in their metadata and so spans restarts.
Past it a block is invisible at once (``BlockIndex.visible``) and removed from every tier by the
next ``sweep`` (at most every RETENTION_SWEEP_S; every operation that collects leases calls it).

Calls (store lock held): check(scope, size, stored, chain); reserve / unreserve bytes; sweep();
vacate(ident) and new_sizes(scope, keys, sizes) for a write: what stands in its way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.errors import QuotaExceeded
from kvstore.keys import BlockKey
from kvstore.store.index import BlockIndex
from kvstore.store.model import MARK_FINGERPRINT, Block, BlockId, Scope, StoreConfig

RETENTION_SWEEP_S = 1.0


class Governance:
    """See the module docstring."""

    def __init__(
        self,
        config: StoreConfig,
        index: BlockIndex,
        wall_clock: Callable[[], float],
        counters: Counter[str],
        drop: Callable[[Block], None],
        doom: Callable[[Block], None],
    ) -> None:
        self._config = config
        self._index = index
        self._wall = wall_clock
        self._counters = counters
        self._drop = drop
        self._doom = doom
        self.reserved: Counter[str] = Counter()  # bytes in uncommitted reservations, per namespace
        self._next_sweep_s = 0.0

    def retention_of(self, namespace: str) -> float | None:
        return self._config.retention_s.get(namespace, self._config.default_retention_s)

    def sweep(self) -> None:
        if not self._index.by_age:
            return  # no namespace has a retention: nothing to sweep, no clock to read
        now = self._wall()
        if now < self._next_sweep_s:
            return
        self._next_sweep_s = now + RETENTION_SWEEP_S
        for queue in self._index.by_age.values():
            while queue:
                block = self._index.get(queue[0])
                if block is not None and not block.doomed and block.expires_at_s > now:
                    break  # stored later than everything behind it: nothing more is due
                queue.popleft()
                if block is not None and not block.doomed and block.expires_at_s <= now:
                    self.retire(block)

    def retire(self, block: Block) -> None:
        """A block past its retention goes: freed now, or doomed while a reader holds it."""
        self._doom(block)
        self._counters["retention_expired_blocks"] += 1

    def vacate(self, ident: BlockId) -> Block | None:
        """Before a new block goes under ``ident``: the entry that still stands in its way, or
        None. A block past its retention that the sweep has not reached yet goes now (as the
        sweep would), so the new one is stored instead of taken for a duplicate; a block
        deleted while a reader holds it (doomed) stands until that reader lets go, since its
        storage goes only then."""
        block = self._index.get(ident)
        if block is None or block.doomed or self._index.visible(ident) is not None:
            return block
        self.retire(block)  # past its retention, as the sweep would find it
        return self._index.get(ident)

    def new_sizes(self, scope: Scope, keys: Sequence[BlockKey], sizes: Sequence[int]) -> list[int]:
        """The sizes of the blocks a write of ``keys`` would store, those with no entry standing
        in the way (``vacate``): what that write needs room for, and all its pacing should wait
        for. A second store of stored blocks needs none."""
        new: list[int] = []
        for key, size in zip(keys, sizes, strict=True):
            block = self._index.get((scope, key))
            if block is None or not (block.doomed or self._index.visible((scope, key)) is not None):
                new.append(size)
        return new

    def limited(self, namespace: str) -> bool:
        """Whether the namespace has a byte quota (``check`` is then needed block by block)."""
        return self._config.quota_bytes.get(namespace, self._config.default_quota_bytes) is not None

    def check(self, scope: Scope, size_bytes: int, stored: int, chain: int) -> None:
        """Make room within the namespace's quota for one more block, or raise QuotaExceeded."""
        ns = scope.namespace
        quota = self._config.quota_bytes.get(ns, self._config.default_quota_bytes)
        if quota is None:
            return
        if size_bytes > quota:
            raise QuotaExceeded(f"a {size_bytes} B block exceeds namespace {ns!r}'s quota of {quota} B")
        held_bytes = self._index.namespace_bytes
        while held_bytes[ns] + self.reserved[ns] + size_bytes > quota:
            candidates = [b for b in self._index.pool(ns) if self._leaf_anywhere(b)]
            if not candidates:
                self._counters["quota_rejections"] += 1
                raise QuotaExceeded(
                    f"namespace {ns!r} holds {held_bytes[ns]} B of its {quota} B quota in pinned blocks "
                    f"or this chain's own prefix (stored {stored} of {chain} blocks); release leases "
                    "or raise the quota"
                )
            victim = min(candidates, key=lambda b: b.priority)
            self._counters["quota_evictions"] += 1
            self._drop(victim)

    def _leaf_anywhere(self, block: Block) -> bool:
        if block.scope.fingerprint == MARK_FINGERPRINT:
            return False  # the fleet's invalidation marks are no tenant's to lose for room
        return not block.pins and not block.doomed and not self._index.children(block.ident)

    def reserve(self, namespace: str, size_bytes: int) -> None:
        self.reserved[namespace] += size_bytes

    def unreserve(self, namespace: str, size_bytes: int) -> None:
        self.reserved[namespace] -= size_bytes
        if self.reserved[namespace] < 0:
            raise AssertionError(f"reserved bytes of {namespace} would go negative")
        if not self.reserved[namespace]:
            del self.reserved[namespace]
