"""`kvstore bench device`: without CUDA it says so and measures nothing; with CUDA (``gpu``) every
row has its figure and same-run reference, after the benchmark's own byte-for-byte checks of the
arena copies and of the connector's staged copy passed. (Figures are not asserted in tests.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_the_device_bench_says_so_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "device.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "device", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["value"], r["note"]) for r in rows] == [(None, "skipped: no CUDA device on this machine")]


@pytest.mark.gpu
def test_on_a_gpu_every_device_row_has_its_figure_and_reference() -> None:
    from benchmarks.device import bench_arena_copies, bench_connector, bench_hbm, bench_remote_restore

    rows = bench_arena_copies(2 << 20, 64 << 20, 2) + bench_connector(16, 2) + bench_hbm(2 << 20, 64 << 20, 2)
    rows.append(bench_remote_restore(8, 1))
    for row in rows:
        assert row.value is not None and row.value > 0, row
        assert row.reference_value is not None and row.reference_value > 0, row
