"""The ``nvme`` tier: blocks in an LMDB environment on local disk, written by one writer thread.

Layout: one LMDB environment in ``NvmeConfig.path`` with two named databases, ``headers``
(key -> ``BlockHeader.pack()``) and ``payloads`` (key -> the stored bytes after the codec).
Both are written in the same write transaction, so a block is on disk whole or not at all.
At open the in-memory index is rebuilt from ``headers`` alone (it never touches payload pages),
so the cache survives restarts. Beside the environment: ``kvstore-nvme.lock`` (an flock: one
owner process per folder) and ``kvstore-nvme.unclean`` (present while a process has the
folder open; records the boot id and whether committed writes may be unsynced).

Writes: put() encodes or copies the payload (copies go into buffers recycled from committed
blocks: fresh memory faults in at a fraction of memcpy speed), records it in the index and
hands it to the writer (``tiers.nvme_writer``: the queue, the pending map, batching, the sync
schedule and the marker), whose thread commits queued operations in batches. A read of a
queued key is served from the pending copy (read-your-writes); delete() and overwriting puts
cancel a queued put. put() blocks while more than ``max_pending_bytes`` wait for the writer;
put_nowait() raises TierBusy then (the store's placements under its lock use it).
flush() returns once everything queued before it is committed and ``env.sync(True)`` has run;
close() drains the queue, syncs and closes.

Measured against raw LMDB with the same flags and batch (``benchmarks/tiers_nvme.py``,
``kvstore bench tiers``): writes include the final sync; reads pay for the checksum, which
``tiers.nvme_stored.verified_copy`` checks while it copies. The settings: ``tiers.nvme_config``;
the index and its byte counts: ``tiers.nvme_index``.

Durability: in "cache" mode (the default) the writer syncs every ``sync_interval_s`` while
commits are unsynced; in "durable" mode every commit is on disk when it returns. The LMDB flags
of each (measured), what a crash loses in each and what an open does after one: ``tiers.nvme_env``.

No torn block is ever readable: a transaction is atomic (header and payload appear together;
a transaction killed half-way never becomes visible), and every read verifies the xxh3-64
checksum of the stored bytes named in the header, bound to the block's key
(``tiers.base.bound_checksum``); a mismatch (a torn or altered block, or one moved under another
key, namespace or model) deletes the block, counts it in ``usage().checksum_failures`` and is a
miss. Headers of the previous format (version 1, not bound) do not parse: such blocks are
dropped at open, and the count logged (a cache refills; nothing is misread).

Capacity: ``capacity_bytes`` bounds the sum of stored (post-codec) bytes, queued puts
included, counted in memory; a payload longer than the capacity is BlockTooLarge whatever it
compresses to. With a codec, can_store() estimates the stored size from the compression ratio
of the blocks held. The LMDB map is larger (default ``2 * capacity + 64 MiB``, a sparse file):
LMDB copies pages on write and reuses freed pages only after later commits. A commit that
still hits MapFullError drops its blocks from the index (``write_failures``); the writer
keeps running. Under writemap a page a full file system cannot back would be SIGBUS: the
writer reserves the file's room before each commit (``tiers.nvme_room``) and, where there is
none, the tier degrades (writes refused and counted, reads go on) until room returns.

Threads: every method may be called from any thread. One lock (a Condition the tier makes and
shares with its writer) guards the index, the counts, the buffer pool, and the writer's queue
and pending map; only the writer thread opens write transactions or syncs. Reads open their
own read transactions and never hold the lock while copying.

Buffers: put() keeps ``payload`` when it is ``bytes`` and copies anything else before it
returns. Reads (get_into, get_into_many, and what a damaged read drops): ``tiers.nvme_reads``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tiers import nvme_folder, nvme_room
from tiers.base import (
    BytesLike,
    Codec,
    StoredBlock,
    Tier,
    TierKey,
    TierUsage,
    WriteQueue,
    check_fingerprint,
    check_key,
    check_meta,
)
from tiers.cipher import BlockCipher
from tiers.codec import byte_view
from tiers.errors import BlockTooLarge, TierBusy, TierClosed, TierCorrupt, TierFull
from tiers.nvme_config import NvmeConfig
from tiers.nvme_env import open_env, reopen_env
from tiers.nvme_index import NvmeIndex
from tiers.nvme_queue import BufferPool
from tiers.nvme_reads import NvmeReads
from tiers.nvme_stored import make_stored
from tiers.nvme_writer import NvmeWriter

# NvmeConfig too: whoever makes the tier makes its config (tiers.nvme_config holds it).
__all__ = ["NvmeConfig", "NvmeTier"]

log = logging.getLogger(__name__)


class NvmeTier(NvmeReads, Tier):
    """LMDB-backed tier; see the module docstring for durability, threads and buffers."""

    name = "nvme"
    persistent = True

    def __init__(self, config: NvmeConfig, cipher: BlockCipher | None = None) -> None:
        """``cipher``: encryption at rest after the codec, made by the caller from
        ``config.encryption_keys_dir`` and the store's key layout; None: plain."""
        if not config.path:
            raise ValueError("the nvme tier needs a folder (nvme.path)")
        self._config = config
        self._cipher = cipher
        self._folder = Path(config.path)
        # Block bytes are other people's prompts: only this user may read them (0700 / 0600).
        self._folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not nvme_room.read_only(self._folder):
            os.chmod(self._folder, 0o700)
        self._owner = nvme_folder.lock_folder(self._folder)
        opened = False
        try:
            env = open_env(self._folder, config)
            self._env, self._headers, self._payloads, found = env.env, env.headers, env.payloads, env.found
            # Counted where the server's metrics read it (``usage().damaged_moved``).
            self._damaged_moved = 0 if env.damaged_to is None else 1
            opened = True
        finally:
            if not opened:
                self._owner.close()
        lock = threading.Lock()
        self._lock = lock  # what get_into takes: a Condition's own with-block is Python code
        self._cond = threading.Condition(lock)
        # Separate from _cond (same lock) so that finishing a read never wakes the writer:
        # only close() waits for readers to drain.
        self._readers_gone = threading.Condition(lock)
        self._index = NvmeIndex()
        self._pool = BufferPool(config.max_pending_bytes)
        self._readers = 0
        self._closed = False
        self._reopening = False
        self._writer = self._new_writer(env.no_room)
        dropped = 0
        with self._cond:
            for key, header in found:
                if header is None:  # unreadable, or of an older format: gone, clear it from disk
                    self._writer.delete_locked(key)
                    dropped += 1
                else:
                    self._index.add(key, header)
        if dropped:
            log.warning(
                "nvme tier %s: dropped %d blocks whose header is unreadable or of an older format",
                self._folder,
                dropped,
            )
        log.info(
            "nvme tier %s: %d blocks, %d bytes", self._folder, len(self._index), self._index.stored_total
        )
        self._writer.start()

    # ---- the Tier contract ---------------------------------------------------------------

    def can_store(self, size_bytes: int) -> bool:
        """Whether a payload of ``size_bytes`` fits now.

        Capacity counts stored bytes. Without a codec that is exact; with one, the stored size
        is estimated from the compression ratio of the blocks held (none held: no compression),
        and put() decides on the real size, raising TierFull when the estimate was optimistic.
        """
        with self._cond:
            self._check_open_locked()
            compressed = self._config.codec is not Codec.NONE
            return self._index.may_fit(size_bytes, compressed, self._config.capacity_bytes)

    def put(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None:
        self._put(key, payload, fingerprint, meta, wait=True)

    def put_nowait(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None:
        self._put(key, payload, fingerprint, meta, wait=False)

    def _put(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes, wait: bool) -> None:
        check_key(key)
        check_fingerprint(fingerprint)
        check_meta(meta)
        capacity = self._config.capacity_bytes
        view = byte_view(payload)
        payload_len = len(view)
        # By payload, not stored size: whether a block can ever fit does not depend on its bytes.
        if payload_len > capacity:
            raise BlockTooLarge(f"block of {payload_len} bytes exceeds the nvme tier's {capacity}")
        with self._cond:  # before the copy: a refused block costs no memcpy
            self._check_open_locked()
            if self._writer.degraded is not None:
                self._writer.refuse_locked()
                raise TierFull(f"nvme tier degraded: {self._writer.degraded}")
            if not wait and self._writer.queue_full_locked(payload_len):
                raise self._busy()
        config, take = self._config, self._take_buffer
        header, stored = make_stored(
            key, payload, view, fingerprint, meta, config.codec, config.zstd_level, self._cipher, take
        )
        with self._cond:
            try:
                self._check_open_locked()
                self._check_room_locked(key, len(stored))
                while self._writer.queue_full_locked(len(stored)):
                    if not wait:
                        raise self._busy()
                    self._cond.wait()  # back-pressure: the writer notifies after each commit
                    self._check_open_locked()
                self._check_room_locked(key, len(stored))
            except BaseException:
                if isinstance(stored, bytearray):
                    self._pool.give(stored)
                raise
            self._forget_locked(key)
            self._index.add(key, header)
            self._writer.put_locked(key, header, stored)

    # ---- its write queue (``tiers.base.WriteQueue``; put_nowait above) ------------------------

    def write_queue(self) -> WriteQueue:
        return self

    @property
    def queue_capacity_bytes(self) -> int:
        return self._config.max_pending_bytes

    def wait_for_queue_room(self, nbytes: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._writer.queue_full_locked(nbytes):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed or self._writer.failure is not None:
                    return False
                self._cond.wait(left)  # the writer notifies after each commit
            return True

    def unwritten_mark(self, key: TierKey) -> int:
        with self._cond:
            return self._writer.pending_seq_locked(key)

    def written_mark(self) -> int:
        with self._cond:
            if self._writer.failure is not None:
                return sys.maxsize  # nothing more will be written: nobody may wait for it
            return self._writer.committed_seq

    def wait_written(self, mark: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._writer.committed_seq < mark and self._writer.failure is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)  # the writer notifies after each commit
            return True

    def _busy(self) -> TierBusy:
        return TierBusy(
            f"the nvme write queue is full ({self._config.max_pending_bytes} B): the disk is behind"
        )

    def _take_buffer(self, size: int) -> bytearray:
        with self._cond:
            return self._pool.take(size)

    def size_of(self, key: TierKey) -> int | None:
        with self._cond:
            self._check_open_locked()
            entry = self._index.get(key)
        return None if entry is None else entry.payload_len

    def delete(self, key: TierKey) -> bool:
        with self._cond:
            self._check_open_locked()
            if not self._forget_locked(key):
                return False
            self._writer.delete_locked(key)
            return True

    def scan(self) -> Iterator[StoredBlock]:
        """Every block, pending puts included, as of the call (a snapshot)."""
        with self._cond:
            self._check_open_locked()
            blocks = [
                StoredBlock(key, e.fingerprint, e.payload_len, e.meta) for key, e in self._index.items()
            ]
        return iter(blocks)

    def usage(self) -> TierUsage:
        with self._cond:
            return TierUsage(
                name=self.name,
                capacity_bytes=self._config.capacity_bytes,
                used_bytes=self._index.payload_total,
                blocks=len(self._index),
                checksum_failures=self._index.checksum_failures,
                stored_bytes=self._index.stored_total,
                degraded=self._writer.degraded is not None,
                write_failures=self._writer.write_failures + self._writer.refused_writes,
                damaged_moved=self._damaged_moved,
            )

    @property
    def degraded(self) -> str | None:
        """Why the tier takes no writes now (a full or read-only file system); None while it does."""
        with self._cond:
            return self._writer.degraded

    @property
    def write_failures(self) -> int:
        """Blocks dropped because their commit failed (MapFullError or another LMDB error, no
        room on the file system); puts refused while degraded are ``usage().write_failures``."""
        with self._cond:
            return self._writer.write_failures

    @property
    def config(self) -> NvmeConfig:
        """Its ``[nvme]`` section, as the builder handed it over."""
        return self._config

    @property
    def cipher(self) -> BlockCipher | None:
        """The keys sealing this tier's blocks, for the server's shredding (None: plaintext)."""
        return self._cipher

    def flush(self) -> None:
        with self._cond:
            self._check_open_locked()
            target = self._writer.request_sync_locked()
            while not self._writer.synced_locked(target):
                self._check_open_locked()
                self._cond.wait()

    def close(self) -> None:
        """Drain the queue, sync, stop the writer and close the environment; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._writer.stop_locked()
            while self._readers:
                self._readers_gone.wait()
        self._writer.join()
        self._env.close()
        if self._writer.failure is None:
            try:
                nvme_folder.remove_marker(self._folder)
            except OSError as exc:  # a read-only file system: the next open finds it unclean
                log.warning("nvme tier %s: cannot remove its marker file: %s", self._folder, exc.strerror)
        self._owner.close()

    # ---- a read-only environment, writable again ------------------------------------------

    def _new_writer(self, no_room: str | None) -> NvmeWriter:
        return NvmeWriter(
            self._config,
            self._folder,
            self._env,
            self._headers,
            self._payloads,
            self._cond,
            self._pool,
            self._forget_locked,
            no_room,
            sealed=self._cipher is not None,
            writable_again=lambda: threading.Thread(
                target=self._reopen_writable, name="kvstore-nvme-reopen", daemon=True
            ).start(),
        )

    def _reopen_writable(self) -> None:
        """Swap the read-only environment (opened on a read-only file system) for a writable
        one once its file system takes writes again: calls wait meanwhile (``_check_open_locked``)
        and the index stays as it is (what was deleted meanwhile is deleted on disk now)."""
        with self._cond:
            if self._closed or self._reopening:
                return
            self._reopening = True
            old = self._writer
            old.stop_locked()
            while self._readers:
                self._readers_gone.wait()
        old.join()
        try:
            self._env.close()  # LMDB opens an environment once per process
            opened = reopen_env(self._folder, self._config)
            self._env, self._headers, self._payloads = opened.env, opened.headers, opened.payloads
            writer = self._new_writer(opened.no_room)
        except BaseException:
            log.exception("nvme tier %s: cannot open it again; the tier is closed", self._folder)
            with self._cond:
                self._closed = True  # its calls fail from now on, none reads a closed environment
                self._reopening = False
                self._readers_gone.notify_all()
            raise
        with self._cond:
            self._writer = writer
            for key, _ in opened.found:
                if self._index.get(key) is None:  # deleted while read-only
                    writer.delete_locked(key)
            self._reopening = False
            self._readers_gone.notify_all()
            self._cond.notify_all()
        writer.start()
        if writer.degraded is None:
            log.warning("nvme tier %s: its file system is writable again; writes resume", self._folder)

    # ---- bookkeeping (caller holds self._cond) --------------------------------------------

    def _check_open(self) -> None:
        with self._cond:
            self._check_open_locked()

    def _check_open_locked(self) -> None:
        while self._reopening:  # the environment is being swapped (``_reopen_writable``)
            self._readers_gone.wait()
        if self._closed:
            raise TierClosed("nvme tier is closed")
        failure = self._writer.failure
        if failure is not None:
            raise TierCorrupt(f"nvme tier writer failed: {failure}")

    def _check_room_locked(self, key: TierKey, stored_len: int) -> None:
        if not self._index.fits(key, stored_len, self._config.capacity_bytes):
            raise TierFull(
                f"nvme tier full: {self._index.stored_total} of {self._config.capacity_bytes} bytes used"
            )

    def _forget_locked(self, key: TierKey) -> bool:
        """Drop ``key`` from the index and cancel its queued put; whether it was present."""
        if self._index.pop(key) is None:
            return False
        self._writer.cancel_locked(key)
        return True
