"""Host buffers of whole stored blocks (arena slots, staging, ``bytes``), as the copiers see them.

A copy of many blocks runs faster where consecutive buffers lie evenly spaced in one writable
buffer (the arena's slots of one chain, a staging buffer): ``runs`` finds those runs, so that a
layer's slice of a whole run moves in one numpy copy (``Run.strided``), or a run of buffers that
lie end to end moves to a device in one copy (``tensor_runs``). Nothing here copies bytes; every
view and address is valid while the caller keeps the buffers alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Run:
    """Buffers ``first .. first + count`` of a copy. With a ``span`` (two or more buffers evenly
    spaced ``stride`` apart in one writable buffer, whatever their block ids), each layer's slice
    of the whole run is one numpy copy between a strided view of the buffer and the cache's rows,
    indexed by the block ids; otherwise one memmove per buffer."""

    first: int
    count: int
    span: np.ndarray | None = None  # uint8 over the buffer the run's buffers lie in
    offset: int = 0  # of the run's first buffer in ``span``
    stride: int = 0

    def strided(self, offset: int, size: int) -> np.ndarray:
        """``[count, size]``: bytes ``offset .. offset + size`` of each of the run's buffers."""
        assert self.span is not None
        start = self.offset + offset
        end = start + (self.count - 1) * self.stride + size
        if start < 0 or end > self.span.size:
            raise ValueError("a run of blocks reaches outside its buffer")
        return np.lib.stride_tricks.as_strided(
            self.span[start:end], (self.count, size), (self.stride, 1), writeable=True
        )


def runs(buffers: Sequence[Buffer], addresses: Sequence[int], size: int) -> list[Run]:
    """``buffers`` cut into runs (``Run``): a new run wherever the buffer or its spacing changes."""
    out: list[Run] = []
    spans: dict[int, tuple[np.ndarray, int]] = {}  # id(buffer's object) -> (span, address)
    i, n = 0, len(buffers)
    while i < n:
        j = i + 1
        first_owner = owner(buffers[i])
        stride = addresses[j] - addresses[i] if j < n else 0
        if first_owner is not None and stride >= size:
            while j < n and addresses[j] - addresses[j - 1] == stride and owner(buffers[j]) is first_owner:
                j += 1
        if j - i < 2 or first_owner is None:
            out.append(Run(i, 1))
            i += 1
            continue
        if id(first_owner) not in spans:
            whole = memoryview(cast(Buffer, first_owner)).cast("B")
            spans[id(first_owner)] = (np.frombuffer(whole, dtype=np.uint8), address(whole))
        span, base = spans[id(first_owner)]
        out.append(Run(i, j - i, span, addresses[i] - base, stride))
        i = j
    return out


def tensor_runs(buffers: Sequence[Buffer], size: int) -> list[tuple[int, int, torch.Tensor]]:
    """``(first, count, bytes)``: buffers ``first .. first + count`` as one host tensor, a run of
    buffers that lie end to end in one buffer (an arena's slots of one chain) or one buffer. The
    tensors are views, never copies: what a run of pinned slots is, its tensor is."""
    out = []
    for run in runs(buffers, [address(b) for b in buffers], size):
        if run.span is not None and run.stride == size:
            whole = run.span[run.offset : run.offset + run.count * size]
            out.append((run.first, run.count, torch.from_numpy(whole)))
        else:
            out.extend(
                (i, 1, torch.frombuffer(buffers[i], dtype=torch.uint8))
                for i in range(run.first, run.first + run.count)
            )
    return out


def owner(buffer: Buffer) -> object | None:
    """The writable object a buffer is a view of (an arena's mapping, a staging bytearray)."""
    view = memoryview(buffer)
    of = view.obj
    if view.readonly or of is None or isinstance(of, bytes):
        return None
    return of


def address(buffer: Buffer) -> int:
    """The address of a contiguous host buffer (read-only ones too); the caller keeps it alive."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("a block's buffer must be contiguous")
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
