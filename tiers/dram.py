"""The `dram` tier: one shared-memory arena of pinned host memory, cut into fixed-size slots.

The arena is a file in ``/dev/shm`` (mode 0600) created and faulted in once at start, so that
every later copy lands in warm memory. Another process on the same host maps it by name with
``Arena.attach`` and reads or writes block bytes in place: the service hands out slot offsets
(``reserve``/``commit``, ``locate``) and never copies the bytes itself. With CUDA present the
arena is registered as pinned memory so host-to-device copies from it run at DMA speed.

Lifetime: the tier that created the arena unlinks it on close(); an attached process keeps its
mapping until it closes its ``Arena``. Buffers returned by ``Arena.view`` are valid until that
``Arena`` is closed.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from dataclasses import dataclass

import numpy as np

from tiers import cuda
from tiers.base import BytesLike
from tiers.errors import TierUnavailable
from tiers.slab import SlabTier, Slot

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
OS_PAGE_BYTES = 4096


@dataclass(frozen=True)
class DramConfig:
    capacity_bytes: int = 1 << 30
    page_bytes: int = 32 << 20
    arena_name: str | None = None  # default: a fresh unique name per process
    prefault: bool = True
    pin_with_cuda: bool = True


class Arena:
    """A named shared-memory mapping. Create it once (the owner) or attach to it by name."""

    def __init__(self, name: str, size_bytes: int, mapping: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self._mmap = mapping
        self._owner = owner
        self.view = memoryview(mapping)
        self.array = np.frombuffer(mapping, dtype=np.uint8)

    @staticmethod
    def path_of(name: str) -> str:
        if not name or "/" in name:
            raise ValueError(f"bad arena name {name!r}")
        return os.path.join(SHM_DIR, name)

    @classmethod
    def create(cls, name: str, size_bytes: int, prefault: bool = True) -> Arena:
        path = cls.path_of(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            mapping = mmap.mmap(fd, size_bytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise TierUnavailable(f"cannot create a {size_bytes} B arena at {path}: {exc}") from exc
        os.close(fd)
        arena = cls(name, size_bytes, mapping, owner=True)
        if prefault:
            # Touch one byte per OS page: the kernel backs the whole arena now, not mid-restore.
            arena.array[::OS_PAGE_BYTES] = 0
        return arena

    @classmethod
    def attach(cls, name: str) -> Arena:
        """Map an existing arena created by another process."""
        path = cls.path_of(name)
        fd = os.open(path, os.O_RDWR)
        try:
            size_bytes = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        return cls(name, size_bytes, mapping, owner=False)

    def close(self) -> None:
        self.view.release()
        del self.array
        try:
            self._mmap.close()
        except BufferError:
            # A numpy view handed out by slot_array() is still alive; the mapping goes with it.
            log.debug("arena %s still has live views at close", self.name)
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path_of(self.name))


class DramTier(SlabTier):
    """Slots in a shared-memory arena. See the module docstring."""

    name = "dram"

    def __init__(self, config: DramConfig) -> None:
        super().__init__(config.capacity_bytes, config.page_bytes)
        arena_name = config.arena_name or f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        self.arena = Arena.create(arena_name, self._alloc.capacity_bytes, prefault=config.prefault)
        self._pinned_address: int | None = None
        if config.pin_with_cuda and cuda.cuda_available():
            address = cuda.buffer_address(self.arena._mmap)
            if cuda.pin_host_memory(address, self.arena.size_bytes):
                self._pinned_address = address
        log.info(
            "dram arena %s: %d B, %s",
            arena_name,
            self.arena.size_bytes,
            "pinned with CUDA" if self._pinned_address else "not pinned (no CUDA)",
        )

    @property
    def pinned(self) -> bool:
        return self._pinned_address is not None

    def slot_view(self, slot: Slot) -> memoryview:
        """The arena bytes of ``slot``; valid until the tier closes or the slot is freed."""
        return self.arena.view[slot.offset : slot.offset + slot.size_bytes]

    def _write(self, slot: Slot, payload: BytesLike) -> None:
        self.arena.view[slot.offset : slot.offset + slot.size_bytes] = payload

    def _read(self, slot: Slot, out: memoryview) -> None:
        out[: slot.size_bytes] = self.arena.view[slot.offset : slot.offset + slot.size_bytes]

    def _release_region(self) -> None:
        if self._pinned_address is not None:
            cuda.unpin_host_memory(self._pinned_address)
        self.arena.close()
