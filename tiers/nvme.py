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

Measured against raw LMDB with the same flags and batch (``benchmarks/tiers.py``'s nvme case;
figures in BENCHMARKS.md): writes include the final sync; a warm read pays for the xxh3 check
on every read, which ``verified_copy`` hides by reading the map once: each stripe is hashed and
stored in one pass (``tiers._verify``, in C with xxHash's own kernels; in Python, hashing a
chunk and then copying it, where no C compiler built it).

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
returns. get_into() copies from the LMDB map (a view that is valid only inside its read
transaction) into ``out`` and keeps nothing; after a miss ``out`` may hold partial data.
get_into_many() reads a batch the same way in one read transaction, with one lock hold for its
lookups (the store reads a request's blocks of one tier through it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, cast

import lmdb
import numpy as np
import xxhash

from tiers import nvme_folder, nvme_room
from tiers.base import (
    BlockHeader,
    BytesLike,
    Codec,
    StoredBlock,
    Tier,
    TierKey,
    TierUsage,
    bound_checksum,
    check_fingerprint,
    check_key,
    check_meta,
)
from tiers.cipher import OVERHEAD_BYTES, BlockCipher
from tiers.codec import DEFAULT_ZSTD_LEVEL, CodecError, byte_view, decode_into, encode
from tiers.errors import BlockTooLarge, TierBusy, TierClosed, TierCorrupt, TierFull
from tiers.nvme_env import open_env
from tiers.nvme_writer import BufferPool, NvmeWriter, PutOp

log = logging.getLogger(__name__)

MiB = 1 << 20

Durability = Literal["cache", "durable"]


@dataclass(frozen=True)
class NvmeConfig:
    """The LMDB tier on local disk: the long tail below the arena, and what survives a restart."""

    enabled: bool = True  # keep an nvme tier
    path: str = ""  # its folder, which the tier owns; "": <data_dir>/nvme
    capacity_bytes: int = 16 << 30  # bytes of blocks it may hold (the LMDB map is sparse and larger)
    # cache: fast flags, synced every sync_interval_s (a power loss loses the writes since);
    # durable: every transaction synced. No torn block is readable in either
    durability: Durability = "cache"
    sync_interval_s: float = 1.0  # how often cache mode syncs
    # zstd-byteplane compresses only the high bytes of bf16 values
    codec: Codec = Codec.NONE
    zstd_level: int = DEFAULT_ZSTD_LEVEL  # zstd level for the codecs
    encryption_keys_dir: str = ""  # AES-256-GCM at rest, a key file per tenant here; "" = off
    batch_max_blocks: int = 64  # puts committed in one write transaction, at most
    batch_max_bytes: int = 32 * MiB  # bytes committed in one write transaction, at most
    # Puts queued for the disk; beyond: refused as busy (also what the buffer pool keeps for reuse)
    max_pending_bytes: int = 64 * MiB
    map_size_bytes: int = 0  # the LMDB map (sparse); 0: 2 * capacity_bytes + 64MiB
    throttle_bytes_per_s: int = 0  # benchmarks only: emulate a slower tier; 0 = off

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"nvme.capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.durability not in ("cache", "durable"):
            raise ValueError(f"nvme.durability must be 'cache' or 'durable', got {self.durability!r}")
        if self.sync_interval_s <= 0 or self.batch_max_blocks <= 0 or self.batch_max_bytes <= 0:
            raise ValueError("nvme.sync_interval_s, batch_max_blocks and batch_max_bytes must be positive")
        if self.max_pending_bytes <= 0:
            raise ValueError(f"nvme.max_pending_bytes must be positive, got {self.max_pending_bytes}")
        if self.map_size_bytes and self.map_size_bytes < self.capacity_bytes:
            raise ValueError("nvme.map_size_bytes must be at least nvme.capacity_bytes")

    @property
    def effective_map_size_bytes(self) -> int:
        if self.map_size_bytes:
            return self.map_size_bytes
        return 2 * self.capacity_bytes + 64 * MiB


class _Entry(NamedTuple):
    """What the index keeps of a header: enough to read and verify without fetching it."""

    fingerprint: bytes
    payload_len: int
    stored_len: int
    meta: bytes
    codec: Codec
    checksum: int  # xxh3-64 of the stored bytes (unbound from the key: ``_index_add_locked``)


@dataclass(frozen=True)
class _Corrupt:
    """A committed block whose stored bytes fail their header."""


@dataclass
class _Counters:
    checksum_failures: int = 0
    stored_total: int = 0
    payload_total: int = 0
    fingerprints: dict[bytes, bytes] = field(default_factory=dict)  # interned: few models, many blocks


class NvmeTier(Tier):
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
            self._env, headers, self._payloads, found = env.env, env.headers, env.payloads, env.found
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
        self._index: dict[TierKey, _Entry] = {}
        self._counts = _Counters()
        self._pool = BufferPool(config.max_pending_bytes)
        self._readers = 0
        self._closed = False
        self._writer = NvmeWriter(
            config,
            self._folder,
            self._env,
            headers,
            self._payloads,
            self._cond,
            self._pool,
            self._forget_locked,
            env.no_room,
            sealed=cipher is not None,
        )
        dropped = 0
        with self._cond:
            for key, header in found:
                if header is None:  # unreadable, or of an older format: gone, clear it from disk
                    self._writer.delete_locked(key)
                    dropped += 1
                else:
                    self._index_add_locked(key, header)
        if dropped:
            log.warning(
                "nvme tier %s: dropped %d blocks whose header is unreadable or of an older format",
                self._folder,
                dropped,
            )
        log.info(
            "nvme tier %s: %d blocks, %d bytes", self._folder, len(self._index), self._counts.stored_total
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
            counts = self._counts
            ratio = counts.stored_total / counts.payload_total if counts.payload_total else 1.0
            estimate = size_bytes if self._config.codec is Codec.NONE else int(size_bytes * min(ratio, 1.0))
            return counts.stored_total + estimate <= self._config.capacity_bytes

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
        codec = self._config.codec
        stored: bytes | bytearray = b""
        if codec is not Codec.NONE:
            stored = encode(codec, view, self._config.zstd_level)
            if len(stored) >= payload_len:
                codec = Codec.NONE  # compression did not pay
        cipher = self._cipher
        if cipher is not None:
            plain = byte_view(stored) if codec is not Codec.NONE else view
            with self._cond:
                sealed = self._pool.take(len(plain) + OVERHEAD_BYTES)
            cipher.seal_into(key, plain, memoryview(sealed))
            stored = sealed
        elif codec is Codec.NONE:
            stored = payload if isinstance(payload, bytes) else self._copy(view)
        checksum = bound_checksum(key, xxhash.xxh3_64_intdigest(stored))
        header = BlockHeader(fingerprint, payload_len, len(stored), codec, checksum, meta=bytes(meta))
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
            self._index_add_locked(key, header)
            self._writer.put_locked(key, header, stored)

    @property
    def queue_capacity_bytes(self) -> int | None:
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

    def _copy(self, view: memoryview) -> bytearray:
        """A private copy of the payload, in a recycled buffer where one is free."""
        with self._cond:
            copy = self._pool.take(len(view))
        # numpy releases the GIL for the copy, so the writer thread keeps committing meanwhile
        np.copyto(np.frombuffer(copy, dtype=np.uint8), np.frombuffer(view, dtype=np.uint8))
        return copy

    def get_into(self, key: TierKey, out: memoryview) -> int | None:
        dst = byte_view(out)
        with self._lock:
            self._check_open_locked()
            entry = self._index.get(key)
            if entry is None:
                return None
            if len(dst) < entry.payload_len:
                raise ValueError(f"output buffer holds {len(dst)} bytes, block needs {entry.payload_len}")
            op = self._writer.pin_pending_locked(key)  # its buffer stays out of the pool meanwhile
            if op is None:
                self._readers += 1
        if op is not None:
            try:
                return self._read_pending(key, op, dst)
            finally:
                with self._lock:
                    self._writer.release_locked(op)
        try:
            result = self._read_committed(key, dst, entry)
        finally:
            with self._lock:
                self._readers -= 1
                if not self._readers and self._closed:
                    self._readers_gone.notify_all()
        if isinstance(result, _Corrupt):
            self._drop_corrupt(key, entry)
            return None
        return result

    def get_into_many(
        self, keys: Sequence[TierKey], outs: Sequence[memoryview], sizes: list[int | None]
    ) -> None:
        """``get_into`` of each key into its buffer, appending each length (None for a miss) to
        ``sizes``: one hold of the lock for the whole batch's index lookups and one for its end,
        and one read transaction for all its committed blocks (the store reads a request's
        blocks of one tier this way). A buffer too small for its block raises ValueError after
        the blocks before it were read, nothing copied into it. Runs of plain blocks (committed,
        no codec, no cipher) are read by ``tiers._verify.read_plain`` where it is built: the
        same steps as ``_copy_committed`` without the interpreter between blocks."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys and {len(outs)} buffers")
        dsts = [byte_view(out) for out in outs]
        with self._lock:
            self._check_open_locked()
            entries = [self._index.get(key) for key in keys]
            limit, need = len(keys), 0  # the blocks before the first whose buffer is too small
            for i, e in enumerate(entries):
                if e is not None and len(dsts[i]) < e.payload_len:
                    limit, need = i, e.payload_len
                    break
            if self._writer.any_pending_locked():
                ops = [
                    None if e is None else self._writer.pin_pending_locked(k)
                    for k, e in zip(keys[:limit], entries[:limit], strict=True)
                ]
            else:  # a warm read: nothing queued to pin
                ops = [None] * limit
            self._readers += 1
        corrupt: list[tuple[TierKey, _Entry]] = []
        try:
            with self._env.begin(db=self._payloads, buffers=True) as txn:  # its get's default
                batch = list(keys[:limit])
                plain = _verify is not None and self._cipher is None
                i = 0
                while i < limit:
                    if plain:  # the plain blocks from i on in C, up to one it hands back
                        bad: list[int] = []
                        i = _verify.read_plain(txn.get, batch, entries, ops, dsts, Codec.NONE, i, sizes, bad)
                        corrupt += [(batch[j], cast(_Entry, entries[j])) for j in bad]
                        if i == limit:
                            break
                    key, entry, op, dst = batch[i], entries[i], ops[i], dsts[i]
                    if entry is None:
                        sizes.append(None)
                    elif op is not None:
                        sizes.append(self._read_pending(key, op, dst))
                    else:
                        result = self._copy_committed(txn, key, dst, entry)
                        if isinstance(result, _Corrupt):
                            corrupt.append((key, entry))
                            result = None
                        sizes.append(result)
                    i += 1
        finally:
            with self._lock:
                for op in ops:
                    if op is not None:
                        self._writer.release_locked(op)
                self._readers -= 1
                if not self._readers and self._closed:
                    self._readers_gone.notify_all()
            for key, entry in corrupt:
                self._drop_corrupt(key, entry)
        if limit < len(keys):
            raise ValueError(f"output buffer holds {len(dsts[limit])} bytes, block needs {need}")

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
                used_bytes=self._counts.payload_total,
                blocks=len(self._index),
                checksum_failures=self._counts.checksum_failures,
                stored_bytes=self._counts.stored_total,
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

    # ---- reading -------------------------------------------------------------------------

    def _read_committed(self, key: TierKey, dst: memoryview, entry: _Entry) -> int | _Corrupt | None:
        """Copy one committed block into ``dst`` and verify it against the header ``entry``
        the index holds (read at open or written by put), so a read fetches only the payload.
        Views of the map die with the transaction."""
        with self._env.begin(buffers=True) as txn:
            return self._copy_committed(txn, key, dst, entry)

    def _copy_committed(
        self, txn: lmdb.Transaction[memoryview], key: TierKey, dst: memoryview, entry: _Entry
    ) -> int | _Corrupt | None:
        n = entry.payload_len
        stored = txn.get(key, db=self._payloads)
        if stored is None:
            return None  # deleted since the index lookup
        if len(stored) != entry.stored_len:
            return _Corrupt()
        if self._cipher is not None:
            if xxhash.xxh3_64_intdigest(stored) != entry.checksum:
                return _Corrupt()
            opened = self._open(key, stored, dst, entry.codec, n)
            return _Corrupt() if opened is None else opened
        if entry.codec is Codec.NONE:
            return n if verified_copy(stored, dst, entry.checksum) else _Corrupt()
        if xxhash.xxh3_64_intdigest(stored) != entry.checksum:
            return _Corrupt()
        try:
            return decode_into(entry.codec, stored, dst, n)
        except CodecError:
            return _Corrupt()

    def _read_pending(self, key: TierKey, op: PutOp, dst: memoryview) -> int | None:
        # Queued bytes are private to this tier and were made by put(): nothing to verify.
        if self._cipher is not None:
            return self._open(key, memoryview(op.stored), dst, op.header.codec, op.header.payload_len)
        return decode_into(op.header.codec, op.stored, dst, op.header.payload_len)

    def _open(self, key: TierKey, sealed: memoryview, dst: memoryview, codec: Codec, n: int) -> int | None:
        """Decrypt (straight into ``dst`` without a codec) and decode; None when it does not
        open: a shredded or wrong key, or tampered bytes."""
        cipher = self._cipher
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
            if self._closed or self._index.get(key) is not seen or self._writer.is_pending_locked(key):
                return
            self._counts.checksum_failures += 1
            log.warning("nvme tier: block %s failed its checksum; deleting it", key.hex())
            self._forget_locked(key)
            self._writer.delete_locked(key)

    # ---- bookkeeping (caller holds self._cond) --------------------------------------------

    def _check_open(self) -> None:
        with self._cond:
            self._check_open_locked()

    def _check_open_locked(self) -> None:
        if self._closed:
            raise TierClosed("nvme tier is closed")
        failure = self._writer.failure
        if failure is not None:
            raise TierCorrupt(f"nvme tier writer failed: {failure}")

    def _check_room_locked(self, key: TierKey, stored_len: int) -> None:
        old = self._index.get(key)
        after = self._counts.stored_total - (old.stored_len if old else 0) + stored_len
        if after > self._config.capacity_bytes:
            raise TierFull(
                f"nvme tier full: {self._counts.stored_total} of {self._config.capacity_bytes} bytes used"
            )

    def _index_add_locked(self, key: TierKey, header: BlockHeader) -> None:
        fingerprint = self._counts.fingerprints.setdefault(header.fingerprint, header.fingerprint)
        # The index keeps the xxh3-64 the stored bytes must have under *this* key (the header's
        # is bound to the key it was written under), so every read path, C's included, compares
        # the bytes' plain hash: a header and payload moved under another key fail it.
        checksum = bound_checksum(key, header.checksum)
        self._index[key] = _Entry(
            fingerprint, header.payload_len, header.stored_len, header.meta, header.codec, checksum
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
        self._writer.cancel_locked(key)
        return True


VERIFY_CHUNK_BYTES = 1 << 20  # hashed, then copied while the hash left it in cache (L2 2 MiB here)


def verified_copy_py(stored: memoryview, dst: memoryview, checksum: int) -> bool:
    """Copy ``stored`` into ``dst``; whether its xxh3-64 is ``checksum``. The fallback of
    ``tiers._verify.verified_copy`` (tiers/native/verify.c), which hashes and stores each
    stripe in one pass without the GIL; this one reads at 0.65-0.78x of raw LMDB's bare copy
    where that one reads at 0.8-1.3x (BENCHMARKS.md, "Tiers").

    Each chunk is hashed first and copied right after, from the cache the hash just filled
    (copying first and hashing the copy was slower). A block of one chunk that fails is not
    copied at all. It verifies what reaches
    ``dst`` because the bytes hashed and the bytes copied are the same pages of one read
    transaction: LMDB never rewrites a page a live reader sees (copy-on-write), and no other
    process writes the folder (its flock). The codec and cipher paths read the map the same
    way: hash, then decode or decrypt.
    """
    n = len(stored)
    if n <= VERIFY_CHUNK_BYTES:
        if xxhash.xxh3_64_intdigest(stored) != checksum:
            return False
        dst[:n] = stored
        return True
    hasher = xxhash.xxh3_64()  # streamed, the digest equals the one-shot one put() stored
    for start in range(0, n, VERIFY_CHUNK_BYTES):
        chunk = stored[start : start + VERIFY_CHUNK_BYTES]
        hasher.update(chunk)
        dst[start : start + len(chunk)] = chunk
    return hasher.intdigest() == checksum


try:
    from tiers import _verify  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler
    _verify = None
    verified_copy = verified_copy_py
else:
    verified_copy = _verify.verified_copy
