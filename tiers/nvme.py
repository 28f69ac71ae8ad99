"""The ``nvme`` tier: blocks in an LMDB environment on local disk, written by one writer thread.

Layout: one LMDB environment in ``NvmeConfig.path`` with two named databases, ``headers``
(key -> ``BlockHeader.pack()``) and ``payloads`` (key -> the stored bytes after the codec).
Both are written in the same write transaction, so a block is on disk whole or not at all.
At open the in-memory index is rebuilt from ``headers`` alone (it never touches payload pages),
so the cache survives restarts. Beside the environment: ``kvstore-nvme.lock`` (an flock: one
owner process per folder) and ``kvstore-nvme.unclean`` (present while a process has the
folder open; records the boot id and whether committed writes may be unsynced).

Writes: put() encodes or copies the payload (copies go into buffers recycled from committed
blocks: fresh memory faults in at a fraction of memcpy speed), records it in the index and a
pending map, and queues it; the writer thread commits queued operations in batches
(``batch_max_blocks`` / ``batch_max_bytes`` per transaction). A read of a queued key is served
from the pending copy (read-your-writes); delete() and overwriting puts cancel a queued put.
put() blocks while more than ``max_pending_bytes`` wait for the writer. flush() returns once
everything queued before it is committed and ``env.sync(True)`` has run; close() drains the
queue, syncs and closes.

Measured against raw LMDB with the same flags and batch (``benchmarks/tiers.py``'s nvme case,
2 MiB blocks, 384 MiB): write incl. the final sync 0.79-0.83x; warm read 0.66-0.72x, which is
the price of the xxh3 check on every read (~27 GB/s here against ~11 GB/s for the copy).

Flags, measured on this 2-core machine with a throwaway script (2 MiB values, 16 per write
transaction, 512 MiB per run, two runs): default flags 385-404 MB/s; writemap + map_async +
sync=False + metasync=False 1.82-1.84 GB/s into the page cache (780-830 MB/s counting a final
sync); sync=True + metasync=True 590-675 MB/s with writemap, 490-530 MB/s without. So both
modes use writemap; they differ in when data reaches the disk:

    "cache"    writemap, map_async, sync=False, metasync=False; the writer calls
               env.sync(True) every ``sync_interval_s`` while there are unsynced commits.
    "durable"  writemap, sync=True, metasync=True: every commit is on disk when it returns.

What a crash loses:

    process crash (SIGKILL), either mode: only the puts still queued. Committed pages live in
        the kernel's page cache (a shared file mapping) and reach the disk without us.
    power loss or kernel crash, "durable": only the puts still queued (given a disk that
        honours flushes).
    power loss or kernel crash, "cache": every commit since the last sync, and possibly the
        whole B-tree: without sync the disk may keep pages of later transactions but not the
        meta page, or the reverse. The marker guards this: the writer marks it dirty (fsynced)
        before the first commit after a sync and clean after the sync. An open that finds a
        dirty marker from an earlier boot discards the environment and starts empty (the
        folder is a cache); a clean marker means the last sync covered every commit.

After an unclean shutdown (the marker is present) an environment LMDB cannot open is
discarded with a warning in "cache" mode; in "durable" mode, or after a clean close, it raises
TierCorrupt: an operator should look before data is thrown away.

No torn block is ever readable: a transaction is atomic (header and payload appear together;
a transaction killed half-way never becomes visible), and every read verifies the xxh3-64
checksum of the stored bytes named in the header; a mismatch deletes the block, counts it in
``usage().checksum_failures`` and is a miss.

Capacity: ``capacity_bytes`` bounds the sum of stored (post-codec) bytes, queued puts
included, counted in memory; a payload longer than the capacity is BlockTooLarge whatever it
compresses to. With a codec, can_store() estimates the stored size from the compression ratio
of the blocks held. The LMDB map is larger (default ``2 * capacity + 64 MiB``, a sparse file):
LMDB copies pages on write and reuses freed pages only after later commits. A commit that
still hits MapFullError drops its blocks from the index (``write_failures``); the writer
keeps running. Under writemap a full file system turns a page write into SIGBUS, so the
folder needs room for the whole map; open() warns when it has not.

Threads: every method may be called from any thread. One lock guards the index, the pending
map and the queue; only the writer thread opens write transactions or syncs. Reads open their
own read transactions and never hold the lock while copying.

Buffers: put() keeps ``payload`` when it is ``bytes`` and copies anything else before it
returns. get_into() copies from the LMDB map (a view that is valid only inside its read
transaction) into ``out`` and keeps nothing; after a miss ``out`` may hold partial data.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import lmdb
import numpy as np
import xxhash

from tiers import nvme_folder
from tiers.base import (
    BlockHeader,
    BytesLike,
    Codec,
    StoredBlock,
    Tier,
    TierKey,
    TierUsage,
    check_fingerprint,
    check_key,
    check_meta,
)
from tiers.cipher import OVERHEAD_BYTES, BlockCipher
from tiers.codec import DEFAULT_ZSTD_LEVEL, CodecError, byte_view, decode_into, encode
from tiers.errors import BlockTooLarge, TierClosed, TierCorrupt, TierFull

log = logging.getLogger(__name__)

MiB = 1 << 20

Durability = Literal["cache", "durable"]


@dataclass(frozen=True)
class NvmeConfig:
    """Configuration of one ``nvme`` tier; ``path`` is a folder the tier owns."""

    path: str | Path
    capacity_bytes: int
    durability: Durability = "cache"
    sync_interval_s: float = 1.0
    batch_max_blocks: int = 64
    batch_max_bytes: int = 32 * MiB
    max_pending_bytes: int = 64 * MiB  # also what the buffer pool keeps for reuse
    codec: Codec = Codec.NONE
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    map_size_bytes: int | None = None  # None: 2 * capacity + 64 MiB
    cipher: BlockCipher | None = None  # encryption at rest (after the codec); None: plain

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.durability not in ("cache", "durable"):
            raise ValueError(f"durability must be 'cache' or 'durable', got {self.durability!r}")
        if self.sync_interval_s <= 0 or self.batch_max_blocks <= 0 or self.batch_max_bytes <= 0:
            raise ValueError("sync_interval_s, batch_max_blocks and batch_max_bytes must be positive")
        if self.max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be positive, got {self.max_pending_bytes}")
        if self.map_size_bytes is not None and self.map_size_bytes < self.capacity_bytes:
            raise ValueError("map_size_bytes must be at least capacity_bytes")

    @property
    def effective_map_size_bytes(self) -> int:
        if self.map_size_bytes is not None:
            return self.map_size_bytes
        return 2 * self.capacity_bytes + 64 * MiB


class _Entry(NamedTuple):
    """What the index keeps of a header: enough to read and verify without fetching it."""

    fingerprint: bytes
    payload_len: int
    stored_len: int
    meta: bytes
    codec: Codec
    checksum: int


@dataclass(eq=False)
class _PutOp:
    key: TierKey
    header: BlockHeader
    stored: bytes | bytearray  # a bytearray comes from the pool and goes back to it
    seq: int
    live: bool = True  # False once cancelled or committed: its bytes left the pending count
    refs: int = 1  # the queue's (then the writer's) reference, plus readers copying from it


@dataclass(frozen=True)
class _DeleteOp:
    key: TierKey
    seq: int


_Op = _PutOp | _DeleteOp
# Each operation of one transaction with the bytes it writes, captured under the lock.
_Batch = list[tuple[_Op, bytes | bytearray]]
_Found = tuple[TierKey, BlockHeader | None]  # a key in the header database; None: unreadable


@dataclass(frozen=True)
class _Corrupt:
    """A committed block whose stored bytes fail their header."""


@dataclass
class _Counters:
    checksum_failures: int = 0
    write_failures: int = 0
    stored_total: int = 0
    payload_total: int = 0
    fingerprints: dict[bytes, bytes] = field(default_factory=dict)  # interned: few models, many blocks


class _BufferPool:
    """Recycled payload copies, by exact size (a deployment stores one or two block sizes).

    Fresh memory faults in at ~2 GB/s on these machines against ~11 GB/s for a copy into warm
    memory, so put() copies into a buffer an earlier block has released. Holds at most
    ``max_bytes``; the tier's lock guards it.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._held_bytes = 0
        self._free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        if not free:
            return bytearray(size)
        self._held_bytes -= size
        return free.pop()

    def give(self, buffer: bytearray) -> None:
        if self._held_bytes + len(buffer) <= self._max_bytes:
            self._free.setdefault(len(buffer), []).append(buffer)
            self._held_bytes += len(buffer)


class NvmeTier(Tier):
    """LMDB-backed tier; see the module docstring for durability, threads and buffers."""

    name = "nvme"
    persistent = True

    def __init__(self, config: NvmeConfig) -> None:
        self._config = config
        self._folder = Path(config.path)
        # Block bytes are other people's prompts: only this user may read them (0700 / 0600).
        self._folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self._folder, 0o700)
        self._owner = nvme_folder.lock_folder(self._folder)
        opened = False
        try:
            self._env, self._headers, self._payloads, found = self._open_env()
            opened = True
        finally:
            if not opened:
                self._owner.close()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        # Separate from _cond (same lock) so that finishing a read never wakes the writer:
        # only close() waits for readers to drain.
        self._readers_gone = threading.Condition(lock)
        self._index: dict[TierKey, _Entry] = {}
        self._pending: dict[TierKey, _PutOp] = {}
        self._queue: collections.deque[_Op] = collections.deque()
        self._counts = _Counters()
        self._pool = _BufferPool(config.max_pending_bytes)
        self._pending_bytes = 0
        self._next_seq = 1
        self._committed_seq = 0
        self._synced_seq = 0
        self._sync_target = 0
        self._dirty = False  # commits since the last sync (cache mode)
        self._marker_dirty = False
        self._last_sync = time.monotonic()
        self._readers = 0
        self._closed = False
        self._stopping = False
        self._failure: str | None = None
        with self._cond:
            for key, header in found:
                if header is None:  # unreadable header: the block is gone, clear it from disk
                    self._enqueue_locked(_DeleteOp(key, self._take_seq_locked()))
                else:
                    self._index_add_locked(key, header)
        log.info(
            "nvme tier %s: %d blocks, %d bytes", self._folder, len(self._index), self._counts.stored_total
        )
        self._writer = threading.Thread(target=self._writer_main, name="kvstore-nvme-writer", daemon=True)
        self._writer.start()

    # ---- opening -------------------------------------------------------------------------

    def _open_env(self) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database, list[_Found]]:
        """Open the environment and read every header, applying the crash policy."""
        cache_mode = self._config.durability == "cache"
        marker = nvme_folder.read_marker(self._folder)
        this_boot = nvme_folder.boot_id()
        rebooted = marker is not None and (not this_boot or marker.get("boot_id") != this_boot)
        if cache_mode and marker is not None and marker.get("dirty") and rebooted:
            log.warning(
                "nvme tier %s: unsynced writes before a power loss or OS crash; discarding the cache",
                self._folder,
            )
            nvme_folder.wipe_environment(self._folder)
        try:
            return self._open_lmdb()
        except lmdb.Error as exc:
            if marker is None or not cache_mode:
                raise TierCorrupt(f"nvme tier {self._folder} cannot be opened: {exc}") from exc
            log.warning(
                "nvme tier %s: unreadable after an unclean shutdown (%s); starting empty", self._folder, exc
            )
            nvme_folder.wipe_environment(self._folder)
        try:
            return self._open_lmdb()
        except lmdb.Error as exc:
            raise TierCorrupt(f"nvme tier {self._folder} cannot be opened: {exc}") from exc

    def _open_lmdb(self) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database, list[_Found]]:
        durable = self._config.durability == "durable"
        map_size = self._config.effective_map_size_bytes
        nvme_folder.warn_if_disk_short(self._folder, map_size)
        env = lmdb.open(
            str(self._folder),
            map_size=map_size,
            max_dbs=2,
            writemap=True,
            map_async=not durable,
            sync=durable,
            metasync=durable,
            max_readers=512,
            max_spare_txns=16,
            mode=0o600,
        )
        try:
            headers = env.open_db(b"headers")
            payloads = env.open_db(b"payloads")
            found = _scan_headers(env, headers)
            # A killed owner may have left its commits only in the page cache: sync them
            # before the marker calls the folder clean.
            env.sync(True)
            nvme_folder.write_marker(self._folder, dirty=False)
        except BaseException:
            env.close()
            raise
        return env, headers, payloads, found

    # ---- the Tier contract ---------------------------------------------------------------

    def can_store(self, size_bytes: int) -> bool:
        """Whether a payload of ``size_bytes`` fits now.

        Capacity counts stored bytes. Without a codec that is exact; with one, the stored size
        is estimated from the compression ratio of the blocks held (none held: no compression),
        and put() decides on the real size, raising TierFull when the estimate was optimistic.
        """
        with self._cond:
            self._check_open_locked()
            counts = self._counts
            ratio = counts.stored_total / counts.payload_total if counts.payload_total else 1.0
            estimate = size_bytes if self._config.codec is Codec.NONE else int(size_bytes * min(ratio, 1.0))
            return counts.stored_total + estimate <= self._config.capacity_bytes

    def put(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None:
        check_key(key)
        check_fingerprint(fingerprint)
        check_meta(meta)
        capacity = self._config.capacity_bytes
        view = byte_view(payload)
        payload_len = len(view)
        # By payload, not stored size: whether a block can ever fit does not depend on its bytes.
        if payload_len > capacity:
            raise BlockTooLarge(f"block of {payload_len} bytes exceeds the nvme tier's {capacity}")
        self._check_open()
        codec = self._config.codec
        stored: bytes | bytearray = b""
        if codec is not Codec.NONE:
            stored = encode(codec, view, self._config.zstd_level)
            if len(stored) >= payload_len:
                codec = Codec.NONE  # compression did not pay
        cipher = self._config.cipher
        if cipher is not None:
            plain = byte_view(stored) if codec is not Codec.NONE else view
            with self._cond:
                sealed = self._pool.take(len(plain) + OVERHEAD_BYTES)
            cipher.seal_into(key, plain, memoryview(sealed))
            stored = sealed
        elif codec is Codec.NONE:
            stored = payload if isinstance(payload, bytes) else self._copy(view)
        header = BlockHeader(
            fingerprint, payload_len, len(stored), codec, xxhash.xxh3_64_intdigest(stored), meta=bytes(meta)
        )
        with self._cond:
            try:
                self._check_open_locked()
                self._check_room_locked(key, len(stored))
                while (
                    self._pending_bytes and self._pending_bytes + len(stored) > self._config.max_pending_bytes
                ):
                    self._cond.wait()  # back-pressure: the writer notifies after each commit
                    self._check_open_locked()
                self._check_room_locked(key, len(stored))
            except BaseException:
                if isinstance(stored, bytearray):
                    self._pool.give(stored)
                raise
            self._forget_locked(key)
            self._index_add_locked(key, header)
            op = _PutOp(key, header, stored, self._take_seq_locked())
            self._pending[key] = op
            self._pending_bytes += len(stored)
            self._enqueue_locked(op)

    def _copy(self, view: memoryview) -> bytearray:
        """A private copy of the payload, in a recycled buffer where one is free."""
        with self._cond:
            copy = self._pool.take(len(view))
        # numpy releases the GIL for the copy, so the writer thread keeps committing meanwhile
        np.copyto(np.frombuffer(copy, dtype=np.uint8), np.frombuffer(view, dtype=np.uint8))
        return copy

    def get_into(self, key: TierKey, out: memoryview) -> int | None:
        dst = byte_view(out)
        with self._cond:
            self._check_open_locked()
            entry = self._index.get(key)
            if entry is None:
                return None
            if len(dst) < entry.payload_len:
                raise ValueError(f"output buffer holds {len(dst)} bytes, block needs {entry.payload_len}")
            op = self._pending.get(key)
            if op is None:
                self._readers += 1
            else:
                op.refs += 1  # its buffer stays out of the pool until this copy is done
        if op is not None:
            # Queued bytes are private to this tier and were made by put(): nothing to verify.
            try:
                if self._config.cipher is not None:
                    return self._open(key, memoryview(op.stored), dst, op.header.codec, op.header.payload_len)
                return decode_into(op.header.codec, op.stored, dst, op.header.payload_len)
            finally:
                with self._cond:
                    self._unref_locked(op)
        try:
            result = self._read_committed(key, dst, entry)
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers and self._closed:
                    self._readers_gone.notify_all()
        if isinstance(result, _Corrupt):
            self._drop_corrupt(key, entry)
            return None
        return result

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
            self._enqueue_locked(_DeleteOp(key, self._take_seq_locked()))
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
                used_bytes=self._counts.payload_total,
                blocks=len(self._index),
                checksum_failures=self._counts.checksum_failures,
                stored_bytes=self._counts.stored_total,
            )

    @property
    def write_failures(self) -> int:
        """Blocks dropped because their commit failed (MapFullError or another LMDB error)."""
        with self._cond:
            return self._counts.write_failures

    def flush(self) -> None:
        with self._cond:
            self._check_open_locked()
            target = self._next_seq - 1
            if target <= self._synced_seq:
                return
            self._sync_target = max(self._sync_target, target)
            self._cond.notify_all()
            while self._synced_seq < target:
                self._check_open_locked()
                self._cond.wait()

    def close(self) -> None:
        """Drain the queue, sync, stop the writer and close the environment; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            self._cond.notify_all()
            while self._readers:
                self._readers_gone.wait()
        self._writer.join()
        self._env.close()
        if self._failure is None:
            nvme_folder.remove_marker(self._folder)
        self._owner.close()

    # ---- reading -------------------------------------------------------------------------

    def _read_committed(self, key: TierKey, dst: memoryview, entry: _Entry) -> int | _Corrupt | None:
        """Copy one committed block into ``dst`` and verify it against the header ``entry``
        the index holds (read at open or written by put), so a read fetches only the payload.
        Views of the map die with the transaction."""
        n = entry.payload_len
        with self._env.begin(buffers=True) as txn:
            stored = txn.get(key, db=self._payloads)
            if stored is None:
                return None  # deleted since the index lookup
            if len(stored) != entry.stored_len:
                return _Corrupt()
            if self._config.cipher is not None:
                if xxhash.xxh3_64_intdigest(stored) != entry.checksum:
                    return _Corrupt()
                opened = self._open(key, stored, dst, entry.codec, n)
                return _Corrupt() if opened is None else opened
            if entry.codec is Codec.NONE:
                dst[:n] = stored  # the one copy; verifying ``dst`` afterwards measured as fast as before
                return n if xxhash.xxh3_64_intdigest(dst[:n]) == entry.checksum else _Corrupt()
            if xxhash.xxh3_64_intdigest(stored) != entry.checksum:
                return _Corrupt()
            try:
                return decode_into(entry.codec, stored, dst, n)
            except CodecError:
                return _Corrupt()

    def _open(self, key: TierKey, sealed: memoryview, dst: memoryview, codec: Codec, n: int) -> int | None:
        """Decrypt (straight into ``dst`` without a codec) and decode; None when it does not
        open: a shredded or wrong key, or tampered bytes."""
        cipher = self._config.cipher
        assert cipher is not None
        if codec is Codec.NONE:
            return n if cipher.open_into(key, sealed, dst) == n else None
        plain = bytearray(len(sealed) - OVERHEAD_BYTES)
        if cipher.open_into(key, sealed, memoryview(plain)) is None:
            return None
        try:
            return decode_into(codec, plain, dst, n)
        except CodecError:
            return None

    def _drop_corrupt(self, key: TierKey, seen: _Entry) -> None:
        with self._cond:
            # A put that replaced the block since the index lookup explains the mismatch: the
            # bytes read were the newer block's. Not corruption, and not ours to delete.
            if self._closed or self._index.get(key) is not seen or key in self._pending:
                return
            self._counts.checksum_failures += 1
            log.warning("nvme tier: block %s failed its checksum; deleting it", key.hex())
            self._forget_locked(key)
            self._enqueue_locked(_DeleteOp(key, self._take_seq_locked()))

    # ---- bookkeeping (caller holds self._cond) --------------------------------------------

    def _check_open(self) -> None:
        with self._cond:
            self._check_open_locked()

    def _check_open_locked(self) -> None:
        if self._closed:
            raise TierClosed("nvme tier is closed")
        if self._failure is not None:
            raise TierCorrupt(f"nvme tier writer failed: {self._failure}")

    def _check_room_locked(self, key: TierKey, stored_len: int) -> None:
        old = self._index.get(key)
        after = self._counts.stored_total - (old.stored_len if old else 0) + stored_len
        if after > self._config.capacity_bytes:
            raise TierFull(
                f"nvme tier full: {self._counts.stored_total} of {self._config.capacity_bytes} bytes used"
            )

    def _index_add_locked(self, key: TierKey, header: BlockHeader) -> None:
        fingerprint = self._counts.fingerprints.setdefault(header.fingerprint, header.fingerprint)
        self._index[key] = _Entry(
            fingerprint, header.payload_len, header.stored_len, header.meta, header.codec, header.checksum
        )
        self._counts.stored_total += header.stored_len
        self._counts.payload_total += header.payload_len

    def _forget_locked(self, key: TierKey) -> bool:
        """Drop ``key`` from the index and cancel its queued put; whether it was present."""
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._counts.stored_total -= entry.stored_len
        self._counts.payload_total -= entry.payload_len
        op = self._pending.pop(key, None)
        if op is not None:
            self._release_locked(op)  # the writer skips it, or writes it and its successor follows
        return True

    def _release_locked(self, op: _PutOp) -> None:
        """The op's bytes stop counting against ``max_pending_bytes``."""
        if op.live:
            op.live = False
            self._pending_bytes -= op.header.stored_len
            self._cond.notify_all()

    def _unref_locked(self, op: _PutOp) -> None:
        """Drop one reference; the last one returns a pooled buffer to the pool."""
        op.refs -= 1
        if op.refs < 0:
            raise AssertionError("nvme tier: put operation released twice")
        if not op.refs and isinstance(op.stored, bytearray):
            self._pool.give(op.stored)
            op.stored = b""

    def _take_seq_locked(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _enqueue_locked(self, op: _Op) -> None:
        self._queue.append(op)
        self._cond.notify_all()

    # ---- the writer thread ---------------------------------------------------------------

    def _writer_main(self) -> None:
        finished = False
        try:
            self._writer_loop()
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

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping and not self._sync_due_locked():
                    self._cond.wait(self._wait_timeout_locked())
                batch = self._take_batch_locked()
                last_seq = self._queue[0].seq - 1 if self._queue else self._next_seq - 1
                done = self._stopping and not self._queue
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

    def _take_batch_locked(self) -> _Batch:
        """Pop up to one transaction's worth of operations, capturing each put's bytes."""
        batch: _Batch = []
        size = 0
        while (
            self._queue and len(batch) < self._config.batch_max_blocks and size < self._config.batch_max_bytes
        ):
            op = self._queue.popleft()
            if isinstance(op, _PutOp):
                if not op.live:
                    self._unref_locked(op)
                    continue  # cancelled by a delete or a newer put
                size += len(op.stored)
                batch.append((op, op.stored))
            else:
                batch.append((op, b""))
        return batch

    def _commit(self, batch: _Batch) -> None:
        if self._config.durability == "cache" and not self._marker_dirty:
            # Dirty before any page of this commit can reach the disk.
            nvme_folder.write_marker(self._folder, dirty=True)
            self._marker_dirty = True
        try:
            self._write_txn(batch)
            failed: _Batch = []
        except lmdb.MapFullError:
            failed = []
            for item in batch:  # commit one by one: only the blocks that do not fit are dropped
                try:
                    self._write_txn([item])
                except lmdb.MapFullError:
                    failed.append(item)
        except lmdb.Error as exc:
            log.error("nvme tier %s: commit of %d operations failed: %s", self._folder, len(batch), exc)
            failed = batch
        failed_ops = {id(op) for op, _ in failed}
        with self._cond:
            self._dirty = self._config.durability == "cache"
            self._counts.write_failures += len(failed)
            for op, _ in batch:
                if not isinstance(op, _PutOp):
                    continue
                if self._pending.get(op.key) is not op:
                    pass  # superseded while in flight: its successor decides what the index holds
                elif id(op) in failed_ops:
                    self._forget_locked(op.key)  # still the current version: the index must not keep it
                else:
                    del self._pending[op.key]
                    self._release_locked(op)
                self._unref_locked(op)
            if failed:
                log.warning(
                    "nvme tier %s: %d operations dropped (map full or LMDB error)", self._folder, len(failed)
                )

    def _write_txn(self, batch: _Batch) -> None:
        with self._env.begin(write=True) as txn:
            for op, stored in batch:
                if isinstance(op, _PutOp):
                    txn.put(op.key, op.header.pack(), db=self._headers)
                    txn.put(op.key, stored, db=self._payloads)
                else:
                    txn.delete(op.key, db=self._headers)
                    txn.delete(op.key, db=self._payloads)

    def _sync_due_locked(self) -> bool:
        if self._synced_seq < self._sync_target <= self._committed_seq:
            return True
        interval = self._config.sync_interval_s
        return self._dirty and time.monotonic() - self._last_sync >= interval

    def _wait_timeout_locked(self) -> float | None:
        if not self._dirty:
            return None
        return max(0.0, self._last_sync + self._config.sync_interval_s - time.monotonic())

    def _sync(self) -> None:
        with self._cond:
            seq = self._committed_seq  # only this thread advances it
        self._env.sync(True)
        if self._marker_dirty:
            nvme_folder.write_marker(self._folder, dirty=False)
            self._marker_dirty = False
        with self._cond:
            self._synced_seq = max(self._synced_seq, seq)
            self._dirty = False
            self._last_sync = time.monotonic()
            self._cond.notify_all()


def _scan_headers(env: lmdb.Environment, headers: lmdb._Database) -> list[_Found]:
    """Every key of the header database with its parsed header; payload pages stay cold."""
    with env.begin(db=headers, buffers=True) as txn:
        return [(TierKey(bytes(key)), BlockHeader.unpack(raw)) for key, raw in txn.cursor()]
