"""Write-behind: new blocks reach the persistent tier shortly after they are stored, on a thread.

Why: blocks live first in the `dram` arena, which a crash (SIGKILL, OOM kill) takes with it.
Copying each new block to `nvme` soon after it is acknowledged bounds what a crash loses to the
queue's contents, without making a put wait for the disk (``store.write_through`` does that).

Contract:
    offer(item, size_bytes) -> bool    queue an item; False (and nothing queued) when the queue
                                       already holds ``max_bytes``: the caller counts a drop, the
                                       block stays where it is and reaches nvme on demotion or a
                                       clean close. Never blocks.
    drain(timeout_s) -> bool           wait until everything offered so far was handled
    close()                            stop the thread after the queue is empty (or abandoned)

``copy(items)`` runs on the thread, outside any lock of the caller's, with up to ``batch``
items queued at once (oldest first: a batch lets a remote tier send many blocks in one round
trip); it must not raise for an ordinary failure (a block deleted meanwhile, a full tier): it
decides and counts. An exception is logged and the batch dropped, so one bad block cannot stop
the thread.

Thread-safe: ``offer`` from any thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class WriteBehind(Generic[T]):
    def __init__(
        self,
        copy: Callable[[Sequence[T]], None],
        max_bytes: int,
        name: str = "kvstore-write-behind",
        batch: int = 1,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self._copy = copy
        self._batch = batch
        self._max_bytes = max_bytes
        self._queue: collections.deque[tuple[T, int]] = collections.deque()
        self._queued_bytes = 0
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def offer(self, item: T, size_bytes: int) -> bool:
        with self._cond:
            if self._closing or (self._queue and self._queued_bytes + size_bytes > self._max_bytes):
                return False
            self._queue.append((item, size_bytes))
            self._queued_bytes += size_bytes
            self._cond.notify_all()
            return True

    def drain(self, timeout_s: float) -> bool:
        """True once every item offered before the call has been copied (or dropped)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Copy what is queued (up to ``timeout_s``), then stop the thread."""
        self.drain(timeout_s)
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing and not self._queue:
                    return
                taken = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                self._busy = True
            try:
                self._copy([item for item, _ in taken])
            except Exception:  # one bad block must not stop every later copy
                log.exception("write-behind copy failed; the blocks stay only where they are")
            finally:
                with self._cond:
                    self._queued_bytes -= sum(size for _, size in taken)
                    self._busy = False
                    self._cond.notify_all()
