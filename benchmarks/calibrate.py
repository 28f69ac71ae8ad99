"""``kvstore bench calibrate``: measure what the cost model needs and write the calibration file.

On the real model and hardware:
- the engine's prefill curve: time to first token of prompts of several lengths on a vLLM CPU
  engine with the connector set to recompute (nothing loaded), fitted to
  fixed + per_token * s + per_token_context * s^2 / 2 (``engine_plugin.calibration.fit_prefill``);
- each tier's restore cost as the connector sees it: same-host restores of 1 and of many blocks
  of the model's block size through a private ``kvstore serve`` (blocks found in `nvme` right after
  a restart, then in `dram`), fitted to latency + bytes / bandwidth;
- the remote tier's, the same way: blocks held only by a shared kvstore server, restored through
  a sidecar whose ``[remote]`` tier is that server (each restore reads them through first).

The file is what ``kv_connector_extra_config["calibration"]`` loads; the connector keeps the tier
figures current online from the restores it performs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import Result, machine_info, print_results
from benchmarks.service_same_host import settle_mapping
from benchmarks.service_setup import TOKEN, bench_server
from benchmarks.vllm_engine import Engine
from engine_plugin.calibration import Calibration, fit_prefill
from kvstore.cost_model import TierCost
from kvstore.model_folder import block_bytes_of

SEED_TOKENS = 3
BLOCK_SIZE = 32  # tokens per block of the engine the benchmarks start


def _prompt(length: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 13) % 400 + SEED_TOKENS for i in range(length)]


def measure_prefill(model: Path, address: str, lengths: list[int], reps: int) -> list[tuple[int, int, float]]:
    engine = Engine(model, address, policy="recompute")
    try:
        engine.generate(_prompt(64, 0), max_tokens=1)  # warm-up
        return prefill_points(engine, lengths, reps)
    finally:
        engine.close()


def prefill_points(
    engine: Engine, lengths: Sequence[int], reps: int, seed: int = 0
) -> list[tuple[int, int, float]]:
    """(0, n, seconds): the median time to first token of cold prompts of each length over
    ``reps`` interleaved passes (one pass can land in a slow stretch of a shared machine), each
    request forced to recompute."""
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for rep in range(reps):
        for n in lengths:
            out = engine.generate(_prompt(n, 1000 * (rep + 1) + n + seed), max_tokens=1, policy="recompute")
            times[n].append(float(out["seconds"]))
    return [(0, n, statistics.median(times[n])) for n in lengths]


def _fit_line(sizes: list[int], seconds: list[float]) -> TierCost:
    """latency + bytes / bandwidth through the smallest and largest restore measured. When noise
    makes the larger one look no slower per byte, all of its time is charged to bandwidth."""
    small, large = sizes[0], sizes[-1]
    t_small, t_large = seconds[0], seconds[-1]
    if large > small and t_large > t_small:
        bandwidth = (large - small) / (t_large - t_small)
        latency = max(t_small - small / bandwidth, 0.0)
    else:
        bandwidth, latency = large / max(t_large, 1e-9), 0.0
    return TierCost(bandwidth_bytes_per_s=bandwidth, latency_s=latency)


def measure_tiers(
    block_bytes: int, many: int, reps: int, settings: Mapping[str, str] | None = None
) -> dict[str, TierCost]:
    """Same-host restore cost per tier through a private server, as the connector restores."""
    from kvstore.client import connect
    from kvstore.keys import Fingerprint, block_keys

    fp = Fingerprint(b"\xca" * 32)
    server = bench_server(arena_bytes=max(4 * many * block_bytes, 64 << 20) + (64 << 20), settings=settings)
    timings: dict[str, dict[int, list[float]]] = {"nvme": {}, "dram": {}}
    try:
        groups = []
        for rep in range(reps):
            for count in (1, many):
                keys = block_keys(
                    fp, list(range(rep * 100_000 + count * 1000, rep * 100_000 + count * 1000 + count)), 1
                )
                groups.append((count, keys))
        with connect(server.unix) as kv:
            for _, keys in groups:
                kv.write(fp, keys, [np.random.default_rng(len(keys)).bytes(block_bytes) for _ in keys])
        server.restart()  # every block now lives on nvme only
        with connect(server.unix) as kv:
            settle_mapping(kv)  # the restores timed below, not the mapping's first fill
            outs = [memoryview(bytearray(block_bytes)) for _ in range(many)]
            for tier in ("nvme", "dram"):  # first read promotes from nvme; the second finds dram
                for count, keys in groups:
                    start = time.perf_counter()
                    if kv.read_into(fp, keys, outs[:count]) != count:
                        raise RuntimeError("calibration blocks went missing")
                    timings[tier].setdefault(count * block_bytes, []).append(time.perf_counter() - start)
    finally:
        server.stop()
    costs = {}
    for tier, by_size in timings.items():
        sizes = sorted(by_size)
        costs[tier] = _fit_line(sizes, [statistics.median(by_size[s]) for s in sizes])
    return costs


def measure_remote(block_bytes: int, many: int, reps: int) -> TierCost:
    """Same-host restore cost of blocks only the fleet's remote tier holds: written to a shared
    kvstore server, restored through a sidecar over it (read through into its arena, then
    copied out), each group once, as a replica meets a prefix another one computed."""
    from kvstore.client import connect
    from kvstore.keys import Fingerprint, block_keys

    fp = Fingerprint(b"\xcb" * 32)
    arena = max(4 * many * block_bytes, 64 << 20) + (64 << 20)
    shared = bench_server(arena_bytes=arena)
    timings: dict[int, list[float]] = {}
    try:
        # the sidecar's Unix callers are tenant "local"; its remote files them under the
        # shared server's tenant of the bench token, where the blocks below are written
        remote = {
            "remote.backend": "kvstore",
            "remote.nodes": shared.tcp,
            "remote.tokens": f"t/local={TOKEN}",
        }
        sidecar = bench_server(arena_bytes=arena, settings=remote)
        try:
            groups = []
            for rep in range(reps):
                for count in (1, many):
                    first = rep * 100_000 + count * 1000
                    groups.append(block_keys(fp, list(range(first, first + count)), 1))
            with connect(shared.tcp, token=TOKEN) as kv:
                for keys in groups:
                    kv.put(fp, keys, [np.random.default_rng(len(keys)).bytes(block_bytes) for _ in keys])
            with connect(sidecar.unix) as kv:
                outs = [memoryview(bytearray(block_bytes)) for _ in range(many)]
                for keys in groups:
                    start = time.perf_counter()
                    if kv.read_into(fp, keys, outs[: len(keys)]) != len(keys):
                        raise RuntimeError("remote calibration blocks went missing")
                    timings.setdefault(len(keys) * block_bytes, []).append(time.perf_counter() - start)
        finally:
            sidecar.stop()
    finally:
        shared.stop()
    sizes = sorted(timings)
    return _fit_line(sizes, [statistics.median(timings[s]) for s in sizes])


def run_calibrate(model: str | None, out_path: str, quick: bool) -> int:
    from benchmarks.tiny_model import build_tiny_llama

    folder = Path(tempfile.mkdtemp(prefix="kvcal-"))
    model_dir = Path(model) if model else build_tiny_llama(folder / "tiny-llama", seed=0)
    block_bytes = block_bytes_of(model_dir, BLOCK_SIZE)
    lengths = [128, 512, 1024, 2048] if quick else [64, 128, 256, 512, 1024, 1536, 2048, 3072]
    reps = 3 if quick else 5
    server = bench_server(arena_bytes=256 << 20)
    try:
        points = measure_prefill(model_dir, server.unix, lengths, reps)
    finally:
        server.stop()
    prefill = fit_prefill(points)
    # Enough blocks that the large restore moves at least 32 MiB: bandwidth, not latency, shows.
    many = max(16, (32 << 20) // block_bytes)
    tiers = measure_tiers(block_bytes, many=many, reps=2 if quick else 4)
    tiers["remote"] = measure_remote(block_bytes, many=many, reps=2 if quick else 4)
    calibration = Calibration(tiers, prefill, points)
    calibration.save(
        out_path, {"model": str(model_dir), "block_bytes": block_bytes, "machine": machine_info()}
    )
    rows = [
        Result(
            f"prefill {s} tokens",
            t * 1e3,
            "ms",
            "fit",
            prefill.seconds(p, s) * 1e3,
            note="time to first token",
        )
        for p, s, t in points
    ]
    for name, cost in tiers.items():
        rows.append(
            Result(
                f"{name} restore bandwidth",
                cost.bandwidth_bytes_per_s / 1e9,
                "GB/s",
                note=f"latency {cost.latency_s * 1e3:.2f} ms, same-host, {block_bytes} B blocks"
                + (" held by a shared kvstore server" if name == "remote" else ""),
            )
        )
    print_results(f"kvstore bench calibrate -> {out_path}", rows)
    print(json.dumps({"wrote": out_path}))
    return 0
