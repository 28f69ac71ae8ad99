"""The `dram` tier: one shared-memory arena of pinned host memory, cut into fixed-size slots.

The arena is a file in ``/dev/shm`` (mode 0600) created and faulted in once at start, so that
every later copy lands in warm memory. Another process on the same host maps it by name with
``Arena.attach`` and reads or writes block bytes in place: the service hands out slot offsets
(``reserve``/``commit``, ``locate``) and never copies the bytes itself.

Lifetime: the tier that created the arena unlinks it on close(); an attached process keeps its
mapping until it closes its ``Arena``. A process killed before close() leaves the file behind.
A named arena (the service names one per data folder) is reclaimed by whoever names it, after
salvaging its blocks. An unnamed one (``Arena.create_unnamed``: a tier without a data folder, a
benchmark's reference buffer) holds nothing to salvage: its owner keeps an exclusive ``flock`` on
the file for as long as it lives, the kernel drops that lock however the process ends, and every
``create`` first removes the unnamed arenas whose lock it can take (``sweep_unnamed``), so a
killed process's arena is gone at the next start instead of filling ``/dev/shm``.

Pinning is per process: CUDA registers a process's mapping, not the file, so the server's
registration does nothing for an engine that attached the same arena. Each process that copies
between the arena and a GPU calls ``Arena.pin_with_cuda`` on its own mapping (the tier does for
the server's when the hbm tier copies to and from it, and only then by default: registering
opens a CUDA context and pins every page, ~1 s per 4 GiB; a client does for an engine whose
caches are on a GPU, and that is the mapping an engine's restores copy out of); ``close``
unregisters it before unmapping. Before creating
the file, ``create`` checks that ``/dev/shm`` has room (``ArenaNoRoom`` otherwise) and reserves
the pages with ``posix_fallocate``, so a full ``/dev/shm`` is an error at start, never a SIGBUS
while faulting in or later mid-copy. Buffers returned by ``Arena.view`` are valid until that
``Arena`` is closed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tiers import cuda
from tiers.base import BytesLike, Slot, TierKey
from tiers.dram_hasher import Hashed, Hasher
from tiers.errors import ArenaNoRoom, TierUnavailable
from tiers.journal import Journal, JournalRecord, records_in, replay
from tiers.slab import SlabEntry, SlabTier
from tiers.slab_alloc import check_pool

try:
    from tiers import _gather  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the copies run in Python, block by block
    _gather = None

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
OS_PAGE_BYTES = 4096
UNNAMED_PREFIX = "kvstore-tmp-"  # unnamed arenas: kvstore-tmp-<pid>-<random>
UNNAMED_GRACE_S = 60.0  # younger files are left alone: their owner may not hold its lock yet
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fill a mapping's page tables without touching its bytes
POPULATE_STEP_BYTES = 64 << 20  # one madvise call of the background populate


@dataclass(frozen=True)
class DramConfig:
    """The shared-memory arena in /dev/shm that same-host engines map and copy blocks in and out of."""

    # Size of the arena, checked against /dev/shm's free room at start
    capacity_bytes: int = 1 << 30
    page_bytes: int = 32 << 20  # the arena's page; the largest block must fit in one run of pages
    prefault: bool = True  # touch every page at start, so restores land in warm memory
    # Register the server's mapping with CUDA as pinned memory: "auto" only when the hbm tier is
    # on (its copies are the server's only ones to and from a GPU; an engine registers its own
    # mapping, which is what its restores copy from), so the server touches no GPU otherwise
    pin_with_cuda: Literal["auto", "on", "off"] = "auto"
    journal: bool = True  # record committed slots so a killed server's blocks are salvaged
    throttle_bytes_per_s: int = 0  # benchmarks only: emulate a slower tier; 0 = off

    def __post_init__(self) -> None:
        check_pool(self.capacity_bytes, self.page_bytes, "dram.")


class Arena:
    """A named shared-memory mapping. Create it once (the owner) or attach to it by name."""

    def __init__(
        self, name: str, size_bytes: int, mapping: mmap.mmap, owner: bool, lock_fd: int | None = None
    ) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self._mmap = mapping
        self._owner = owner
        self._lock_fd = lock_fd  # an unnamed arena's file, locked while its owner lives
        self.view = memoryview(mapping)
        self.array = np.frombuffer(mapping, dtype=np.uint8)
        self._populating: threading.Thread | None = None
        self._stop_populating = threading.Event()
        self._pinned_address: int | None = None  # registered with CUDA in this process
        self._pin_refused = False

    @property
    def pinned(self) -> bool:
        return self._pinned_address is not None

    def pin_with_cuda(self) -> bool:
        """Register this process's mapping as pinned memory with CUDA (once); whether it is.

        Copies between a registered mapping and a GPU are DMA at the link's speed and
        asynchronous (the caller synchronizes before the bytes are used or the slot is let go);
        out of an unregistered one the driver stages them through a bounce buffer of its own,
        slower and synchronous. False without CUDA or when the driver refuses (asked once a
        mapping): copies still work, staged. Registering pins every page of the mapping: ~1 s
        for 4 GiB on an H200 host (`kvstore bench device`)."""
        if self._pinned_address is None and not self._pin_refused and cuda.cuda_available():
            address = self.array.ctypes.data
            if cuda.pin_host_memory(address, self.size_bytes):
                self._pinned_address = address
            else:  # asked once a mapping: a refusal is logged once, not at every restore
                self._pin_refused = True
        return self._pinned_address is not None

    def populate_in_background(self) -> None:
        """Fill this process's page tables for the whole mapping on a thread, a step at a time
        with the GIL released (libc ``madvise(MADV_POPULATE_WRITE)``): a process that maps an
        arena another one created takes a page fault per 4 KiB on its first copy into each page
        otherwise, about 3x slower than a copy into a mapped page. Does nothing where the call
        is missing (not Linux, a kernel before 5.14); ``close`` stops it first."""
        madvise = _libc_madvise()
        if madvise is None or self._populating is not None:
            return
        base = self.array.ctypes.data

        def run() -> None:
            for start in range(0, self.size_bytes, POPULATE_STEP_BYTES):
                if self._stop_populating.is_set():
                    return
                length = min(POPULATE_STEP_BYTES, self.size_bytes - start)
                if madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) != 0:
                    log.debug(
                        "populating arena %s: errno %d; left to page faults", self.name, ctypes.get_errno()
                    )
                    return

        self._populating = threading.Thread(target=run, name=f"populate-{self.name}", daemon=True)
        self._populating.start()

    def wait_populated(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: no limit) for the background populate to end; whether
        it has (True too where none ran). It keeps a CPU busy for ~0.2 s a GiB here: a
        benchmark that times copies waits for it, so that it does not share their CPUs."""
        thread = self._populating
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    @staticmethod
    def path_of(name: str) -> str:
        if not name or "/" in name:
            raise ValueError(f"bad arena name {name!r}")
        return os.path.join(SHM_DIR, name)

    @classmethod
    def create_unnamed(cls, size_bytes: int, prefault: bool = True) -> Arena:
        """An arena nobody will look for by name after its owner is gone: removed by the next
        ``create`` on this host once its owner has died (see the module docstring)."""
        name = f"{UNNAMED_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        return cls.create(name, size_bytes, prefault)

    @classmethod
    def create(cls, name: str, size_bytes: int, prefault: bool = True) -> Arena:
        path = cls.path_of(name)
        locked = name.startswith(UNNAMED_PREFIX)  # a sweeper removes any such file it can lock
        sweep_unnamed()  # a dead process's arena must not count against this one's room
        try:
            free_bytes = shutil.disk_usage(SHM_DIR).free
        except OSError as exc:
            raise TierUnavailable(f"{SHM_DIR} is not usable for the arena: {exc}") from exc
        if free_bytes < size_bytes:
            raise ArenaNoRoom(SHM_DIR, size_bytes, free_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
            os.ftruncate(fd, size_bytes)
            if prefault:
                # tmpfs backs the pages now: no room is ENOSPC here instead of a SIGBUS later.
                os.posix_fallocate(fd, 0, size_bytes)
            mapping = mmap.mmap(fd, size_bytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            if exc.errno == errno.ENOSPC:
                raise ArenaNoRoom(SHM_DIR, size_bytes, shutil.disk_usage(SHM_DIR).free) from exc
            raise TierUnavailable(f"cannot create a {size_bytes} B arena at {path}: {exc}") from exc
        if not locked:
            os.close(fd)
        arena = cls(name, size_bytes, mapping, owner=True, lock_fd=fd if locked else None)
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
            stat = os.fstat(fd)
            size_bytes = stat.st_size
            mapping = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        arena = cls(name, size_bytes, mapping, owner=False)
        if stat.st_blocks * 512 >= size_bytes:  # backed already: populating allocates nothing
            arena.populate_in_background()
        return arena

    def close(self) -> None:
        if self._populating is not None:  # never unmap under a madvise of the mapping
            self._stop_populating.set()
            self._populating.join()
        if self._pinned_address is not None:  # never unmap memory CUDA still has registered
            cuda.unpin_host_memory(self._pinned_address)
            self._pinned_address = None
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # after the unlink: a sweeper never sees it unlocked
            self._lock_fd = None


_MADVISE: list[object] = []  # the libc function once looked up (None: not available)


def _libc_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not _MADVISE:
        found = None
        name = ctypes.util.find_library("c")
        if name and os.uname().sysname == "Linux":
            try:
                found = ctypes.CDLL(name, use_errno=True).madvise  # CDLL calls release the GIL
                found.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                found.restype = ctypes.c_int
            except (OSError, AttributeError):
                found = None
        _MADVISE.append(found)
    return _MADVISE[0]  # type: ignore[return-value]


def sweep_unnamed(now: float | None = None) -> list[str]:
    """Remove the unnamed arenas (and journals) whose owners have died; the names removed.

    An owner holds an exclusive ``flock`` on its arena until it closes or dies; a file whose lock
    this call can take has no live owner. Files changed in the last ``UNNAMED_GRACE_S`` seconds
    are skipped: their owner may be between creating the file and locking it."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(UNNAMED_PREFIX) and "." not in n]
    except OSError:
        return []
    now = time.time() if now is None else now
    removed = []
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            dead = now - os.fstat(fd).st_ctime >= UNNAMED_GRACE_S
            if dead:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            dead = False  # its owner is alive (or it is not a plain file we may lock)
        if not dead:
            os.close(fd)
            continue
        try:
            for victim in (path, path + JOURNAL_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(victim)
        except OSError as exc:
            log.warning("cannot remove arena %s left behind by a dead process: %s", path, exc)
            continue
        finally:
            os.close(fd)
        removed.append(name)
        log.warning("removed arena %s left behind by a kvstore process that died", path)
    return removed


class DramTier(SlabTier):
    """Slots in a shared-memory arena. See the module docstring."""

    name = "dram"

    def __init__(self, config: DramConfig, arena_name: str | None = None, gpu_copies: bool = False) -> None:
        """``arena_name``: the data folder's arena, journaled (``config.journal``) so a dead
        server's blocks can be salvaged; None: an unnamed one (kvstore-tmp-<pid>-<random>), swept
        once its owner is dead, with nothing to salvage. ``gpu_copies``: a tier in this process
        copies between the arena and a GPU (hbm), which is when ``pin_with_cuda = "auto"`` pins."""
        super().__init__(config.capacity_bytes, config.page_bytes)
        self.config = config
        capacity = self._alloc.capacity_bytes
        journaled = config.journal and bool(arena_name)
        if arena_name:
            self.arena = Arena.create(arena_name, capacity, prefault=config.prefault)
        else:
            self.arena = Arena.create_unnamed(capacity, prefault=config.prefault)
        arena_name = self.arena.name
        if config.pin_with_cuda == "on" or (config.pin_with_cuda == "auto" and gpu_copies):
            self.arena.pin_with_cuda()
        self._journal = Journal(Arena.path_of(arena_name) + JOURNAL_SUFFIX) if journaled else None
        self._hasher = Hasher(self.slot_view, self._take_checksums)  # blocks committed without one
        log.info(
            "dram arena %s: %d B, %s",
            arena_name,
            self.arena.size_bytes,
            "pinned with CUDA" if self.arena.pinned else "not pinned",
        )

    @property
    def pinned(self) -> bool:
        return self.arena.pinned

    def as_arena(self) -> DramTier:
        return self

    def slot_view(self, slot: Slot) -> memoryview:
        """The arena bytes of ``slot``; valid until the tier closes or the slot is freed."""
        return self.arena.view[slot.offset : slot.offset + slot.size_bytes]

    def _write(self, slot: Slot, payload: BytesLike) -> int | None:
        if _gather is None:  # built without a C compiler: the hasher takes the checksum after
            self.arena.view[slot.offset : slot.offset + slot.size_bytes] = payload
            return None
        # One pass without the GIL, hashing on the way (tiers/native/hashed_copy.h): a block the
        # server copies in (a promotion, a read-through, a salvage) carries its checksum from
        # its commit, and the hasher never reads it again
        digest: int = _gather.scatter_hashed(self.arena.view, [slot.offset], [slot.size_bytes], [payload])[0]
        return digest

    def _read(self, slot: Slot, out: memoryview) -> None:
        offset, size = slot.offset, slot.size_bytes
        if _gather is None:
            out[:size] = self.arena.view[offset : offset + size]
            return
        _gather.gather(self.arena.view, [offset], [size], [out])

    def _read_many(self, slots: list[Slot], outs: list[memoryview]) -> None:
        if _gather is None:  # built without a C compiler
            super()._read_many(slots, outs)
            return
        _gather.gather(self.arena.view, [s.offset for s in slots], [s.size_bytes for s in slots], outs)

    def _committed(self, published: Sequence[tuple[TierKey, SlabEntry]]) -> None:
        self._hasher.add(published)
        if self._journal is None:
            return
        self._journal.commit_many(
            [
                (e.slot.offset, e.slot.size_bytes, bytes(k), e.fingerprint, e.meta, e.checksum)
                for k, e in published
            ]
        )
        if self._journal.needs_compaction:
            self._journal.rewrite(
                JournalRecord(e.slot.offset, e.slot.size_bytes, bytes(k), e.fingerprint, e.meta, e.checksum)
                for k, e in (
                    *published,
                    *self._entries.items(),
                    *((k, e) for k, e, _ in self._retired.values()),
                )
            )

    def _take_checksums(self, hashed: Hashed) -> None:
        """The hasher's checksums, kept for the blocks still where it hashed them, and journaled."""
        with self._lock:
            if self._closed:
                return
            entries = self._entries
            sums: list[tuple[int, bytes, int]] = []
            for key, entry, digest in hashed:
                if entries.get(key) is entry and entry.checksum is None:
                    entry.checksum = digest
                    sums.append((entry.slot.offset, bytes(key), digest))
            if sums and self._journal is not None:
                self._journal.summed_many(sums)

    def _freeing(self, slot: Slot, batched: bool) -> None:
        if self._journal is not None:
            self._journal.free(slot.offset, later=batched)

    def _handing_out(self) -> None:
        if self._journal is not None:
            self._journal.write_frees()

    def _release_region(self) -> None:
        self._hasher.close()  # before the arena goes: it may be reading a slot
        if self._journal is not None:
            self._journal.close(remove=True)
        self.arena.close()


JOURNAL_SUFFIX = ".journal"


@contextlib.contextmanager
def salvage(name: str) -> Iterator[list[tuple[JournalRecord, memoryview]]]:
    """The committed blocks of a dead server's arena ``name``: each journal record with a view
    of its bytes, valid inside the ``with``. Nothing when the arena or its journal is gone."""
    path = Arena.path_of(name)
    live = replay(path + JOURNAL_SUFFIX)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield []
        return
    try:
        size_bytes = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size_bytes, prot=mmap.PROT_READ) if size_bytes else None
    finally:
        os.close(fd)
    if mapping is None:
        yield []
        return
    view = memoryview(mapping)
    items = [(r, view[r.offset : r.offset + r.size_bytes]) for r in records_in(live, size_bytes)]
    try:
        yield items
    finally:
        for _, item in items:
            item.release()
        view.release()
        mapping.close()
