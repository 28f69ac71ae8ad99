"""The full-collection row of `kvstore bench service` on a small index: the pause it reports is
a collection that walks the index, and the freeze leaves it nothing to walk."""

from __future__ import annotations

import gc

from benchmarks.gc_pause import bench_gc_pause


def test_the_freeze_leaves_a_full_collection_less_to_walk() -> None:
    frozen_before = gc.get_freeze_count()
    (row,) = bench_gc_pause(5000)
    assert row.unit == "ms" and row.value is not None and row.reference_value is not None
    assert row.value > row.reference_value  # the same collection, with the index frozen: shorter
    assert gc.get_freeze_count() == frozen_before  # this process's collector as it was
