"""The ``nvme`` tier's in-memory index: each block's header (``Entry``) and the byte counts
capacity is checked against. Rebuilt from the ``headers`` database at open; the tier's lock
guards it, and every method expects it held."""

from __future__ import annotations

from collections.abc import ItemsView

from tiers.base import BlockHeader, TierKey, bound_checksum
from tiers.nvme_stored import Entry


class NvmeIndex:
    """The blocks the tier holds, queued puts included, and what they count."""

    def __init__(self) -> None:
        self._entries: dict[TierKey, Entry] = {}
        self.checksum_failures = 0
        self.stored_total = 0  # bytes after the codec (and cipher): what capacity bounds
        self.payload_total = 0
        self._fingerprints: dict[bytes, bytes] = {}  # interned: few models, many blocks

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: TierKey) -> Entry | None:
        return self._entries.get(key)

    def items(self) -> ItemsView[TierKey, Entry]:
        return self._entries.items()

    def add(self, key: TierKey, header: BlockHeader) -> None:
        fingerprint = self._fingerprints.setdefault(header.fingerprint, header.fingerprint)
        # The index keeps the xxh3-64 the stored bytes must have under *this* key (the header's
        # is bound to the key it was written under), so every read path, C's included, compares
        # the bytes' plain hash: a header and payload moved under another key fail it.
        checksum = bound_checksum(key, header.checksum)
        self._entries[key] = Entry(
            fingerprint, header.payload_len, header.stored_len, header.meta, header.codec, checksum
        )
        self.stored_total += header.stored_len
        self.payload_total += header.payload_len

    def pop(self, key: TierKey) -> Entry | None:
        """Drop ``key`` and its bytes from the counts; its entry, None when it was absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.stored_total -= entry.stored_len
            self.payload_total -= entry.payload_len
        return entry

    def fits(self, key: TierKey, stored_len: int, capacity_bytes: int) -> bool:
        """Whether storing ``stored_len`` bytes under ``key`` (replacing its block) stays within
        ``capacity_bytes``."""
        old = self._entries.get(key)
        return self.stored_total - (old.stored_len if old else 0) + stored_len <= capacity_bytes

    def may_fit(self, size_bytes: int, compressed: bool, capacity_bytes: int) -> bool:
        """Whether a payload of ``size_bytes`` fits: exact without a codec; with one
        (``compressed``), its stored size estimated from the ratio of the blocks held (none
        held: no compression)."""
        ratio = self.stored_total / self.payload_total if self.payload_total else 1.0
        estimate = int(size_bytes * min(ratio, 1.0)) if compressed else size_bytes
        return self.stored_total + estimate <= capacity_bytes
