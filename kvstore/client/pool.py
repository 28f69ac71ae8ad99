"""The receive pool: buffers a thread's ``Client.get`` receives blocks into, reused once free.

Fresh memory costs page faults on first touch (a 2 MiB block into a new buffer moves at a
third of the speed of one into warm memory), so ``get`` receives into buffers it has used
before. A buffer is reused only when nothing refers to it any more: not the view ``get``
returned, nor any slice, ``memoryview``, numpy array or tensor made from it (each holds a
reference to the buffer). A caller who keeps a block keeps its bytes: they are never
overwritten behind its back; the pool takes a fresh buffer instead. Dropping every reference
(or calling ``.release()`` on every view of it) gives the buffer back.

    pool = ReceivePool(capacity_bytes=512 << 20)
    pool.begin()                      # once per get: which pooled buffers are free now
    view = pool.take(size_bytes)      # a writable view of exactly size_bytes

``begin(expect=n)`` also makes the views of up to ``n`` free buffers of the size the last take
handed out, for ``take``/``take_many`` to hand out first: ``get`` calls it while it waits for
the server's first answer (a wait of 0.2-0.4 ms here), so that making ~0.1-0.3 us a view for each
block is not left for between its copies.

Whether a buffer is free is read from its reference count (CPython): the pool holds one
reference and every export of its memory holds another. ``capacity_bytes`` bounds what the pool
keeps, free or lent out; a take beyond it gets a plain buffer the pool forgets (0: pool
nothing). Not thread-safe: the client keeps one pool per thread.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

# getrefcount's own argument, the loop variable and the pool's list: the count of a free buffer
_FREE_REFS = 3


class ReceivePool:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be at least 0, not {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0  # of the buffers the pool keeps, free or lent out
        self._buffers: list[bytearray] = []
        self._free: dict[int, list[bytearray]] = {}  # by size, as of the last ``begin``
        self._ready: list[memoryview] = []  # views made ahead, of free buffers of ``_ready_size``
        self._ready_size = 0  # the size the last take handed out

    def begin(self, expect: int = 0) -> None:
        """Find the buffers free now; ``take`` hands them out until the next ``begin``.
        ``expect``: make the views of up to that many of them ahead (see the module docstring)."""
        # The last call's lists and views held references too: dropped first.
        self._ready = []
        free: dict[int, list[bytearray]] = {}
        self._free = free
        for buffer in self._buffers:
            if sys.getrefcount(buffer) == _FREE_REFS:
                free.setdefault(len(buffer), []).append(buffer)
        if expect > 0:
            self._ready = [memoryview(b) for b in _pop_last(free.get(self._ready_size, []), expect)]

    def take(self, size_bytes: int) -> memoryview:
        """A writable view of ``size_bytes`` bytes nobody else refers to: a free pooled buffer
        of that size, else a new one (pooled while ``capacity_bytes`` allows)."""
        if self._ready and size_bytes == self._ready_size:
            return self._ready.pop()
        self._ready_size = size_bytes
        same_size = self._free.get(size_bytes)
        if same_size:
            return memoryview(same_size.pop())
        buffer = bytearray(size_bytes)
        if self.held_bytes + size_bytes <= self.capacity_bytes:
            self._buffers.append(buffer)
            self.held_bytes += size_bytes
        return memoryview(buffer)

    def take_many(self, sizes: Sequence[int]) -> list[memoryview]:
        """``take`` of each size, in order; blocks of one size (the usual case) in one step."""
        if len(set(sizes)) != 1:
            return [self.take(size) for size in sizes]
        size, count = sizes[0], len(sizes)
        ready = _pop_last(self._ready, count) if size == self._ready_size else []
        count -= len(ready)
        self._ready_size = size
        reused = _pop_last(self._free.get(size, []), count)
        return [
            *ready,
            *(memoryview(b) for b in reused),
            *(self.take(size) for _ in range(count - len(reused))),
        ]

    def clear(self) -> None:
        """Forget every buffer (those lent out stay valid with whoever holds them)."""
        self._buffers.clear()
        self._free = {}
        self._ready = []
        self.held_bytes = 0


def _pop_last(items: list[T], n: int) -> list[T]:
    """The last ``n`` of ``items`` (all of them, if fewer), taken out of it."""
    first = max(0, len(items) - n)
    taken = items[first:]
    del items[first:]
    return taken
