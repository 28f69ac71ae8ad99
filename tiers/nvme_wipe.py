"""Deletion that deletes, on the nvme tier: a deleted or replaced value's bytes are overwritten
with zeros where they lie, right after the transaction that freed them commits.

LMDB frees a deleted value's pages to its free list and leaves their bytes as they were until a
later write reuses them, which may be never; a put of zeros under the key first does not help
either: a committed value's overflow pages are not rewritten in place, LMDB writes the new value
to other pages and frees the old ones. The environment is opened with ``writemap`` (its file is
mapped read-write, ``tiers.nvme_env``), so the value a write transaction reads with
``buffers=True`` is a view of the very pages that hold it: ``span`` notes where, and ``zero``
clears it through that address.

When: a committed value belongs to the snapshot every reader began in until the delete commits,
so it is cleared only after the commit (``Wiper.freed``), once no read transaction of an older
snapshot is left (LMDB's reader table; a read lasts one request's copy: the writer waits that
long at most, after a commit that freed values), and before the writer thread opens its next
write transaction, the only one that could reuse the pages. A value
written earlier in the same transaction is on pages no reader sees: cleared at once. A reader
that outlives ``WAIT_S`` leaves those pages as they are (logged; later commits do not wait for
it again): they hold the bytes until reused. The zeros reach the file's pages at once and the disk with the next sync (the writer
marks itself dirty), as the delete does.

Blocks are stored on overflow pages (values above about half a page, 2 KiB on 4 KiB pages),
which LMDB never copies: the cleared pages are the only ones that held the block. A value small
enough to live inside a leaf page may have left copies in leaf pages LMDB copied on write; those
stay until reused (SECURITY.md).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

WAIT_S = 5.0  # for readers of an older snapshot to finish before their pages are cleared

Span = tuple[int, int]  # (address in the map, length)


def span(txn: Any, key: bytes, db: Any) -> Span | None:
    """Where the value under ``key`` lies in the map, or None when there is none. ``txn`` is a
    write transaction of a ``writemap`` environment begun with ``buffers=True``."""
    view = txn.get(key, db=db)
    if view is None or not len(view):
        return None
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data), len(view)


def zero(spans: Sequence[Span]) -> int:
    """Clear each span; the bytes cleared."""
    for address, length in spans:
        ctypes.memset(address, 0, length)
    return sum(length for _, length in spans)


class Wiper:
    """Clears what each commit freed (the writer thread's; not thread-safe)."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self._stuck = -1.0  # the snapshot of a reader that outlived WAIT_S: not waited for again

    def freed(self, snapshot: int, spans: Sequence[Span]) -> bool:
        """Clear ``spans``, freed by the transaction that followed ``snapshot``, once no reader
        of ``snapshot`` or older is left; False (nothing cleared) while one outlives ``WAIT_S``
        (another process's long read, say: then later commits do not wait for it again). Call
        it between the commit and the next write transaction."""
        deadline = time.monotonic() + WAIT_S
        pause = 0.0002
        while (oldest := _oldest_reader(self._env)) <= snapshot:
            if oldest == self._stuck or time.monotonic() > deadline:
                if oldest != self._stuck:
                    log.warning("nvme tier: a reader holds snapshot %d; freed values not cleared", oldest)
                self._stuck = oldest
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        zero(spans)
        return True


def _oldest_reader(env: Any) -> float:
    """The oldest snapshot a read transaction holds now (inf: none)."""
    oldest = float("inf")
    for line in env.readers().splitlines()[1:]:
        txnid = line.rsplit(None, 1)[-1] if line.strip() else "-"
        if txnid.isdigit():
            oldest = min(oldest, int(txnid))
    return oldest
