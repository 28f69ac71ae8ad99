"""Clean ahead of eviction: the blocks next in line to leave a full arena get a copy on the
persistent tier (nvme) first, on a thread, while the disk has time.

Why: a write into a full arena makes its room by evicting the arena's coldest blocks. A victim
whose only copy is the arena's is demoted: its bytes are copied into nvme's write queue under
the store lock, and when the disk is behind the writer waits for it (``Pacing.pace``) or the
victim is dropped (a promotion's room). A victim with a copy on nvme already (clean) is evicted
by forgetting its arena copy: nothing is copied, nothing waits. Writes into a KV cache come in
bursts (a prefill's blocks at a time) with the disk idle in between; the cleaner spends that
idle time making the next victims clean, so a burst into a full arena runs at the arena's speed
and not the disk's, as long as the disk keeps up on average. (The kernel's page cache cleans
dirty pages ahead of reclaim for the same reason.)

What: while the arena has less than ``clean_ahead`` (a fraction of its capacity) free, the
cleaner looks at the arena's coldest blocks in eviction order, as many as hold that fraction
(at most LOOK_BLOCKS a round), and copies each one that has no persistent copy, keeping its
arena copy. A block cleaned and then hit stays clean: its eviction later still costs nothing.

Rules:
    - it never waits under the store lock: before each copy it waits outside it until nvme's
      write queue is at most half full (the other half stays for the writers' demotions and
      write-behind);
    - it holds no block: under the lock it copies the block's bytes out of its arena slot into
      a buffer of its own (one memcpy), and puts that copy into nvme outside the lock. A held
      block would stand in eviction's way, and with it every block above it in its chain (a
      chain leaves its arena tail first): a restore that needs the whole arena would find no
      room while a copy ran. When the put is done it looks again under the lock: a block still
      current gets its nvme copy counted (unless a demotion put the same bytes there
      meanwhile); a copy whose block was deleted or dropped meanwhile is deleted, unless a
      block stored since under the same key holds it;
    - under the lock it only looks (``Eviction.coldest``: LOOK_BLOCKS heap pops and pushes) and
      copies one block at a time;
    - it sleeps while the arena has room; a write that leaves the arena short wakes it (``poke``,
      a flag set), and a round that found nothing to clean waits for the next poke;
    - it cleans between bursts, not during them: a round (its look under the lock) and each
      copy in it first wait until the store has had no write for QUIET_S. Cleaning during a burst takes the CPU and
      memory bandwidth the burst copies with (a 2-core machine's full-arena writes ran at
      half their empty-arena speed that way). Writes that never pause for MAX_DEFER_S get
      their cleaning alongside them, as before, until a pause comes;
    - ``close`` stops it before the store closes; a copy in flight finishes first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.store.behind import CopyDown
from kvstore.store.eviction import Eviction
from kvstore.store.index import BlockIndex
from kvstore.store.parts import Locked
from tiers import Tier, WriteQueue

log = logging.getLogger("kvstore.store")

LOOK_BLOCKS = 1024  # the most blocks one round looks at under the lock (~1-2 ms of heap work)
QUEUE_WAIT_S = 1.0  # a round gives up on a disk whose queue stays over half full this long
IDLE_WAIT_S = 5.0  # the longest it sleeps without a poke before looking again
QUIET_S = 0.02  # no write for this long: a burst is over (a burst's chunks commit ~1 ms apart)
MAX_DEFER_S = 0.5  # the longest the cleaner waits for a pause in the writes


class Cleaner:
    def __init__(
        self,
        arena: Tier,
        a: int,
        copy: CopyDown,
        lock: Locked,
        index: BlockIndex,
        eviction: Eviction,
        fraction: float,
        closed: Callable[[], bool],
    ) -> None:
        """``copy``: into the disk tier, counted as "cleaned_blocks"; ``a``: the arena's place."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"clean_ahead must be in (0, 1], got {fraction}")
        self._arena = arena
        self._a = a
        self._copy = copy
        self._queue = copy.tier.write_queue()  # None: the disk takes a put when it returns
        self._lock = lock
        self._index = index
        self._eviction = eviction
        self._fraction = fraction
        self._closed = closed
        self._stop = False
        self._poked = threading.Event()
        self._last_write = 0.0  # time.monotonic() of the last poke
        self._busy_since: float | None = None  # waiting for a pause in the writes since
        self._thread = threading.Thread(target=self._run, name="kvstore-cleaner", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Blocks were stored: wake the cleaner if the arena is short of free room now (a check
        of the arena's usage, cheaper than waking a thread for every write)."""
        self._last_write = time.monotonic()
        if self._shortfall_target() is not None:
            self._poked.set()

    def _shortfall_target(self) -> int | None:
        """The bytes to keep clean when the arena has less than that free; None while it has."""
        usage = self._arena.usage()
        target = int(usage.capacity_bytes * self._fraction)
        return None if usage.capacity_bytes - usage.stored_bytes >= target else target

    def close(self) -> None:
        self._stop = True
        self._poked.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop:
            self._poked.wait(IDLE_WAIT_S)
            self._poked.clear()
            try:
                while not self._stop and self._round():
                    pass
            except Exception:  # a bug must not end cleaning silently: log it, go on later
                log.exception("the arena cleaner's round failed")

    def _wait_for_quiet(self) -> None:
        """Return once the store has had no write for QUIET_S, or at once when the writes have
        not paused for MAX_DEFER_S (until they do)."""
        while not self._stop:
            now = time.monotonic()
            quiet_at = self._last_write + QUIET_S
            if now >= quiet_at:
                self._busy_since = None
                return
            if self._busy_since is None:
                self._busy_since = now
            give_up_at = self._busy_since + MAX_DEFER_S
            if now >= give_up_at:
                return
            time.sleep(min(quiet_at, give_up_at) - now)

    def _round(self) -> bool:
        """Clean what is next in line; whether it cleaned anything (then it looks again)."""
        a, t = self._a, self._copy.t
        self._wait_for_quiet()  # the look below holds the store lock for a millisecond or two
        target = self._shortfall_target()
        if target is None:
            return False  # room enough: nothing will be evicted soon
        with self._lock:
            dirty = [
                b.ident
                for b in self._eviction.coldest(a, LOOK_BLOCKS, target)
                if t not in b.tiers and not b.pins
            ]
        cleaned = 0
        for ident in dirty:
            self._wait_for_quiet()
            if self._stop or self._closed():
                break
            block = self._index.get(ident)  # a glance without the lock: the copy looks again under it
            if block is None or not _half_empty(self._queue, block.size_bytes):
                break  # the disk is behind: the writers' demotions come first
            cleaned += self._copy(ident)
        return cleaned > 0


def _half_empty(queue: WriteQueue | None, size_bytes: int) -> bool:
    """Wait (up to QUEUE_WAIT_S) until the disk's write queue, ``size_bytes`` added, would be
    at most half full."""
    if queue is None:
        return True
    return queue.wait_for_queue_room(size_bytes + queue.queue_capacity_bytes // 2, QUEUE_WAIT_S)
