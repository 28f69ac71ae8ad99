"""Fixed-size slots carved from one pre-allocated region: the memory tiers' allocator.

The region is cut into pages. The first block of a given (4 KiB-aligned) size claims an
extent — as many contiguous pages as one slot of that size needs — and cuts it into equal
slots; later blocks of the same size take free slots from extents of their class. An extent
whose slots are all free goes back to the page pool, so a deployment that changes block size
does not strand memory. Nothing is allocated after start: the region is faulted in once and
reused, because fresh allocations run several times slower than copies into warm memory.
Not thread-safe: the tier that owns it (``tiers.slab``) holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from tiers.base import Slot

SLOT_ALIGN_BYTES = 4096


def slot_size_for(size_bytes: int) -> int:
    """The slot size class that holds a block of ``size_bytes``."""
    return max(SLOT_ALIGN_BYTES, -(-size_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES)


@dataclass
class _Extent:
    first_page: int
    pages: int
    slot_bytes: int
    free: list[int]
    used: int = 0


@dataclass
class _SizeClass:
    slot_bytes: int
    partial: dict[int, _Extent] = field(default_factory=dict)  # first_page -> extent with a free slot
    free_slots: int = 0  # in its extents, all told


def check_pool(capacity_bytes: int, page_bytes: int, section: str = "") -> None:
    """A pool's sizes hold at least one page of whole aligned slots. ``section`` ("dram.")
    names the settings the message speaks of: the memory tiers' configs check here at parse
    time, so a mistake is one line at start rather than a traceback from the allocator."""
    if page_bytes <= 0 or page_bytes % SLOT_ALIGN_BYTES:
        raise ValueError(
            f"{section}page_bytes must be a positive multiple of {SLOT_ALIGN_BYTES}, got {page_bytes}"
        )
    if capacity_bytes < page_bytes:
        raise ValueError(
            f"{section}capacity_bytes ({capacity_bytes} B) is smaller than one page "
            f"({section}page_bytes = {page_bytes} B): raise it or lower {section}page_bytes"
        )


class SlabAllocator:
    """Offsets of fixed-size slots inside a region of ``capacity_bytes``. Not thread-safe."""

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        check_pool(capacity_bytes, page_bytes)
        self.page_bytes = page_bytes
        self.pages = capacity_bytes // page_bytes
        self.capacity_bytes = self.pages * page_bytes
        self._owner: list[_Extent | None] = [None] * self.pages
        self._classes: dict[int, _SizeClass] = {}
        self._free_pages = self.pages  # owned by no extent
        self.used_slot_bytes = 0

    def _pages_for(self, slot_bytes: int) -> int:
        return -(-slot_bytes // self.page_bytes)

    def fits_ever(self, size_bytes: int) -> bool:
        return self._pages_for(slot_size_for(size_bytes)) <= self.pages

    def can_alloc(self, size_bytes: int) -> bool:
        slot_bytes = slot_size_for(size_bytes)
        cls = self._classes.get(slot_bytes)
        if cls is not None and cls.partial:
            return True
        return self._find_free_run(self._pages_for(slot_bytes)) is not None

    def alloc(self, size_bytes: int) -> Slot | None:
        """A free slot for ``size_bytes``, or None when the region has no room for it."""
        slot_bytes = slot_size_for(size_bytes)
        cls = self._class_of(slot_bytes)
        if not cls.partial and not self._new_extent(cls):
            return None
        extent = next(iter(cls.partial.values()))
        offset = extent.free.pop()
        extent.used += 1
        cls.free_slots -= 1
        if not extent.free:
            del cls.partial[extent.first_page]
        self.used_slot_bytes += slot_bytes
        return Slot(offset, size_bytes)

    def alloc_many(self, size_bytes: int, count: int) -> list[Slot]:
        """``count`` free slots for blocks of ``size_bytes``, each the one ``alloc`` would have
        given in turn; fewer when the region runs out of room. A run of slots is taken from an
        extent's free list in one slice (a chunk of a same-host write is one call)."""
        slot_bytes = slot_size_for(size_bytes)
        cls = self._class_of(slot_bytes)
        offsets: list[int] = []
        while len(offsets) < count:
            if not cls.partial and not self._new_extent(cls):
                break
            extent = next(iter(cls.partial.values()))
            free = extent.free
            take = min(count - len(offsets), len(free))
            offsets += reversed(free[len(free) - take :])  # the order pop() would give them in
            del free[len(free) - take :]
            extent.used += take
            if not free:
                del cls.partial[extent.first_page]
        cls.free_slots -= len(offsets)
        self.used_slot_bytes += slot_bytes * len(offsets)
        return [Slot(offset, size_bytes) for offset in offsets]

    def _class_of(self, slot_bytes: int) -> _SizeClass:
        cls = self._classes.get(slot_bytes)
        if cls is None:
            cls = self._classes[slot_bytes] = _SizeClass(slot_bytes)
        return cls

    def _new_extent(self, cls: _SizeClass) -> bool:
        """Claim free pages for one more extent of ``cls``; False when no run of them is free."""
        slot_bytes = cls.slot_bytes
        npages = self._pages_for(slot_bytes)
        first = self._find_free_run(npages)
        if first is None:
            return False
        start = first * self.page_bytes
        nslots = npages * self.page_bytes // slot_bytes
        extent = _Extent(first, npages, slot_bytes, [start + i * slot_bytes for i in reversed(range(nslots))])
        for page in range(first, first + npages):
            self._owner[page] = extent
        cls.partial[first] = extent
        cls.free_slots += nslots
        self._free_pages -= npages
        return True

    def free_slots(self, size_bytes: int, limit: int) -> int:
        """How many slots for ``size_bytes`` ``alloc_many`` would give now, counted up to
        ``limit`` (exact where one slot fits in a page: a slot of several pages needs a run of
        free pages, which is looked for only when the free slots of its class fall short)."""
        slot_bytes = slot_size_for(size_bytes)
        cls = self._classes.get(slot_bytes)
        count = 0 if cls is None else cls.free_slots
        if count >= limit:
            return limit
        npages = self._pages_for(slot_bytes)
        per_extent = npages * self.page_bytes // slot_bytes
        if npages == 1:
            return min(limit, count + self._free_pages * per_extent)
        for _ in self._free_runs(npages):
            count += per_extent
            if count >= limit:
                return limit
        return count

    def free(self, slot: Slot) -> None:
        extent = self._owner[slot.offset // self.page_bytes]
        if extent is None or extent.used <= 0:
            raise ValueError(f"slot at offset {slot.offset} is not allocated")
        cls = self._classes[extent.slot_bytes]
        extent.free.append(slot.offset)
        extent.used -= 1
        cls.free_slots += 1
        self.used_slot_bytes -= extent.slot_bytes
        if extent.used == 0:
            cls.partial.pop(extent.first_page, None)
            cls.free_slots -= len(extent.free)
            self._free_pages += extent.pages
            for page in range(extent.first_page, extent.first_page + extent.pages):
                self._owner[page] = None
        else:
            cls.partial[extent.first_page] = extent

    def _find_free_run(self, npages: int) -> int | None:
        return next(self._free_runs(npages), None)

    def _free_runs(self, npages: int) -> Iterator[int]:
        """The first page of each run of ``npages`` free pages, taken from the start as
        ``_find_free_run`` would claim them one after another."""
        run = 0
        for page, owner in enumerate(self._owner):
            run = run + 1 if owner is None else 0
            if run == npages:
                yield page - npages + 1
                run = 0
