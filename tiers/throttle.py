"""A tier that serves reads no faster than a given rate: a slower medium or link, emulated
for benchmarks (the decision sweep measures restores against recomputes at set bandwidths).

The builder wraps a tier in ``Throttled`` only when its ``throttle_bytes_per_s`` is set; nothing
else knows about throttling. Reads through ``get_into`` sleep ``bytes / rate`` after the copy;
reads a same-host client makes in place, through a mapped slot, cost the same, which the store
learns from ``in_place_read_s`` and waits out beside the reader, outside its lock. Everything
else passes through to the wrapped tier, which keeps its contract (including ``as_arena``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from tiers.base import BytesLike, InPlaceTier, StoredBlock, Tier, TierKey, TierUsage


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

    def put_nowait(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None:
        self.inner.put_nowait(key, payload, fingerprint, meta)

    def wait_for_queue_room(self, nbytes: int, timeout_s: float) -> bool:
        return self.inner.wait_for_queue_room(nbytes, timeout_s)

    @property
    def queue_capacity_bytes(self) -> int | None:
        return self.inner.queue_capacity_bytes

    def unwritten_mark(self, key: TierKey) -> int:
        return self.inner.unwritten_mark(key)

    def written_mark(self) -> int:
        return self.inner.written_mark()

    def wait_written(self, mark: int, timeout_s: float) -> bool:
        return self.inner.wait_written(mark, timeout_s)

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

    def in_place_read_s(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s
