"""The dram tier's hasher: the checksum of each block committed without one, taken on a thread
of its own just after the commit.

A same-host client that copies with the CPU hashes as it copies, and its commit carries the
checksums (``kvstore.client.inplace.scatter_hashed``); the tier's own copies in (``put``: a
promotion, a read-through, a salvage) hash on the way too. An engine whose GPU copies its blocks
into the arena by DMA has no CPU pass to hash in, and commits without them; so does a client
calling ``Client.commit`` with none. Hashing those in the commit would put an xxh3 pass over
every byte on the writer's path; the hasher takes them after the commit instead, with the GIL
released (xxhash lets it go), on a core a DMA copy leaves idle, within milliseconds. (At a
lower CPU priority it cost the CPU writers' rows the same, and a thread parked by the kernel
while it holds the GIL would hold up the server's other threads: it runs at theirs.) The tier
keeps the checksum in the block's entry and journals it (``Journal.summed_many``), so a block
changed since is caught when it leaves the process (``SlabTier.verified_checksum``) and at
salvage.

Until the hasher has reached a block, the block has no checksum: a copy leaving the process
takes one then, and a salvage after a kill copies it unchecked. The queue holds at most
MAX_QUEUED_BYTES; blocks committed beyond it wait for the first copy that leaves. Where the
writer's copy is the CPU's, as in ``kvstore bench service``'s same-host rows, hashing after the
commit competed with it for the two cores here: store 0.66x and 0.52x of memcpy against 0.82x
and 0.84x without (``bench-results/commit-checksums-ab.txt``), which is why such a writer hashes
as it copies instead.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

import xxhash

from tiers.base import Slot, TierKey
from tiers.slab import SlabEntry

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 1 << 30  # blocks waiting for the hasher; beyond, they wait for their first serve
BATCH = 64  # blocks hashed between two takings of the tier's lock (one journal append each time)

Hashed = list[tuple[TierKey, SlabEntry, int]]


class Hasher:
    """See the module docstring. ``view_of``: a slot's bytes; ``take``: the checksums hashed
    (key, the entry hashed, digest), which the tier keeps for the entries still current."""

    def __init__(self, view_of: Callable[[Slot], memoryview], take: Callable[[Hashed], None]) -> None:
        self._view_of = view_of
        self._take = take
        self._queue: deque[tuple[TierKey, SlabEntry]] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, published: Sequence[tuple[TierKey, SlabEntry]]) -> None:
        """Queue the blocks just committed without a checksum (called under the tier's lock)."""
        with self._cond:
            if self._closed:
                return
            for key, entry in published:
                if entry.checksum is None and self._queued_bytes < MAX_QUEUED_BYTES:
                    self._queue.append((key, entry))
                    self._queued_bytes += entry.slot.size_bytes
            if not self._queue:
                return
            if self._thread is None:  # started by the first in-place write: most tiers never see one
                self._thread = threading.Thread(target=self._run, name="kvstore-dram-hasher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Stop, after the block being hashed (the region must outlive every view the hasher reads)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _next_batch(self) -> list[tuple[TierKey, SlabEntry]] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            self._queued_bytes -= sum(entry.slot.size_bytes for _, entry in batch)
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            hashed: Hashed = []
            for key, entry in batch:
                if self._closed:
                    return
                # Outside the tier's lock: a slot freed and reused meanwhile hashes other bytes,
                # and ``take`` keeps only the digests of entries still current.
                hashed.append((key, entry, xxhash.xxh3_64_intdigest(self._view_of(entry.slot))))
            try:
                self._take(hashed)
            except Exception:  # the journal's file: the checksums stay in memory, kept by take
                log.exception("dram tier: could not record %d checksums", len(hashed))
