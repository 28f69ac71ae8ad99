"""The contract every tier keeps (tiers/base.py), run against each of them."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tier_factories import ALL_TIERS, PAGE, TierFactory, read
from tiers import BlockTooLarge, Tier, TierClosed, TierFull, TierKey

FP = b"\x01" * 32
FP2 = b"\x02" * 32


def key(i: int) -> TierKey:
    return TierKey(b"block-%06d" % i)


def payload(i: int, size: int) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


@pytest.fixture(params=ALL_TIERS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    factory: TierFactory = request.param
    t = factory(tmp_path, 8 * PAGE)
    yield t
    t.close()


def test_put_then_get_returns_the_same_bytes(tier: Tier) -> None:
    data = os.urandom(300_000)
    tier.put(key(1), data, FP)
    assert read(tier, key(1)) == data
    assert tier.size_of(key(1)) == len(data)


def test_put_copies_the_callers_buffer(tier: Tier) -> None:
    buf = bytearray(payload(1, 50_000))
    tier.put(key(1), memoryview(buf), FP)
    buf[:] = b"\xff" * len(buf)
    assert read(tier, key(1)) == payload(1, 50_000)


def test_missing_key_is_a_miss(tier: Tier) -> None:
    assert tier.size_of(key(9)) is None
    assert tier.get_into(key(9), memoryview(bytearray(16))) is None
    assert tier.delete(key(9)) is False


def test_overwrite_replaces_and_delete_removes(tier: Tier) -> None:
    tier.put(key(1), payload(1, 10_000), FP)
    tier.put(key(1), payload(2, 20_000), FP)
    assert read(tier, key(1)) == payload(2, 20_000)
    assert tier.usage().blocks == 1
    assert tier.usage().used_bytes == 20_000
    assert tier.delete(key(1)) is True
    assert read(tier, key(1)) is None
    assert tier.usage().blocks == 0
    assert tier.usage().used_bytes == 0


def test_empty_block_round_trips(tier: Tier) -> None:
    tier.put(key(1), b"", FP)
    assert read(tier, key(1)) == b""


def test_scan_reports_keys_fingerprints_and_sizes(tier: Tier) -> None:
    tier.put(key(1), payload(1, 1000), FP)
    tier.put(key(2), payload(2, 2000), FP2)
    found = {(b.key, b.fingerprint, b.size_bytes) for b in tier.scan()}
    assert found == {(key(1), FP, 1000), (key(2), FP2, 2000)}


def test_full_tier_raises_tier_full_and_keeps_what_it_has(tier: Tier) -> None:
    block = PAGE  # one page each: the tier holds 8
    stored = 0
    with pytest.raises(TierFull):
        for i in range(100):
            tier.put(key(i), payload(i, block), FP)
            stored += 1
    assert 1 <= stored < 100
    assert not tier.can_store(block)
    for i in range(stored):
        assert read(tier, key(i)) == payload(i, block)
    tier.delete(key(0))
    assert tier.can_store(block)


def test_block_larger_than_the_tier_is_refused(tier: Tier) -> None:
    with pytest.raises((BlockTooLarge, TierFull)):
        tier.put(key(1), b"x" * (9 * PAGE), FP)
    assert tier.usage().blocks == 0


def test_small_output_buffer_is_refused(tier: Tier) -> None:
    tier.put(key(1), payload(1, 1000), FP)
    with pytest.raises(ValueError):
        tier.get_into(key(1), memoryview(bytearray(10)))


def test_bad_keys_and_fingerprints_are_refused(tier: Tier) -> None:
    with pytest.raises(ValueError):
        tier.put(TierKey(b""), b"x", FP)
    with pytest.raises(ValueError):
        tier.put(TierKey(b"k" * 512), b"x", FP)
    with pytest.raises(ValueError):
        tier.put(key(1), b"x", b"short")


def test_closed_tier_refuses_calls(tier: Tier) -> None:
    tier.close()
    with pytest.raises(TierClosed):
        tier.put(key(1), b"x", FP)
    tier.close()  # closing twice is harmless


def test_concurrent_puts_and_gets_from_many_threads(tier: Tier) -> None:
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(base, base + 20):
                tier.put(key(i), payload(i, 20_000 + i), FP)
            for i in range(base, base + 20):
                assert read(tier, key(i)) == payload(i, 20_000 + i)
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n * 100,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert tier.usage().blocks == 80


def test_get_into_many_copies_hits_and_reports_misses_in_order(tier: Tier) -> None:
    sizes_in = [10_000, 0, 70_000]
    for i, size in enumerate(sizes_in):
        tier.put(key(i), payload(i, size), FP)
    keys = [key(0), key(9), key(1), key(2)]  # key(9) was never stored
    bufs = [bytearray(80_000) for _ in keys]
    sizes: list[int | None] = []
    tier.get_into_many(keys, [memoryview(b) for b in bufs], sizes)
    assert sizes == [10_000, None, 0, 70_000]
    assert bytes(bufs[0][:10_000]) == payload(0, 10_000)
    assert bytes(bufs[1]) == bytes(80_000)  # a miss leaves its buffer alone
    assert bytes(bufs[3][:70_000]) == payload(2, 70_000)


def test_a_write_queue_marks_a_put_written_once_the_medium_holds_it(tier: Tier) -> None:
    """What the store's retired arena slots are settled by (``tiers.base.WriteQueue``): a queued
    put is readable at once, and once the tier has flushed it the written mark has passed the
    put's mark and nothing of the key is queued. A tier whose put is done when it returns
    offers no queue, and then none of this applies."""
    queue = tier.write_queue()
    if queue is None:
        return
    assert queue.queue_capacity_bytes > 0
    assert queue.wait_for_queue_room(1000, 0.0)  # an empty queue has room without a wait
    data = payload(1, 100_000)
    queue.put_nowait(key(1), data, FP)
    mark = queue.unwritten_mark(key(1))  # 0 if the writer was quicker than this line
    assert read(tier, key(1)) == data  # read-your-writes, queued or not
    tier.flush()
    assert queue.written_mark() >= mark and queue.wait_written(mark, 10.0)
    assert queue.unwritten_mark(key(1)) == 0
