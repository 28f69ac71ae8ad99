"""The tier benchmark runs on tiny working sets and reports the shape every bench shares.
(Figures themselves are measured by `kvstore bench tiers`, not asserted in tests.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.common import Result, write_json
from benchmarks.tiers_cpu import bench_keys
from benchmarks.tiers_memory import COPY_OFFSETS, bench_copy_offsets, bench_dram
from benchmarks.tiers_nvme import bench_nvme
from benchmarks.tiers_working import Working

KEYS = {
    "metric",
    "value",
    "unit",
    "reference",
    "reference_value",
    "ratio",
    "target",
    "target_op",
    "target_ratio",
    "meets_target",
    "note",
}


def test_dram_and_nvme_rows_have_references_and_ratios(tmp_path: Path) -> None:
    w = Working(256 * 1024, 4 << 20)
    rows = bench_dram(w, rounds=1) + bench_nvme(w, rounds=1, folder=tmp_path)
    assert {r.metric.split()[0] for r in rows} == {"memcpy", "dram", "store", "nvme"}
    for r in rows:
        assert r.value is not None and r.value > 0
        assert r.reference_value is not None and r.reference_value > 0
        assert r.ratio == r.value / r.reference_value


def test_the_destination_block_starts_on_a_page_as_a_restores_do() -> None:
    for size in (1000, 256 * 1024, 2 << 20):
        w = Working(size, 4 << 20)
        assert np.frombuffer(w.dst_view, dtype=np.uint8).ctypes.data % 4096 == 0
        assert len(w.dst_view) == size and w.dst.flags.writeable


def test_json_shape(tmp_path: Path) -> None:
    rows = [bench_keys(rounds=1), Result("x", 1.0, "GB/s", "memcpy", 2.0, ">= 0.8")]
    write_json(tmp_path / "out.json", rows)
    doc = json.loads((tmp_path / "out.json").read_text())
    assert set(doc) >= {"machine", "results"}
    assert doc["machine"]["cores"] > 0
    for row in doc["results"]:
        assert set(row) == KEYS
    assert doc["results"][1]["ratio"] == 0.5
    assert rows[1].meets_target is False
    # the target as a number too, with its verdict
    assert (doc["results"][1]["target_op"], doc["results"][1]["target_ratio"]) == (">=", 0.8)
    assert doc["results"][1]["meets_target"] is False


def test_the_copy_offset_rows_name_each_offset_and_copy_right() -> None:
    rows = bench_copy_offsets(rounds=1, size=64 * 1024, count=8)
    assert [r.metric for r in rows] == [
        f"copy 64 KiB, destination {offset} B past a line" for offset in COPY_OFFSETS
    ]
    assert all(r.value and r.reference_value and r.target is None for r in rows)
