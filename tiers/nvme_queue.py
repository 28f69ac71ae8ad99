"""The ``nvme`` tier's write queue: its items, the puts still pending, and the buffer pool.

``PutOp`` and ``DeleteOp`` are the queue's items; ``WriteQueue`` keeps them in order, with the
pending puts by key (read-your-writes, cancellation, back-pressure), and hands the writer thread
(``tiers.nvme_writer``) one transaction's worth at a time. A put's stored bytes come from the
tier's ``BufferPool`` and go back to it once committed and unread: the queue's reference and
every reader's pin gone.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from tiers.base import BlockHeader, TierKey
from tiers.nvme_config import NvmeConfig


class BufferPool:
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


@dataclass(eq=False)
class PutOp:
    """A queued put; readers use ``header`` and ``stored`` only while they hold a pin."""

    key: TierKey
    header: BlockHeader
    stored: bytes | bytearray  # a bytearray comes from the pool and goes back to it
    seq: int
    live: bool = True  # False once cancelled or committed: its bytes left the pending count
    refs: int = 1  # the queue's (then the writer's) reference, plus readers copying from it


@dataclass(frozen=True)
class DeleteOp:
    key: TierKey
    seq: int


Op = PutOp | DeleteOp
# Each operation of one transaction with the bytes it writes, captured under the lock.
Batch = list[tuple[Op, bytes | bytearray]]


class WriteQueue:
    """The operations of one nvme tier waiting for its writer, in order, and the puts among them
    still pending (``NvmeWriter`` is one); every method expects the tier's Condition held."""

    def __init__(self, config: NvmeConfig, cond: threading.Condition, pool: BufferPool) -> None:
        self._config = config
        self._cond = cond
        self._pool = pool
        self._pending: dict[TierKey, PutOp] = {}
        self._queue: collections.deque[Op] = collections.deque()
        self._pending_bytes = 0
        self._next_seq = 1

    def put_locked(self, key: TierKey, header: BlockHeader, stored: bytes | bytearray) -> None:
        op = PutOp(key, header, stored, self._take_seq_locked())
        self._pending[key] = op
        self._pending_bytes += len(stored)
        self._enqueue_locked(op)

    def delete_locked(self, key: TierKey) -> None:
        self._enqueue_locked(DeleteOp(key, self._take_seq_locked()))

    def cancel_locked(self, key: TierKey) -> None:
        op = self._pending.pop(key, None)
        if op is not None:
            self._uncount_locked(op)  # the writer skips it, or writes it and its successor follows

    def is_pending_locked(self, key: TierKey) -> bool:
        return key in self._pending

    def pending_seq_locked(self, key: TierKey) -> int:
        """The sequence number of ``key``'s pending put (``committed_seq`` passes it once it is
        committed); 0 when none is pending."""
        op = self._pending.get(key)
        return 0 if op is None else op.seq

    def any_pending_locked(self) -> bool:
        """Whether any put waits for the writer (none: a batched read pins nothing)."""
        return bool(self._pending)

    def pin_pending_locked(self, key: TierKey) -> PutOp | None:
        """The pending put of ``key``, pinned until release_locked(); None when none is pending."""
        op = self._pending.get(key)
        if op is not None:
            op.refs += 1
        return op

    def release_locked(self, op: PutOp) -> None:
        """Drop one reference; the last one returns a pooled buffer to the pool."""
        op.refs -= 1
        if op.refs < 0:
            raise AssertionError("nvme tier: put operation released twice")
        if not op.refs and isinstance(op.stored, bytearray):
            self._pool.give(op.stored)
            op.stored = b""

    def queue_full_locked(self, stored_len: int) -> bool:
        """Whether ``stored_len`` more bytes would pass ``max_pending_bytes``; a block larger
        than the bound goes once nothing else is pending."""
        pending = self._pending_bytes
        return bool(pending) and pending + stored_len > self._config.max_pending_bytes

    def _uncount_locked(self, op: PutOp) -> None:
        """The op's bytes stop counting against ``max_pending_bytes``."""
        if op.live:
            op.live = False
            self._pending_bytes -= op.header.stored_len
            self._cond.notify_all()

    def _take_seq_locked(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _enqueue_locked(self, op: Op) -> None:
        self._queue.append(op)
        self._cond.notify_all()

    def _take_batch_locked(self) -> Batch:
        """Pop up to one transaction's worth of operations, capturing each put's bytes."""
        batch: Batch = []
        size = 0
        while (
            self._queue and len(batch) < self._config.batch_max_blocks and size < self._config.batch_max_bytes
        ):
            op = self._queue.popleft()
            if isinstance(op, PutOp):
                if not op.live:
                    self.release_locked(op)
                    continue  # cancelled by a delete or a newer put
                size += len(op.stored)
                batch.append((op, op.stored))
            else:
                batch.append((op, b""))
        return batch
