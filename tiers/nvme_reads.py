"""The ``nvme`` tier's reads: ``get_into`` and ``get_into_many``, and what a damaged read drops.

``NvmeReads`` is mixed into ``tiers.nvme.NvmeTier``, which owns every attribute named below
(the lock, the index, the writer, the environment) and swaps the environment and writer while
no reader runs (``NvmeTier._reopen_writable``). A read takes the lock only for its index lookups
and to pin a queued put; it copies outside the lock, counted in ``_readers`` so that close() and
the environment swap wait for it.

A read of a queued key copies the pending bytes (read-your-writes); a committed block is copied
from the LMDB map inside a read transaction of its own (its views die with the transaction),
checking the block's bound checksum as it copies. A mismatch, or a page LMDB itself finds
damaged, deletes the block, counts it in ``usage().checksum_failures`` and is a miss, unless a
put replaced the block since the lookup (then the bytes read were the newer block's).

Buffers: get_into() copies into ``out`` and keeps nothing; after a miss ``out`` may hold
partial data. get_into_many() reads a batch the same way in one read transaction, with one lock
hold for its lookups (the store reads a request's blocks of one tier through it).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import lmdb

from tiers.base import TierKey
from tiers.cipher import BlockCipher
from tiers.codec import byte_view
from tiers.nvme_index import NvmeIndex
from tiers.nvme_stored import Corrupt, Entry, copy_committed, read_batch, read_pending
from tiers.nvme_writer import NvmeWriter

log = logging.getLogger("tiers.nvme")  # the tier's own logger: its lines read as the tier's


class NvmeReads(ABC):
    """The read half of ``NvmeTier``; the tier sets these attributes (see ``tiers.nvme``)."""

    _lock: threading.Lock
    _cond: threading.Condition
    _readers_gone: threading.Condition
    _readers: int
    _closed: bool
    _reopening: bool
    _index: NvmeIndex
    _writer: NvmeWriter
    _env: lmdb.Environment
    _payloads: lmdb._Database
    _cipher: BlockCipher | None

    @abstractmethod
    def _check_open_locked(self) -> None:
        """Raise TierClosed or TierCorrupt unless the tier serves calls (caller holds the lock)."""

    @abstractmethod
    def _forget_locked(self, key: TierKey) -> bool:
        """Drop ``key`` from the index and cancel its queued put (caller holds the lock)."""

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
                return read_pending(self._cipher, key, op, dst)
            finally:
                with self._lock:
                    self._writer.release_locked(op)
        try:
            result = self._read_committed(key, dst, entry)
        except lmdb.Error as exc:  # a page LMDB itself finds damaged: the block is lost
            self._drop_corrupt(key, entry, f"is on a damaged page ({exc})")
            return None
        finally:
            with self._lock:
                self._reader_done_locked()
        if isinstance(result, Corrupt):
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
        no codec, no cipher) go through C where it is built (``nvme_stored.read_batch``)."""
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
        corrupt: list[tuple[TierKey, Entry]] = []
        damaged: list[tuple[TierKey, Entry, str]] = []
        first, done = len(sizes), 0
        try:
            while done < limit:
                try:
                    with self._env.begin(db=self._payloads, buffers=True) as txn:  # its get's default
                        read_batch(
                            txn,
                            self._payloads,
                            self._cipher,
                            list(keys[done:limit]),
                            entries[done:limit],
                            ops[done:limit],
                            dsts[done:limit],
                            sizes,
                            corrupt,
                        )
                    done = limit
                except lmdb.Error as exc:  # a page LMDB finds damaged: that block lost, the rest read on
                    done = len(sizes) - first  # the block whose read met it
                    entry = entries[done]
                    if entry is not None:
                        damaged.append((keys[done], entry, str(exc)))
                    sizes.append(None)
                    done += 1
        finally:
            with self._lock:
                for op in ops:
                    if op is not None:
                        self._writer.release_locked(op)
                self._reader_done_locked()
            for key, entry in corrupt:
                self._drop_corrupt(key, entry)
            for key, entry, why in damaged:
                self._drop_corrupt(key, entry, f"is on a damaged page ({why})")
        if limit < len(keys):
            raise ValueError(f"output buffer holds {len(dsts[limit])} bytes, block needs {need}")

    def _reader_done_locked(self) -> None:
        """A read outside the lock has ended: close() and the environment swap wait for the last."""
        self._readers -= 1
        if not self._readers and (self._closed or self._reopening):
            self._readers_gone.notify_all()

    def _read_committed(self, key: TierKey, dst: memoryview, entry: Entry) -> int | Corrupt | None:
        """``copy_committed`` in a read transaction of its own: views of the map die with it."""
        with self._env.begin(buffers=True) as txn:
            return copy_committed(txn, self._payloads, self._cipher, key, dst, entry)

    def _drop_corrupt(self, key: TierKey, seen: Entry, why: str = "failed its checksum") -> None:
        with self._cond:
            # A put that replaced the block since the index lookup explains the mismatch: the
            # bytes read were the newer block's. Not corruption, and not ours to delete.
            if self._closed or self._index.get(key) is not seen or self._writer.is_pending_locked(key):
                return
            self._index.checksum_failures += 1
            log.warning("nvme tier: block %s %s; deleting it", key.hex(), why)
            self._forget_locked(key)
            self._writer.delete_locked(key)
