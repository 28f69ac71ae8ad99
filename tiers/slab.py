"""The tier logic shared by the memory tiers (`dram`, `hbm`): blocks in fixed-size slots of one
pre-allocated region, placed by ``tiers.slab_alloc``.

Two-phase writes: ``reserve`` takes a slot that readers cannot see, the caller fills it (in
this process, or in another one that mapped the same region), ``commit`` publishes it and
frees the slot of any older block under the same key; ``abort`` gives the slot back.

Checksums: a block's entry keeps the xxh3-64 of its bytes once someone took it: the writer that
copied the bytes in, through its commit (``commit_many``'s ``checksums``: the server's copy of a
remote put, a same-host client's copy), or for a block committed without one (a GPU's DMA copy)
the dram tier's hasher just after the commit (``tiers.dram_hasher``), or else the first copy
that leaves the process (``verified_checksum``). ``verified_checksum`` checks a block against it before
its bytes leave; a mismatch is counted in ``usage().checksum_failures``, as is each block a
salvage of this arena's predecessor found changed since its commit (``count_checksum_failures``;
the arena journal records a checksum taken by the commit, ``tiers.journal``).

Threads: one lock guards the allocator and the index; byte copies run outside it. The caller
(the tiered store) guarantees that a key is not deleted while a copy out of its slot runs.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import threading
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from tiers.base import (
    BytesLike,
    Slot,
    StoredBlock,
    Tier,
    TierKey,
    TierUsage,
    check_fingerprint,
    check_key,
    check_meta,
)
from tiers.errors import BlockTooLarge, SlotBusy, TierClosed, TierFull
from tiers.slab_alloc import SlabAllocator

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SlabEntry:
    slot: Slot
    fingerprint: bytes
    meta: bytes
    committed: bool
    checksum: int | None = None  # xxh3-64 of the slot's bytes; None until taken (module docstring)


class SlabTier(Tier):
    """A memory tier over a ``SlabAllocator``; subclasses supply the region and the copies.

    Adds the two-phase calls (``reserve``/``commit``/``abort``) and ``locate`` used by the
    same-host data plane, where another process writes or reads the slot bytes in place.
    """

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        self._alloc = SlabAllocator(capacity_bytes, page_bytes)
        self._lock = threading.Lock()
        self._entries: dict[TierKey, SlabEntry] = {}
        self._pending: dict[TierKey, SlabEntry] = {}
        self._used_bytes = 0
        self._closed = False
        self._batching = 0  # frees_batched() contexts open
        # Retired slots (``retire``): by offset, the key, entry and mark of the block that left,
        # and a heap of (mark, offset) that ``settle`` frees them in (an entry whose slot was
        # freed otherwise since, and perhaps retired again under another mark, is skipped).
        self._retired: dict[int, tuple[TierKey, SlabEntry, int]] = {}
        self._retiring: list[tuple[int, int]] = []
        self._retired_keys: dict[TierKey, int] = {}  # how many slots each key has retired
        self._checksum_failures = 0

    # Subclasses: move bytes in and out of the region. Called without the lock held.
    @abstractmethod
    def _write(self, slot: Slot, payload: BytesLike) -> int | None:
        """``payload`` into ``slot``; its xxh3-64 where the copy took it on the way, else None."""

    @abstractmethod
    def _read(self, slot: Slot, out: memoryview) -> None: ...

    def _read_many(self, slots: list[Slot], outs: list[memoryview]) -> None:
        """Each slot into its buffer (checked large enough); ValueError before any copy otherwise."""
        for slot, out in zip(slots, outs, strict=True):
            if len(out) < slot.size_bytes:
                raise ValueError(f"buffer of {len(out)} B is smaller than the {slot.size_bytes} B block")
        for slot, out in zip(slots, outs, strict=True):
            self._read(slot, out)

    def _release_region(self) -> None:
        """Free the region itself; called once by close()."""

    # Subclasses may record what the region holds (the dram arena's journal). Called with the
    # lock held: ``_committed`` (each key with its entry) before the blocks are visible,
    # ``_freeing`` when a slot is freed (``batched``: inside frees_batched(), where the record
    # may wait), ``_handing_out`` before a slot is handed out (what waits is written then, as at
    # the end of the batch: a freed slot is never handed out before its free is recorded).
    def _committed(self, published: Sequence[tuple[TierKey, SlabEntry]]) -> None:
        return

    def _freeing(self, slot: Slot, batched: bool) -> None:
        return

    def _handing_out(self) -> None:
        return

    @contextlib.contextmanager
    def frees_batched(self) -> Iterator[None]:
        with self._lock:
            self._batching += 1
        try:
            yield
        finally:
            with self._lock:
                self._batching -= 1
                self._handing_out()

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosed(f"{self.name} tier is closed")

    def can_store(self, size_bytes: int) -> bool:
        with self._lock:
            return self._alloc.can_alloc(size_bytes)

    def room_for(self, size_bytes: int, count: int) -> int:
        """How many blocks of ``size_bytes`` ``reserve_many`` would find a slot for now, counted
        up to ``count``."""
        with self._lock:
            return self._alloc.free_slots(size_bytes, count)

    def reserve(self, key: TierKey, size_bytes: int, fingerprint: bytes, meta: bytes = b"") -> Slot:
        """Take a slot for a new block under ``key``; invisible to readers until commit()."""
        check_key(key)
        check_fingerprint(fingerprint)
        check_meta(meta)
        with self._lock:
            self._check_open()
            return self._reserve_locked(key, size_bytes, bytes(fingerprint), bytes(meta))

    def reserve_many(self, items: Sequence[tuple[TierKey, int]], fingerprint: bytes) -> list[Slot | None]:
        """``reserve`` of each (key, size), in order, under one taking of the lock: a slot for
        each, None for a key with a reserved slot already or a block larger than the tier. It
        stops at the first block the tier has no room for, so the answer is shorter than
        ``items`` when the tier filled up: make room, then ask again for the rest."""
        check_fingerprint(fingerprint)
        for key, _ in items:
            check_key(key)
        fp = bytes(fingerprint)
        alloc = self._alloc
        with self._lock:
            self._check_open()
            pending = self._pending
            # The items to give a slot: not reserved already (nor twice in this call), not
            # larger than the tier; None for the others.
            wanted: list[int] = []
            seen: set[TierKey] = set()
            fits: dict[int, bool] = {}
            for i, (key, size_bytes) in enumerate(items):
                if key in pending or key in seen:
                    continue
                fit = fits.get(size_bytes)
                if fit is None:
                    fit = fits[size_bytes] = alloc.fits_ever(size_bytes)
                if fit:
                    wanted.append(i)
                    seen.add(key)
            slots: list[Slot | None] = [None] * len(items)
            end = len(items)  # cut at the first wanted item the tier has no room for
            run = 0
            while run < len(wanted):  # runs of equal sizes, a slice of slots each
                size_bytes = items[wanted[run]][1]
                run_end = run + 1
                while run_end < len(wanted) and items[wanted[run_end]][1] == size_bytes:
                    run_end += 1
                taken = alloc.alloc_many(size_bytes, run_end - run)
                for i, slot in zip(wanted[run:run_end], taken, strict=False):
                    slots[i] = slot
                    pending[items[i][0]] = SlabEntry(slot, fp, b"", False)
                if len(taken) < run_end - run:
                    end = wanted[run + len(taken)]
                    break
                run = run_end
            self._handing_out()
        return slots[:end]

    def _reserve_locked(self, key: TierKey, size_bytes: int, fingerprint: bytes, meta: bytes) -> Slot:
        if key in self._pending:
            raise SlotBusy(f"{self.name}: key {key.hex()} already has a reserved slot")
        slot = self._alloc.alloc(size_bytes)
        if slot is None:
            if not self._alloc.fits_ever(size_bytes):
                raise BlockTooLarge(
                    f"{size_bytes} B block exceeds the {self.name} tier ({self._alloc.capacity_bytes} B)"
                )
            raise TierFull(f"{self.name} tier has no free {size_bytes} B slot")
        self._pending[key] = SlabEntry(slot, fingerprint, meta, committed=False)
        self._handing_out()
        return slot

    def commit(self, key: TierKey, meta: bytes | None = None) -> None:
        """Publish the reserved slot of ``key`` (with ``meta`` if given, else the reserved
        one); an older block under the key is freed."""
        self.commit_many([(key, meta)])

    def commit_many(
        self, items: Sequence[tuple[TierKey, bytes | None]], checksums: Sequence[int | None] | None = None
    ) -> None:
        """``commit`` of each (key, meta), under one taking of the lock and with one record of
        them all (``_committed``); KeyError, committing none, when a key has no reserved slot.
        ``checksums``: the writer's xxh3-64 of each item's bytes (None: none taken)."""
        for _, meta in items:
            if meta is not None:
                check_meta(meta)
        with self._lock:
            pending, entries = self._pending, self._entries
            for key, _ in items:
                if key not in pending:
                    raise KeyError(f"{self.name}: no reserved slot for key {key.hex()}")
            published: list[tuple[TierKey, SlabEntry]] = []
            for i, (key, meta) in enumerate(items):
                entry = pending.pop(key)
                entry.committed = True
                if checksums is not None and checksums[i] is not None:
                    entry.checksum = checksums[i]
                if meta is not None:
                    entry.meta = bytes(meta)
                if key in entries:
                    self._forget(entries.pop(key))
                published.append((key, entry))
            self._committed(published)
            entries.update(published)
            self._used_bytes += sum(entry.slot.size_bytes for _, entry in published)

    def abort(self, key: TierKey) -> bool:
        """Give back the reserved slot of ``key``; whether there was one."""
        with self._lock:
            entry = self._pending.pop(key, None)
            if entry is None:
                return False
            self._alloc.free(entry.slot)
            return True

    def verified_checksum(self, key: TierKey, slot: Slot, view: memoryview) -> int | None:
        """Before ``view`` (the bytes of ``slot``, where the caller found the committed block of
        ``key`` and keeps it from being freed) leaves the process: their xxh3-64 when they are
        the block's (sent with them, for the receiver to check). A block without a checksum yet
        takes it now, from these bytes. None (counted) when they differ: the caller deletes the
        block through its store, which owns the index. A block that is no longer ``key``'s
        current one (deleted, or replaced, while the caller held it) is not judged."""
        digest = xxhash.xxh3_64_intdigest(view)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.slot != slot:
                return digest
            if entry.checksum is None:
                entry.checksum = digest
            if entry.checksum == digest:
                return digest
            self._checksum_failures += 1
        log.warning("%s tier: block %s changed since it was checksummed", self.name, key.hex())
        return None

    def count_checksum_failures(self, n: int) -> None:
        """Blocks found changed outside this tier's own checks (the salvage of the arena a
        killed predecessor left), counted with its own failures."""
        with self._lock:
            self._checksum_failures += n

    def locate(self, key: TierKey) -> Slot | None:
        """Where the committed block of ``key`` lives, or None for a miss."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.slot

    def locate_many(self, keys: Sequence[TierKey]) -> list[Slot | None]:
        """``locate`` of each key, under one taking of the lock."""
        with self._lock:
            entries = self._entries
            return [None if (entry := entries.get(key)) is None else entry.slot for key in keys]

    def put(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None:
        slot = self.reserve(key, len(payload), fingerprint, meta)
        try:
            checksum = self._write(slot, payload)
        except BaseException:
            self.abort(key)
            raise
        self.commit_many([(key, None)], [checksum])

    def get_into(self, key: TierKey, out: memoryview) -> int | None:
        with self._lock:  # locate() inline: this runs once per block of every restore
            entry = self._entries.get(key)
        if entry is None:
            return None
        slot = entry.slot
        if len(out) < slot.size_bytes:
            raise ValueError(f"buffer of {len(out)} B is smaller than the {slot.size_bytes} B block")
        self._read(slot, out)
        return slot.size_bytes

    def get_into_many(
        self, keys: Sequence[TierKey], outs: Sequence[memoryview], sizes: list[int | None]
    ) -> None:
        """One taking of the lock for the whole restore, then the copies (``_read_many``)."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        with self._lock:
            entries = self._entries
            found = [None if (entry := entries.get(key)) is None else entry.slot for key in keys]
        # A miss among them: the hits still copy, in one batch. (``all``, not ``None in``: that
        # calls each Slot's dataclass __eq__, ~0.15 us a block of a restore.)
        if not all(found):
            at = [i for i, slot in enumerate(found) if slot is not None]
            if at:  # none: a closed tier's region must not be touched (it misses every key)
                self._read_many([found[i] for i in at], [outs[i] for i in at])  # type: ignore[misc]
            sizes.extend(None if slot is None else slot.size_bytes for slot in found)
            return
        slots: list[Slot] = found  # type: ignore[assignment]
        self._read_many(slots, list(outs))
        sizes.extend([slot.size_bytes for slot in slots])

    def size_of(self, key: TierKey) -> int | None:
        slot = self.locate(key)
        return None if slot is None else slot.size_bytes

    def delete(self, key: TierKey) -> bool:
        """The block goes; so does a slot retired under ``key`` (the block deleted everywhere:
        a crash must not bring it back by salvage)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return key in self._retired_keys and self._unretire_locked(key)
            self._forget(entry)
            return True

    def _unretire_locked(self, key: TierKey) -> bool:
        offsets = [offset for offset, (k, _, _) in self._retired.items() if k == key]
        for offset in offsets:  # its heap entry is skipped by ``settle``
            self._free_retired_locked(offset, self._batching > 0)
        return bool(offsets)

    def _free_retired_locked(self, offset: int, batched: bool) -> None:
        key, entry, _ = self._retired.pop(offset)
        left = self._retired_keys.pop(key) - 1
        if left:
            self._retired_keys[key] = left
        self._freeing(entry.slot, batched)
        self._alloc.free(entry.slot)

    def retire(self, key: TierKey, mark: int) -> bool:
        """``delete``, but the slot stays taken, and recorded as holding the block, until
        ``settle`` reaches ``mark``: the block's copy in the tier below is still queued there,
        and until it is written a crash must find the bytes here (see ``InPlaceTier``)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._used_bytes -= entry.slot.size_bytes
            self._retired[entry.slot.offset] = (key, entry, mark)
            self._retired_keys[key] = self._retired_keys.get(key, 0) + 1
            heapq.heappush(self._retiring, (mark, entry.slot.offset))
            return True

    def settle(self, mark: int) -> int:
        """Free the retired slots whose mark is at most ``mark``; how many. Their free records
        wait for the next slot handed out, as an eviction pass's do."""
        with self._lock:
            freed = 0
            retiring = self._retiring
            while retiring and retiring[0][0] <= mark:
                due, offset = heapq.heappop(retiring)
                retired = self._retired.get(offset)
                if retired is not None and retired[2] == due:  # else deleted since (``delete``)
                    self._free_retired_locked(offset, True)
                    freed += 1
            return freed

    def retiring_mark(self, nbytes: int) -> int:
        """The smallest mark whose ``settle`` frees ``nbytes`` of retired slots, or all of
        them if fewer retire; 0 when none do."""
        with self._lock:
            for mark, offset in sorted(self._retiring):
                retired = self._retired.get(offset)
                if retired is not None and retired[2] == mark:
                    nbytes -= retired[1].slot.size_bytes
                if nbytes <= 0:
                    return mark
            return max(self._retiring)[0] if self._retiring else 0

    def _forget(self, entry: SlabEntry) -> None:
        self._used_bytes -= entry.slot.size_bytes
        self._freeing(entry.slot, self._batching > 0)
        self._alloc.free(entry.slot)

    def scan(self) -> Iterator[StoredBlock]:
        with self._lock:
            blocks = [
                StoredBlock(k, e.fingerprint, e.slot.size_bytes, e.meta) for k, e in self._entries.items()
            ]
        return iter(blocks)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                name=self.name,
                capacity_bytes=self._alloc.capacity_bytes,
                used_bytes=self._used_bytes,
                blocks=len(self._entries),
                checksum_failures=self._checksum_failures,
                stored_bytes=self._alloc.used_slot_bytes,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._pending.clear()
            self._retired.clear()
            self._retiring.clear()
            self._retired_keys.clear()
        self._release_region()
