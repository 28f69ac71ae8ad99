"""``kvstore bench tiers``' working set: the block sizes, a warm source and destination of each,
and the memcpy references every row's tier is measured against."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.keys import Fingerprint
from tiers import TierKey

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (256 * KiB, 2 * MiB, 32 * MiB)
FP = Fingerprint(b"\x42" * 32)
BATCH_BLOCKS = 64
COPY_ROUNDS = 10  # warm copies' rounds per round of the rest: each is short, the machine noisy


def aligned_zeros(size: int, align: int = 4096) -> np.ndarray:
    """``size`` zero bytes starting on an ``align`` boundary, as a restore's destinations do
    (torch's tensors, the client's receive pools, vLLM's pages): numpy's own start on any
    16-byte boundary, and a copy out of LMDB (its values start 16 bytes into a page) ran at
    24.5-25 GB/s into one at 32 or 48 bytes past a line and 29-30 into one at 0 or 16, which
    swung the nvme warm read's ratio between 0.87x and 1.08x by where numpy put the buffer."""
    raw = np.zeros(size + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + size]


class Working:
    """A warm source of ``count`` blocks of ``size`` bytes, and a warm destination block."""

    def __init__(self, size: int, total: int) -> None:
        self.size = size
        self.count = max(2, total // size)
        self.total = self.count * size
        self.src = np.random.default_rng(0).integers(0, 256, self.total, dtype=np.uint8)
        self.dst = aligned_zeros(size)
        self.big = np.zeros(self.total, dtype=np.uint8)
        self.src_view = memoryview(self.src.data)
        self.dst_view = memoryview(self.dst.data)
        self.keys = [TierKey(b"bench-%08d" % i) for i in range(self.count)]

    def block(self, i: int) -> memoryview:
        return self.src_view[i * self.size : (i + 1) * self.size]

    def memcpy(self, src: memoryview | None = None) -> float:
        """Every block of ``src`` (default: the working set) into one warm block buffer (what a
        restore does), by memoryview assignment: a memcpy with ~0.2 us of Python around it,
        where ``np.copyto`` of a fresh slice adds ~1 us a block."""
        src = self.src_view if src is None else src
        dst, size = self.dst_view, self.size
        start = time.perf_counter()
        for i in range(self.count):
            dst[:] = src[i * size : (i + 1) * size]
        return time.perf_counter() - start

    def memcpy_each(self, srcs: list[memoryview]) -> float:
        """Each of ``srcs`` into the warm block buffer, as ``memcpy`` does with its blocks."""
        dst = self.dst_view
        start = time.perf_counter()
        for src in srcs:
            dst[:] = src
        return time.perf_counter() - start

    def memcpy_spread(self) -> float:
        """Every block into its own place in a second warm buffer (what storing does)."""
        start = time.perf_counter()
        for i in range(self.count):
            part = slice(i * self.size, (i + 1) * self.size)
            np.copyto(self.big[part], self.src[part])
        return time.perf_counter() - start


def timed(fn: Callable[[], None], settle: Callable[[], None] | None = None) -> Callable[[], float]:
    """``fn`` made into a call that returns its seconds. ``settle`` (a device's synchronize) runs
    before the clock starts and again before it stops: work queued on the device is counted in
    the call that queued it, and only there."""

    def run() -> float:
        if settle is not None:
            settle()
        start = time.perf_counter()
        fn()
        if settle is not None:
            settle()
        return time.perf_counter() - start

    return run


def shmem_huge_pages() -> str:
    """The kernel's transparent-huge-page mode for shared memory (``never`` where it has none)."""
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().split()
    except OSError:
        return "unknown"
    return next((m.strip("[]") for m in modes if m.startswith("[")), "unknown")
