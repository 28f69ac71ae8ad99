"""The full-collection row of `kvstore bench service` on a small index: the pause it reports is
a collection that walks the index, and the freeze leaves it nothing to walk."""

from __future__ import annotations

import gc

from benchmarks.gc_pause import bench_gc_pause, full_collection_pauses


def test_the_freeze_leaves_a_full_collection_less_to_walk() -> None:
    frozen_before = gc.get_freeze_count()
    unfrozen_s, frozen_s = full_collection_pauses(5000)
    assert 0 <= frozen_s < unfrozen_s
    assert gc.get_freeze_count() == frozen_before  # this process's collector as it was
    (row,) = bench_gc_pause(2000)
    assert row.unit == "ms" and row.value is not None and row.value > 0
