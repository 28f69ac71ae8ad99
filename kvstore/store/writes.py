"""Writes: a chain of blocks stored (``put``), and what follows each new block, from a put or
an arena commit (``stored_new_many``): write-through into the persistent tiers, the
write-behind queue, a poke to the arena's cleaner, and the remote tier's queue.

A put runs in slices of about PACE_SLICE_BYTES, each paced (``Pacing.pace``) before it takes
the lock: a disk that is behind slows this writer, slice by slice, and every other caller goes
on between them. A child never lands in a faster tier than its parent.

A put's count is its acknowledgement, so it counts only what a kill -9 cannot lose. A block put
into the arena can be salvaged from its journaled slot; one placed straight into a persistent
tier's write queue (the arena had no room: full of pinned blocks, or its room still on its way
from the disk) has no slot, so the slice it came in waits, outside the lock, up to PACE_S, for
that tier to commit it. One still uncommitted then stays queued, written when the disk catches
up, but the put does not count it (``put_unacknowledged_blocks``). A chain read through from
the remote tier (``to_remote`` False) is nobody's acknowledgement and waits for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from kvstore.asleep import asleep
from kvstore.errors import InvalidArgument, StoreFull
from kvstore.keys import BlockKey
from kvstore.store.behind import PersistBehind
from kvstore.store.cleaner import Cleaner
from kvstore.store.counts import Counts
from kvstore.store.eviction import Eviction
from kvstore.store.governance import Governance
from kvstore.store.index import BlockIndex
from kvstore.store.model import Block, Scope, StoreConfig, check_keys, check_sizes, new_block
from kvstore.store.pacing import PACE_S, Pacing
from kvstore.store.parts import Expiry, Locked
from kvstore.store.pins import Pins
from kvstore.store.placement import Placement
from kvstore.store.remote import RemoteCalls
from tiers import BytesLike, WriteQueue

PACE_SLICE_BYTES = 16 << 20  # a put is paced and stored in slices of about this many bytes


class Writes:
    """See the module docstring. Thread-safe: every call takes the store lock itself, but
    ``stored_new_many`` (called under it)."""

    def __init__(
        self,
        config: StoreConfig,
        slowest: int,
        persistent: Sequence[bool],
        lock: Locked,
        counts: Counts,
        index: BlockIndex,
        eviction: Eviction,
        pins: Pins,
        placement: Placement,
        governance: Governance,
        expire: Expiry,
        pacing: Pacing,
        wall_clock: Callable[[], float],
        write_behind: PersistBehind | None,
        cleaner: Cleaner | None,
        remote: RemoteCalls | None,
    ) -> None:
        """``slowest``: the last tier's place; ``persistent``: which tiers are (write-through's
        targets)."""
        self._config = config
        self._slowest = slowest
        self._persistent = persistent
        self._lock = lock
        self._counts = counts
        self._index = index
        self._eviction = eviction
        self._pins = pins
        self._placement = placement
        self._governance = governance
        self._expire = expire
        self._pacing = pacing
        self._wall = wall_clock  # each block's birth, in the metadata its tiers keep
        self._write_behind = write_behind
        self._cleaner = cleaner
        self._remote = remote

    def put(
        self,
        scope: Scope,
        keys: Sequence[BlockKey],
        blocks: Sequence[BytesLike],
        parent: BlockKey | None,
        first_depth: int | None,
        to_remote: bool = True,
        born: Sequence[float] = (),
    ) -> int:
        """Store a chain of blocks; ``keys[i-1]`` (or ``parent`` for i=0) is each one's parent.
        ``born``: each block's birth time where a copy elsewhere had one (else: now);
        ``to_remote``: False for a chain read through from the remote tier (not sent back).

        Blocks already present are skipped. Returns how many were stored (a kill -9 cannot
        lose them: see the module docstring). ``first_depth`` is the
        index of keys[0] in its full chain when the parent is not stored here (defaults to the
        parent's depth + 1, or 0 without a parent).
        """
        check_keys(keys)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks")
        sizes = [len(memoryview(b)) for b in blocks]
        check_sizes(sizes, self._config.max_block_bytes)
        stored = unacknowledged = 0
        with self._lock:
            scope = self._index.intern(scope)
            first_depth = first_depth if first_depth is not None else self._index.depth_after(scope, parent)
        # In slices, each paced before it takes the lock: a disk that is behind slows this
        # writer, slice by slice, and every other caller goes on between them (for the room of
        # its new blocks only: a block stored already needs none).
        for first, end in slices(sizes, PACE_SLICE_BYTES):
            with self._lock:
                needed = self._governance.new_sizes(scope, keys[first:end], sizes[first:end])
            held = self._pacing.pace(0, needed, PACE_S)
            queued: list[tuple[Block, int, WriteQueue, int]] = []  # no arena slot: not salvageable
            with self._lock:
                self._pacing.use(held)  # the room it waited for, taken below under this same hold
                self._expire()
                now = self._wall()  # each block's birth, in the metadata its tiers keep
                for i in range(first, end):
                    key = keys[i]
                    existing = self._governance.vacate((scope, key))
                    if existing is not None:
                        # A doomed block (deleted while a reader holds it) keeps its storage
                        # until released; a new copy under the same key is not stored before then.
                        self._counts["put_doomed_blocks" if existing.doomed else "put_dedup_blocks"] += 1
                        continue
                    prev = keys[i - 1] if i else parent
                    birth = (born[i] if i < len(born) else 0.0) or now
                    block = new_block(
                        self._config, scope, key, sizes[i], prev, first_depth + i, stored_at_s=birth
                    )
                    self._put_one(block, blocks[i], stored, len(keys), to_remote)
                    stored += 1
                    self._counts.count(scope, "put_blocks")
                    if to_remote and (in_queue := self._placement.queued_only(block)) is not None:
                        queued.append((block, *in_queue))
            if queued:
                unacknowledged += self._unwritten(queued)
        return stored - unacknowledged

    def _unwritten(self, queued: Sequence[tuple[Block, int, WriteQueue, int]]) -> int:
        """Outside the lock: wait, up to PACE_S, until the tiers have committed the ``queued``
        blocks (block, tier, its write queue, the block's mark there), placed straight into
        their queues; how many are not on their media then (still queued, or refused), counted
        ``put_unacknowledged_blocks``."""
        last: dict[int, tuple[WriteQueue, int]] = {}  # each queue's latest mark: its writes go in order
        for _, _, queue, mark in queued:
            last[id(queue)] = (queue, max(mark, last.get(id(queue), (queue, 0))[1]))
        deadline = time.monotonic() + PACE_S
        with asleep():  # on the disk: the caller's request place serves another meanwhile
            for queue, mark in last.values():
                queue.wait_written(mark, max(0.0, deadline - time.monotonic()))
        tiers = self._placement.tiers
        unwritten = sum(
            1
            for block, t, queue, _ in queued
            if queue.unwritten_mark(block.tkey) or tiers[t].size_of(block.tkey) is None
        )
        if unwritten:
            with self._lock:
                self._counts["put_unacknowledged_blocks"] += unwritten
        return unwritten

    def _put_one(self, block: Block, data: BytesLike, stored: int, chain: int, to_remote: bool) -> None:
        # Hold the parent while the child finds room: evicting it now would make the child
        # unreachable dead weight.
        parent = self._index.visible((block.scope, block.parent)) if block.parent is not None else None
        if parent is not None:
            self._pins.hold(parent)
        # A child never lands in a faster tier than its parent: a chain stays fast at its head
        # and slow at its tail, the order a restore reads it in.
        lowest = parent.fastest if parent is not None else 0
        try:
            self._governance.check(block.scope, block.size_bytes, stored, chain)
            self._placement.place(block, data, lowest=lowest, highest=self._slowest)
        finally:
            if parent is not None:
                self._pins.unhold(parent)
        if not block.tiers:
            raise StoreFull(
                f"no tier can take a {block.size_bytes} B block: all are full of pinned blocks "
                f"(stored {stored} of {chain} blocks of this chain)"
            )
        self._index.admit(block)
        self._eviction.touch(block)
        self._stored_new(block, data, to_remote)

    def _stored_new(self, block: Block, data: BytesLike, to_remote: bool = True) -> None:
        """A new block is in the index (under the lock): write-through or write-behind, and
        write-behind to the remote tier unless it came from there."""
        self.stored_new_many((block,), lambda _: data, to_remote)

    def stored_new_many(
        self, blocks: Sequence[Block], data_of: Callable[[Block], BytesLike], to_remote: bool = True
    ) -> None:
        """``_stored_new`` of the blocks of one commit; ``data_of`` is read for write-through
        only (the usual commit asks nothing of each block's bytes)."""
        if self._config.write_through:
            for block in blocks:
                data = data_of(block)
                for t, persistent in enumerate(self._persistent):
                    if persistent and t not in block.tiers:
                        self._placement.place(block, data, lowest=t, highest=t, wait=True)
        if self._write_behind is not None:
            for block in blocks:
                self._write_behind.offer(block)
        if self._cleaner is not None:
            self._cleaner.poke()
        if self._remote is not None and to_remote:
            for block in blocks:
                self._remote.offer(block)


def slices(sizes: Sequence[int], max_bytes: int, max_blocks: int | None = None) -> Iterator[tuple[int, int]]:
    """(first, end) of consecutive runs of blocks of ``sizes``, each at least one block and
    ending once it holds ``max_bytes`` (or ``max_blocks``): the steps a write is paced in."""
    first = 0
    while first < len(sizes):
        end, nbytes = first + 1, sizes[first]
        while end < len(sizes) and nbytes < max_bytes and (max_blocks is None or end - first < max_blocks):
            nbytes += sizes[end]
            end += 1
        yield first, end
        first = end
