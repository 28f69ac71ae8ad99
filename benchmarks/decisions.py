"""``kvstore bench decisions``: is the connector's plan as fast as the better of restoring
everything and recomputing everything?

A sweep over prefix length x source tier (`dram`, `nvme`) x throttled tier bandwidth, on vLLM
CPU with the kvstore connector. For every case the same prompt (the shared prefix plus a fresh
64-token suffix) is timed three ways, each on its own engine process: policy "restore" (load
every hit block), "recompute" (load nothing), and "auto" (the cost model's plan, calibrated on
the throttled sidecar with ``kvstore bench calibrate``'s tier measurement and prefill curve).
Target: plan <= 1.05x the better of the two, in every case. For `nvme` the sidecar is
restarted before each timed restore, so the blocks are found on `nvme` only.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from rich.console import Console

from benchmarks.calibrate import BLOCK_SIZE, block_bytes_of, measure_prefill, measure_tiers
from benchmarks.common import Result, print_results, write_json
from benchmarks.service import ServerProcess
from engine_plugin.calibration import Calibration, fit_prefill

SUFFIX_TOKENS = 64


def _prompt(prefix_tokens: int, case: int, rep: int) -> list[int]:
    prefix = [(i * 7 + case * 131) % 400 + 3 for i in range(prefix_tokens)]
    suffix = [(i * 13 + rep * 17 + 1000) % 400 + 3 for i in range(SUFFIX_TOKENS)]
    return prefix + suffix


def run_decisions(model: str | None, quick: bool, json_path: str | None, plot_path: str | None) -> int:
    from benchmarks.tiny_model import build_tiny_llama
    from benchmarks.vllm_engine import Engine

    console = Console(stderr=True)
    folder = Path(tempfile.mkdtemp(prefix="kvdec-"))
    model_dir = Path(model) if model else build_tiny_llama(folder / "tiny-llama", seed=0)
    block_bytes = block_bytes_of(model_dir, BLOCK_SIZE)
    lengths = [512, 1536, 3008] if quick else [256, 512, 1024, 1536, 2048, 3008]
    throttles = [0, 20_000_000] if quick else [0, 100_000_000, 20_000_000, 5_000_000]
    reps = 3
    results: list[Result] = []
    curves: list[dict[str, object]] = []
    console.print("[dim]prefill curve …[/]")
    scratch = ServerProcess(arena_bytes=256 << 20)
    try:
        prefill = fit_prefill(measure_prefill(model_dir, scratch.unix, [128, 512, 1024, 2048, 3072], 1))
    finally:
        scratch.stop()
    for throttle in throttles:
        label = f"{throttle / 1e6:.0f} MB/s" if throttle else "unthrottled"
        console.print(f"[dim]tiers {label}: calibrating …[/]")
        settings = [f"dram.throttle_bytes_per_s={throttle}", f"nvme.throttle_bytes_per_s={throttle}"]
        tiers = measure_tiers(block_bytes, many=64, reps=2, settings=settings)
        calibration_path = folder / f"calibration-{throttle}.json"
        Calibration(tiers, prefill).save(calibration_path)
        server = ServerProcess(arena_bytes=512 << 20, settings=settings)
        engines = {
            policy: Engine(model_dir, server.unix, policy=policy, calibration=str(calibration_path))
            for policy in ("restore", "recompute", "auto")
        }
        try:
            for tier in ("dram", "nvme"):
                for length in lengths:
                    case = len(curves)
                    times: dict[str, list[float]] = {p: [] for p in engines}
                    loaded: list[int] = []
                    engines["recompute"].generate(
                        _prompt(length, case, 99), max_tokens=1
                    )  # stores the prefix
                    for rep in range(reps):
                        for index, (policy, engine) in enumerate(engines.items()):
                            if tier == "nvme" and policy != "recompute":
                                server.restart()
                            # A suffix of its own per policy and round: what one engine stored
                            # after its prefill must not become another one's hit.
                            out = engine.generate(_prompt(length, case, rep * 3 + index), max_tokens=1)
                            times[policy].append(float(out["seconds"]))
                            if policy == "auto":
                                loaded.append(int(out["cached"]))
                    med = {p: statistics.median(t) for p, t in times.items()}
                    better = min(med["restore"], med["recompute"])
                    name = f"plan, {length}-token prefix from {tier}, {label}"
                    results.append(
                        Result(
                            name,
                            med["auto"] * 1e3,
                            "ms",
                            "better of restore/recompute",
                            better * 1e3,
                            "<= 1.05",
                            f"restore {med['restore'] * 1e3:.1f} ms, recompute {med['recompute'] * 1e3:.1f} ms, "
                            f"plan loaded {statistics.median(loaded):.0f} tokens",
                        )
                    )
                    curves.append({"tier": tier, "throttle": throttle, "length": length, **med})
        finally:
            for engine in engines.values():
                engine.close()
            server.stop()
    print_results(f"kvstore bench decisions{' --quick' if quick else ''}", results)
    if json_path:
        write_json(json_path, results, {"command": "kvstore bench decisions", "curves": curves})
    if plot_path:
        _plot(curves, plot_path)
    return 0


def _plot(curves: list[dict[str, object]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(str(c["tier"]), int(str(c["throttle"]))) for c in curves})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (tier, throttle) in zip(axes[0], panels, strict=True):
        rows = sorted(
            (c for c in curves if c["tier"] == tier and c["throttle"] == throttle),
            key=lambda c: int(str(c["length"])),
        )
        xs = [int(str(c["length"])) for c in rows]
        for policy, style in (("restore", "--"), ("recompute", ":"), ("auto", "-")):
            ax.plot(xs, [float(str(c[policy])) * 1e3 for c in rows], style, marker="o", label=policy)
        ax.set_title(f"{tier}, {throttle / 1e6:.0f} MB/s" if throttle else f"{tier}, unthrottled")
        ax.set_xlabel("prefix tokens")
        ax.set_ylabel("time to first token (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
