"""Errors raised by the storage tiers.

    TierError
    ├── TierFull          no room for the block without evicting something first
    │   └── TierBusy      its write queue is full (the medium is behind) and the caller would not wait
    ├── SlotBusy          another writer holds a reserved slot for the same key
    ├── BlockTooLarge     the block can never fit this tier (larger than a slot page or the tier)
    ├── TierClosed        the tier was used after close()
    ├── TierUnavailable   the medium cannot be used here (no CUDA for `hbm`)
    │   ├── ArenaNoRoom   the shared-memory folder has less room than the arena needs
    │   └── MediumNoRoom  a full or read-only file system cannot even open the tier
    └── TierCorrupt       the medium itself is unreadable (not one bad block: that is a miss)

A checksum mismatch on one block is not an error: the tier deletes the block, counts it and
reports a miss, so callers recompute instead of failing.
"""


class TierError(Exception):
    """Base of every error a tier raises."""


class TierFull(TierError):
    """The tier has no free space for this block right now; evict, then retry."""


class TierBusy(TierFull):
    """``put_nowait``: the tier's write queue is full right now (its medium is behind)."""


class SlotBusy(TierError):
    """Another writer has reserved this key and not committed yet."""


class BlockTooLarge(TierError):
    """The block is larger than anything this tier can ever hold."""


class TierClosed(TierError):
    """The tier was used after close()."""


class TierUnavailable(TierError):
    """The tier's medium is not present on this machine."""


class ArenaNoRoom(TierUnavailable):
    """The shared-memory folder cannot hold an arena of ``needed_bytes``."""

    def __init__(self, folder: str, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(
            f"the dram arena needs {_mib(needed_bytes)} in {folder}, which has {_mib(free_bytes)} free"
        )
        self.folder = folder
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class MediumNoRoom(TierUnavailable):
    """A full or read-only file system: the tier cannot be created or opened at all (a tier
    that opens there runs with writes off instead)."""


class TierCorrupt(TierError):
    """The tier's medium could not be opened or read as a whole."""


def _mib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"
