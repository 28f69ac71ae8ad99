"""``kvstore bench tiers``: put and get throughput of each tier next to a reference from the same run.

For each block size (256 KiB, 2 MiB, 32 MiB) and a working set of ``total`` bytes:

- `dram` put / get against memcpy over the same working set, one block at a time into warm
  buffers (puts: numpy ``copyto``; gets: memoryview assignment, the leanest block copy Python
  has, and the one the tier makes). Gets copy out of the arena's slots, so their reference is
  the same memcpy out of those very slots, block for block: the ratio is then the tier's own
  work (index, lock, pins) and nothing else. A copy out of a second, separately made region of
  shared memory was the reference once; its speed differed by up to 15% from the arena's for
  the same bytes (four identical regions here copied at 18.5, 22.0, 22.2 and 22.2 GB/s: where
  the kernel placed their pages), which said more about placement luck than about the tier.
  The medium itself has its own row: memcpy out of ``/dev/shm`` against anonymous memory
  (numpy's buffers get transparent huge pages, shared memory here does not, per
  ``shmem_enabled``). The same get through the tiered store (index, lock, transient pin, one
  ``get_into_many`` call, the dram tier's batched copy) is reported beside it. Targets: get >=
  0.8x, store get >= 0.9x (DESIGN.md §7). Gets take ten times the rounds (``COPY_ROUNDS``): a
  round is ~10-20 ms of copying, the machine is shared, and nine rounds' medians of the same
  code swung 0.81-0.89x at 256 KiB from run to run.
- `nvme` write against raw LMDB with the best flags of the brief (writemap, map_async,
  sync=False, metasync=False, the same batch size per transaction), both ending with one
  ``env.sync``; cold and warm reads, 64 blocks a call through the tier's ``get_into_many`` (as
  the store reads), against raw LMDB zero-copy reads of the same 64 in one transaction
  (``buffers=True``, copied into the caller's buffer; its environment kept open across warm
  rounds, as the tier keeps its own). Targets: write >= 0.7x, cold read >= 0.8x, warm
  read >= 0.85x (the warm read has no medium to hide the tier's work behind). Warm reads take
  ten times the rounds, as the gets do (a round of 256 MiB is ~10 ms). Writes take
  three times the rounds: a virtual disk here alternates fast and slow writes (0.4-0.8 against
  1.5-1.8 GB/s, either writer), and three rounds' median said more of which writes met the slow
  ones than of the tier.
  Cold reads are not measured: dropping the page cache needs privileges CI lacks.
- `hbm` (CUDA only) host-to-device put and device-to-host get against ``torch`` copies of the
  same bytes between a pinned host tensor and device memory.
- Block keys per second for a 32k-token prompt, and the codecs' speed and ratio on bf16 data.
- SGLang HiCache's page restore into a layer-first host pool (64 pieces a 2 MiB page) through
  the backend's copy, against memcpy into one buffer a page, beside the copy it made before.
- The native block copy (``kv_copy``) against memcpy, 256 KiB blocks out of page-aligned slots
  into destinations 0, 8, 16, 32 and 48 bytes past a line (``bench_copy_offsets``).

Subject and reference are measured alternately, several rounds, medians reported, with the
garbage collector as ``kvstore serve`` runs it (``hold_full_collections``: young collections
only), since the tiers and the store run in that process: with CPython's default, full
collections over the bench's own objects landed in the tier's rounds more than in the
reference's (four runs each at 256 KiB: store get 0.855-0.889x, nvme warm read 0.849-0.853x;
with full collections held 0.893-0.957x and 0.859-0.894x).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from benchmarks.common import Result, print_results, size_label, write_json
from benchmarks.tiers_cpu import bench_codecs, bench_keys
from benchmarks.tiers_memory import bench_copy_offsets, bench_dram, bench_hbm, bench_sglang_pages
from benchmarks.tiers_nvme import bench_nvme, bench_nvme_encryption
from benchmarks.tiers_working import COPY_ROUNDS, SIZES, GiB, MiB, Working
from kvstore.server.serve import hold_full_collections


def run_tier_bench(quick: bool, json_path: str | None, data_dir: str | None) -> int:
    total = 256 * MiB if quick else 1 * GiB
    rounds = 3 if quick else 7
    console = Console(stderr=True)
    folder = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=data_dir and _mkdir(data_dir)))
    results: list[Result] = []
    thresholds = gc.get_threshold()
    hold_full_collections()  # the collector as in `kvstore serve`, where the tiers and store run
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("tiers", total=len(SIZES) * 3 + 4)
            for size in SIZES:
                w = Working(size, total)
                progress.update(task, description=f"dram {size_label(size)}")
                results += bench_dram(w, rounds)
                progress.advance(task)
                progress.update(task, description=f"nvme {size_label(size)}")
                results += bench_nvme(w, rounds, folder / f"nvme-{size}")
                if size == 2 * MiB:
                    results += bench_nvme_encryption(w, rounds, folder / "nvme-encrypted")
                progress.advance(task)
                results += bench_hbm(w, rounds)
                progress.advance(task)
            progress.update(task, description="keys")
            results.append(bench_keys(rounds))
            progress.advance(task)
            progress.update(task, description="codecs")
            results += bench_codecs()
            progress.advance(task)
            progress.update(task, description="sglang pages")
            results += bench_sglang_pages(rounds * 3)
            progress.advance(task)
            progress.update(task, description="copy offsets")
            results += bench_copy_offsets(COPY_ROUNDS * rounds)
            progress.advance(task)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        shutil.rmtree(folder, ignore_errors=True)
    print_results(f"kvstore bench tiers{' --quick' if quick else ''}", results)
    if json_path:
        write_json(json_path, results, {"command": f"kvstore bench tiers{' --quick' if quick else ''}"})
    return 0


def _mkdir(path: str) -> str:
    Path(path).mkdir(parents=True, exist_ok=True)
    return path
