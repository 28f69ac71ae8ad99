"""A tier that serves reads no faster than a given rate: a slower medium or link, emulated
for benchmarks (the decision sweep measures restores against recomputes at set bandwidths).

The builder wraps a tier in ``Throttled`` only when its ``throttle_bytes_per_s`` is set. Reads
through ``get_into`` sleep ``bytes / rate`` after the copy. Reads a same-host client makes in
place, through a mapped slot, pass the tier by and cost the same: the store asks ``throttle_of``
each tier once, and waits ``in_place_read_s`` out beside the reader, outside its lock. Everything
else passes through to the wrapped tier, which keeps its contract (``as_arena`` and
``write_queue`` included).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from tiers.base import BytesLike, InPlaceTier, StoredBlock, Tier, TierKey, TierUsage, WriteQueue


class Throttled(Tier):
    """``inner`` with reads limited to ``bytes_per_s``. Thread rules and errors: the inner tier's."""

    def __init__(self, inner: Tier, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a throttle needs a positive rate, got {bytes_per_s}")
        self.inner = inner
        self.name = inner.name
        self.persistent = inner.persistent
        self.bytes_per_s = bytes_per_s

    def can_store(self, size_bytes: int) -> bool:
        return self.inner.can_store(size_bytes)

    def put(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None:
        self.inner.put(key, payload, fingerprint, meta)

    def get_into(self, key: TierKey, out: memoryview) -> int | None:
        n = self.inner.get_into(key, out)
        if n:
            time.sleep(n / self.bytes_per_s)
        return n

    def size_of(self, key: TierKey) -> int | None:
        return self.inner.size_of(key)

    def delete(self, key: TierKey) -> bool:
        return self.inner.delete(key)

    def scan(self) -> Iterator[StoredBlock]:
        return self.inner.scan()

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def as_arena(self) -> InPlaceTier | None:
        return self.inner.as_arena()

    def write_queue(self) -> WriteQueue | None:
        return self.inner.write_queue()  # writes are not throttled

    def in_place_read_s(self, nbytes: int) -> float:
        """Seconds a read of ``nbytes`` made in place (through a mapped slot) costs beyond the
        reader's own copy: what ``get_into`` would have slept."""
        return nbytes / self.bytes_per_s


def throttle_of(tier: Tier) -> Throttled | None:
    """``tier``'s throttle, or None when its reads are not throttled: the store asks once, and a
    reader in place waits out ``in_place_read_s`` beside its copy."""
    return tier if isinstance(tier, Throttled) else None
