"""The ``nvme`` tier's writer: the queue of puts and deletes, and the one thread that commits it.

The tier (``tiers.nvme``) makes each block's stored bytes and keeps the index; this module owns
what happens between put() returning and the block being on disk (the ``_locked`` queue
methods below, from put_locked() to queue_full_locked(), are ``tiers.nvme_queue.WriteQueue``'s):

    NvmeWriter(config, folder, env, headers, payloads, cond, pool, forget)
    put_locked(key, header, stored)   queue a put: the key is *pending* until it is committed
    delete_locked(key)                queue a delete
    cancel_locked(key)                the pending put of ``key`` is superseded (a delete, a newer put)
    is_pending_locked(key)            whether a put of ``key`` still waits for the writer
    pin_pending_locked(key)           that put, pinned: its buffer stays out of the pool until
    release_locked(op)                  the pin is released (a count going negative raises)
    queue_full_locked(stored_len)     back-pressure: put() waits while this holds
    request_sync_locked()             flush(): a sequence number to wait for with synced_locked()
    stop_locked(), then join()        close(): drain the queue, sync, end the thread
    failure, write_failures           why the thread stopped (None: it did not), blocks dropped

Order: construct, queue the deletes the open found necessary, start(); stop_locked() and join()
once at the end.

Batches: the thread pops operations in queue order, at most ``batch_max_blocks`` /
``batch_max_bytes`` per write transaction, and skips cancelled puts. A put cancelled while in
flight is written anyway; the operation that cancelled it comes later in the queue, so the disk
ends as the index says. A committed put leaves the pending map and stops counting against
``max_pending_bytes``. A commit that hits MapFullError is retried one operation per transaction,
so only the blocks that do not fit are dropped; those, and every block of a commit that fails
with another LMDB error, count in ``write_failures`` and go to ``forget(key)`` when still the
key's latest version, so that the tier's index does not keep them. The thread keeps running.

Sync schedule (the two modes are described in ``tiers.nvme``): every ``sync_interval_s`` while
there are unsynced commits ("cache" mode only: a "durable" commit is on disk when it returns),
once a flush() is covered by the commits, and before the thread exits. The unclean marker
follows it in "cache" mode: dirty (fsynced) before the first commit after a sync, so before any
page of that commit can reach the disk, and clean again after the sync.

Deleted and replaced values are cleared where they lay right after their commit, once the reads
of the older snapshot are done (``tiers.nvme_wipe``; not with a cipher: its key is shredded).

Room (``tiers.nvme_room``): before each commit the thread reserves the file's blocks as far as
the commit can write (writemap writes pages through a mapping: a page a full file system cannot
back would be SIGBUS). A commit that cannot have its room, or whose marker or sync fails for a
full or read-only file system, makes the tier *degraded* (``degraded`` says why; one warning):
its puts are dropped (``write_failures``), its deletes still commit within the room reserved,
put() refuses new blocks (``refuse_locked``, counted in ``refused_writes``), reads go on. Every
``nvme_room.PROBE_S`` the thread tries the room of a few blocks (``PROBE_BYTES``) again, and the
tier takes writes once it has it (one line). An environment opened read-only stays degraded.

Failure: any other ``lmdb.Error`` or ``OSError`` from a sync or a marker write means the medium is
unusable. The thread stops, ``failure`` says why, and the tier refuses its calls from then on.

Threads: the tier's Condition, passed in, guards every field here; a ``_locked`` method expects
it held. The thread holds it only to take a batch and to record the result, never during a
write transaction, a sync or a marker write, and notifies it after each commit and sync (put()
and flush() wait on it). Once the tier is open only this thread writes to LMDB or the marker.

Buffers: from put_locked() the queue owns ``stored`` (``tiers.nvme_queue``: the queue, which
``NvmeWriter`` extends with its thread, the queue's items and the buffer pool).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb

from tiers import nvme_folder
from tiers.base import TierKey
from tiers.nvme_config import NvmeConfig
from tiers.nvme_queue import Batch, BufferPool, PutOp, WriteQueue
from tiers.nvme_room import DELETE_ROOM_BYTES, PROBE_BYTES, PROBE_S, DiskRoom, NoRoom, is_no_room, read_only
from tiers.nvme_wipe import Span, Wiper, span, zero

log = logging.getLogger("tiers.nvme")  # the tier's name: its logs stay under one logger


class NvmeWriter(WriteQueue):
    """The write queue of one nvme tier and its thread; see the module docstring."""

    def __init__(
        self,
        config: NvmeConfig,
        folder: Path,
        env: lmdb.Environment,
        headers: lmdb._Database,
        payloads: lmdb._Database,
        cond: threading.Condition,
        pool: BufferPool,
        forget: Callable[[TierKey], object],
        no_room: str | None = None,
        sealed: bool = False,
        writable_again: Callable[[], None] | None = None,
    ) -> None:
        """``forget(key)`` is called with ``cond`` held for a pending put whose commit failed;
        ``no_room``: why the tier starts degraded (None: it does not); ``sealed``: values are
        encrypted (the tier's cipher), so what a commit frees needs no clearing;
        ``writable_again``: called (once, on this thread) when the file system of an environment
        opened read-only takes writes again: the tier then swaps this writer for one on a
        writable environment."""
        super().__init__(config, cond, pool)
        self._sealed = sealed
        self._folder = folder
        self._env = env
        self._headers = headers
        self._payloads = payloads
        self._forget = forget
        self._writable_again = writable_again
        self._committed_seq = 0
        self._synced_seq = 0
        self._sync_target = 0
        self._dirty = False  # commits since the last sync (cache mode)
        self._marker_dirty = False
        self._last_sync = time.monotonic()
        self._wiper = Wiper(env)  # clears what each commit frees (tiers.nvme_wipe)
        self._stopping = False
        self._failure: str | None = None
        self._write_failures = 0
        self._room = DiskRoom(folder, config.effective_map_size_bytes, env.stat()["psize"])
        self._read_only = bool(env.flags()["readonly"])
        self._degraded: str | None = None
        self._refused = 0
        self._next_probe = 0.0
        if no_room is not None:
            with cond:
                self._degrade_locked(no_room)
        self._thread = threading.Thread(target=self._main, name="kvstore-nvme-writer", daemon=True)

    # ---- called by the tier (with the lock held, but for start and join) --------------------

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def stop_locked(self) -> None:
        """Commit what is queued, sync, and end the thread; join() waits for it."""
        self._stopping = True
        self._cond.notify_all()

    @property
    def failure(self) -> str | None:
        """Why the thread stopped early; None while it has not. Read with the lock held."""
        return self._failure

    @property
    def write_failures(self) -> int:
        """Blocks dropped because their commit failed. Read with the lock held."""
        return self._write_failures

    @property
    def degraded(self) -> str | None:
        """Why the tier takes no writes now (a full or read-only file system); None while it
        does. Read with the lock held."""
        return self._degraded

    @property
    def refused_writes(self) -> int:
        """Puts refused while degraded. Read with the lock held."""
        return self._refused

    def refuse_locked(self) -> None:
        self._refused += 1

    @property
    def committed_seq(self) -> int:
        """Every operation up to this sequence number is committed (or failed). Read with the
        lock held."""
        return self._committed_seq

    def request_sync_locked(self) -> int:
        """Ask for a sync covering every operation queued so far; returns the sequence number
        that synced_locked() then waits for."""
        target = self._next_seq - 1
        if target > self._synced_seq:
            self._sync_target = max(self._sync_target, target)
            self._cond.notify_all()
        return target

    def synced_locked(self, seq: int) -> bool:
        """Whether operations up to ``seq`` are synced, or, degraded, handled (committed or
        dropped: a sync that cannot happen is not waited for)."""
        return self._synced_seq >= seq or (self._degraded is not None and self._committed_seq >= seq)

    # ---- the writer thread ---------------------------------------------------------------

    def _main(self) -> None:
        finished = False
        try:
            self._loop()
            finished = True
        except (lmdb.Error, OSError) as exc:  # a failed sync or marker write: the medium is unusable
            log.error("nvme tier %s: writer failed: %s", self._folder, exc)
            with self._cond:
                self._failure = str(exc)
                self._cond.notify_all()
        finally:
            if not finished:
                with self._cond:
                    self._failure = self._failure or "writer thread stopped unexpectedly"
                    self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._queue
                    and not self._stopping
                    and not self._sync_due_locked()
                    and not self._probe_due_locked()
                ):
                    self._cond.wait(self._wait_timeout_locked())
                probe = self._probe_due_locked()
                batch = self._take_batch_locked()
                last_seq = self._queue[0].seq - 1 if self._queue else self._next_seq - 1
                done = self._stopping and not self._queue
            if probe:
                self._probe()
            if batch:
                self._commit(batch)
            with self._cond:
                self._committed_seq = max(self._committed_seq, last_seq)
                self._cond.notify_all()
                sync = self._sync_due_locked() or (
                    done and (self._dirty or self._synced_seq < self._committed_seq)
                )
            if sync:
                self._sync()
            if done:
                return

    def _commit(self, batch: Batch) -> None:
        try:
            failed = self._write_within_room(batch)
        except NoRoom:
            failed = self._write_what_fits(batch)
        failed_ops = {id(op) for op, _ in failed}
        with self._cond:
            self._dirty = self._dirty or self._config.durability == "cache"  # or cleared pages to sync
            self._write_failures += len(failed)
            for op, _ in batch:
                if not isinstance(op, PutOp):
                    continue
                if self._pending.get(op.key) is not op:
                    pass  # superseded while in flight: its successor decides what the index holds
                elif id(op) in failed_ops:
                    self._forget(op.key)  # still the current version: the index must not keep it
                else:
                    del self._pending[op.key]
                    self._uncount_locked(op)
                self.release_locked(op)
            if failed and self._degraded is None:  # degraded: its one line said it
                log.warning(
                    "nvme tier %s: %d operations dropped (map full or LMDB error)", self._folder, len(failed)
                )

    def _write_within_room(self, batch: Batch) -> Batch:
        """Commit ``batch`` once its room is reserved and the marker says dirty; the items that
        failed. Raises NoRoom, having written nothing, when the file system has no room."""
        puts = any(isinstance(op, PutOp) for op, _ in batch)
        self._reserve(sum(len(stored) for _, stored in batch), len(batch), DELETE_ROOM_BYTES if puts else 0)
        try:
            self._write_txn(batch)
            return []
        except lmdb.MapFullError:
            failed = []
            for item in batch:  # commit one by one: only the blocks that do not fit are dropped
                try:
                    self._write_txn([item])
                except lmdb.MapFullError:
                    failed.append(item)
            return failed
        except lmdb.Error as exc:
            if is_no_room(exc):
                raise NoRoom(str(exc)) from exc
            log.error("nvme tier %s: commit of %d operations failed: %s", self._folder, len(batch), exc)
            return batch

    def _write_what_fits(self, batch: Batch) -> Batch:
        """A batch without room: its operations one a commit until the first that finds none,
        then the tier degrades, the puts left are dropped and the deletes go in the room
        reserved for them; the items that failed."""
        failed: Batch = []
        for i, item in enumerate(batch):
            try:
                failed += self._write_within_room([item])
            except NoRoom as exc:
                self._degrade(exc.reason)
                rest = batch[i:]
                deletes = [item for item in rest if not isinstance(item[0], PutOp)]
                failed += [item for item in rest if isinstance(item[0], PutOp)]
                try:
                    failed += self._write_within_room(deletes) if deletes else []
                except NoRoom:
                    failed += deletes
                break
        return failed

    def _reserve(self, stored_bytes: int, ops: int, spare_bytes: int) -> None:
        """The room a commit of ``ops`` operations and ``stored_bytes`` needs, ``spare_bytes``
        more, and the marker dirty before any page of it can reach the disk; NoRoom when the
        medium cannot."""
        if self._read_only:
            raise NoRoom("read-only file system (writes resume once it is writable)")
        if self._config.durability == "cache" and not self._marker_dirty:  # before the room: see _probe
            try:
                nvme_folder.write_marker(self._folder, dirty=True)
            except OSError as exc:
                if not is_no_room(exc):
                    raise
                raise NoRoom(f"cannot write its marker file: {exc.strerror}") from exc
            self._marker_dirty = True
        self._room.ensure(self._room.commit_end(self._env, stored_bytes, ops) + spare_bytes)

    def _degrade(self, reason: str) -> None:
        with self._cond:
            self._degrade_locked(reason)

    def _degrade_locked(self, reason: str) -> None:
        if self._degraded is None:
            log.warning(
                "nvme tier %s degraded: %s; new blocks are not written to it (counted in "
                "kvstore_tier_write_failures_total), stored ones are still served; "
                "writes resume when room returns",
                self._folder,
                reason,
            )
        self._degraded = reason
        self._next_probe = time.monotonic() + PROBE_S
        self._cond.notify_all()  # flush() no longer waits for a sync

    def _probe_due_locked(self) -> bool:
        return (
            self._degraded is not None
            and (not self._read_only or self._writable_again is not None)
            and not self._stopping
            and time.monotonic() >= self._next_probe
        )

    def _probe(self) -> None:
        """Whether the room of a full batch can be had again; the tier takes writes if so."""
        if self._read_only:  # only a writable environment can take them: the tier reopens it
            writable = not read_only(self._folder)
            with self._cond:
                self._next_probe = time.monotonic() + (float("inf") if writable else PROBE_S)
            if writable and self._writable_again is not None:
                self._writable_again()
            return
        try:
            # A new marker file and a sync: what a read-only file system refuses. The marker
            # first: the room reserved ahead may take every block just freed (ext4 keeps what
            # a fallocate got before it failed), and a marker after it then never fitted.
            nvme_folder.write_marker(self._folder, dirty=True)
            self._marker_dirty = True
            self._reserve(min(PROBE_BYTES, self._config.batch_max_bytes), 1, DELETE_ROOM_BYTES)
            self._env.sync(True)
        except (NoRoom, OSError, lmdb.Error) as exc:
            if not isinstance(exc, NoRoom) and not is_no_room(exc):
                raise
            with self._cond:
                self._next_probe = time.monotonic() + PROBE_S
            return
        with self._cond:
            reason, self._degraded = self._degraded, None
            self._dirty = self._dirty or self._marker_dirty  # a sync cleans the marker the probe set
            refused, failed = self._refused, self._write_failures
            self._cond.notify_all()
        log.warning(
            "nvme tier %s: writable again (degraded by: %s; %d puts refused and %d blocks dropped so far)",
            self._folder,
            reason,
            refused,
            failed,
        )

    def _write_txn(self, batch: Batch) -> None:
        if write_txn(
            self._env, self._headers, self._payloads, batch, self._wiper if not self._sealed else None
        ):
            with self._cond:
                self._dirty = True  # the zeros reach the disk with the next sync, in either mode

    def _sync_due_locked(self) -> bool:
        if self._synced_seq < self._sync_target <= self._committed_seq:
            return True
        interval = self._config.sync_interval_s
        return self._dirty and time.monotonic() - self._last_sync >= interval

    def _wait_timeout_locked(self) -> float | None:
        now = time.monotonic()
        probing = self._degraded is not None and (not self._read_only or self._writable_again is not None)
        probe = self._next_probe - now if probing else None
        if not self._dirty:
            return None if probe is None else max(0.0, probe)
        sync = self._last_sync + self._config.sync_interval_s - now
        return max(0.0, sync if probe is None else min(sync, probe))

    def _sync(self) -> None:
        with self._cond:
            seq = self._committed_seq  # only this thread advances it
        try:
            if not self._read_only:
                self._env.sync(True)
            if self._marker_dirty:
                nvme_folder.write_marker(self._folder, dirty=False)
                self._marker_dirty = False
        except (lmdb.Error, OSError) as exc:
            if not is_no_room(exc):
                raise
            # Unsynced, the marker stays dirty (a reboot then discards the cache, the safe
            # side); the next interval tries again.
            with self._cond:
                self._degrade_locked(f"sync failed: {exc}")
                self._last_sync = time.monotonic()
            return
        with self._cond:
            self._synced_seq = max(self._synced_seq, seq)
            self._dirty = False
            self._last_sync = time.monotonic()
            self._cond.notify_all()


def write_txn(
    env: lmdb.Environment,
    headers: lmdb._Database,
    payloads: lmdb._Database,
    batch: Batch,
    wiper: Wiper | None,
) -> bool:
    """Commit ``batch`` in one write transaction; whether ``wiper`` then cleared values it
    deleted or replaced (pages the next sync must write). ``wiper`` None: values are sealed."""
    # Values this commit deletes or replaces are cleared where they lie (tiers.nvme_wipe);
    # buffers=True makes get() a view of the map. Sealed values need no clearing: shredding
    # their key is what makes them unreadable.
    freed: list[Span] = []
    written: set[bytes] = set()
    with env.begin(write=True, buffers=True) as txn:
        snapshot = txn.id() - 1
        for op, stored in batch:
            where = span(txn, op.key, payloads) if wiper is not None else None
            if where is not None and op.key in written:
                zero([where])  # written by this transaction: no reader sees these pages
            elif where is not None:
                freed.append(where)
            if isinstance(op, PutOp):
                txn.put(op.key, op.header.pack(), db=headers)
                txn.put(op.key, stored, db=payloads)
                written.add(op.key)
            else:
                txn.delete(op.key, db=headers)
                txn.delete(op.key, db=payloads)
    return bool(freed) and wiper is not None and wiper.freed(snapshot, freed)
