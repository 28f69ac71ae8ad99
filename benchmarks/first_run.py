"""The connector's first requests: its predicted time to first token against the measured one.

    python -m benchmarks.first_run [--out bench-results/decisions-first-run.txt]

A private sidecar, the tiny random model on vLLM CPU, and an engine that starts from the
connector's built-in calibration (no file, as a first run has none). The engine serves six cold
prompts of several sizes; then it restarts and a fresh one serves the same six, restored from
the sidecar. Per request: what the connector decided, the tokens it restored, its predicted and
measured ttft (its own figures: the growth of its Prometheus series over the request) and their
ratio. Each engine's first request is its warm-up (vLLM CPU's first forward pass, with or without
the connector), which no calibration predicts; the connector learns from the others.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_engine import Engine
from kvstore.cli.demo_engine import decision_lines
from kvstore.cost_model import DEFAULT_TIERS
from kvstore.server.config import load_settings
from kvstore.server.datadir import remove_shm_files
from kvstore.server.serve import RunningServer, start_server

LENGTHS = (1000, 400, 700, 200, 900, 500)  # prompt tokens, each prompt its own
DECISIONS = ("restore", "partial", "recompute")


def prompt(length: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed * 131) % 500 + 3 for i in range(length)]


def serve(engine: Engine, tokens: list[int]) -> dict[str, Any]:
    """One request: its output, the connector's log lines for it (``decision_lines``), the
    decisions it recorded, and the predicted and measured ttft of the one it made (the growth
    of the connector's Prometheus series over the request)."""
    log = Path(engine.log.name)
    seen = len(decision_lines(log))
    before = engine.metrics()
    out = engine.generate(tokens, max_tokens=1)
    after = engine.metrics()

    def grew(name: str, decision: str) -> float:
        key = f"{name}{{decision={decision}}}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    decided = [d for d in DECISIONS if grew("kvstore_connector_decisions_total", d) == 1]
    out["decisions"], out["lines"] = decided, decision_lines(log)[seen:]
    if len(decided) == 1:
        out["predicted"] = grew("kvstore_connector_predicted_ttft_seconds_sum", decided[0])
        out["measured"] = grew("kvstore_connector_actual_ttft_seconds_sum", decided[0])
    return out


def serve_all(engine: Engine, label: str) -> list[dict[str, object]]:
    """Each prompt once: the connector's decision and its figures for it."""
    rows: list[dict[str, object]] = []
    for index, length in enumerate(LENGTHS):
        out = serve(engine, prompt(length, index))
        predicted, measured = out.get("predicted", 0.0), out.get("measured", 0.0)
        rows.append(
            {
                "engine": label,
                "request": index + 1,
                "tokens": length,
                "decision": "/".join(out["decisions"]) or "none",
                "restored": int(out["cached"]),
                "predicted_ms": predicted * 1e3,
                "measured_ms": measured * 1e3,
                "ratio": measured / predicted if predicted else float("nan"),
            }
        )
    return rows


@contextlib.contextmanager
def first_run_sidecar() -> Iterator[tuple[RunningServer, Path]]:
    """A private sidecar (256 MiB of dram over 1 GiB of nvme, no metrics listener) and a
    scratch folder for the model and calibration files; both removed on leaving."""
    folder = Path(tempfile.mkdtemp(prefix="kvfirst-"))
    data_dir = tempfile.mkdtemp(prefix="kvfirst-sidecar-", dir="/tmp")
    settings = {
        "data_dir": data_dir,
        "dram.capacity_bytes": "256MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "1GiB",
        "server.metrics_address": "",
    }
    try:
        server = start_server(load_settings(env={}, overrides=settings))
        try:
            yield server, folder
        finally:
            server.stop()
    finally:
        remove_shm_files(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def run() -> tuple[list[dict[str, object]], tuple[float, float]]:
    """The rows, and the bytes and seconds of the restarted engine's restores from dram."""
    with first_run_sidecar() as (server, folder):
        model = build_tiny_llama(folder / "tiny", seed=0)
        rows: list[dict[str, object]] = []
        for label in ("first engine", "after a restart"):
            engine = Engine(model, server.unix_address)
            try:
                rows += serve_all(engine, label)
                metrics = engine.metrics()
            finally:
                engine.close()
        restored = metrics.get("kvstore_connector_restored_bytes_total{tier=dram}", 0.0)
        return rows, (restored, metrics.get("kvstore_connector_restore_seconds_sum{tier=dram}", 0.0))


def report(rows: list[dict[str, object]], restores: tuple[float, float], seconds: float) -> str:
    lines = [
        "benchmarks/first_run.py: the connector's predicted vs measured ttft, request by request,",
        "from its built-in calibration (no file), tiny random model on vLLM CPU",
        "",
        f"{'engine':16s} {'#':>2s} {'tokens':>6s} {'decision':>9s} {'restored':>8s} "
        f"{'predicted':>10s} {'measured':>10s} {'measured/predicted':>18s}",
    ]
    for r in rows:
        lines.append(
            f"{r['engine']!s:16s} {r['request']!s:>2s} {r['tokens']!s:>6s} {r['decision']!s:>9s} "
            f"{r['restored']!s:>8s} {float(str(r['predicted_ms'])):8.1f} ms {float(str(r['measured_ms'])):8.1f} ms "
            f"{float(str(r['ratio'])):17.2f}x"
        )
    later = [float(str(r["ratio"])) for r in rows if int(str(r["request"])) > 1]
    lines += [
        "",
        "request 1 of each engine is its warm-up (vLLM's first forward pass), which no calibration predicts",
        f"requests 2-{len(LENGTHS)} of both engines: median ratio {statistics.median(later):.2f}x, "
        f"range {min(later):.2f}x to {max(later):.2f}x",
        _restore_line(*restores, sum(r["decision"] == "restore" for r in rows)),
        f"{seconds:.0f} s in all",
    ]
    return "\n".join(lines) + "\n"


def _restore_line(nbytes: float, seconds: float, count: int) -> str:
    """The restores' measured load time against what the built-in dram cost predicts for it."""
    if not nbytes or not seconds:
        return "no restores from dram measured"
    dram = DEFAULT_TIERS["dram"]
    predicted = count * dram.latency_s + nbytes * dram.seconds_per_byte()
    return (
        f"restores from dram after the restart: {nbytes / 1e6:.1f} MB in {seconds * 1e3:.1f} ms "
        f"({nbytes / seconds / 1e9:.2f} GB/s); the built-in dram cost ({dram.bandwidth_bytes_per_s / 1e9:.0f} GB/s, "
        f"{dram.latency_s * 1e3:.1f} ms a restore) predicts {predicted * 1e3:.1f} ms: {seconds / predicted:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    start = time.monotonic()
    text = report(*run(), time.monotonic() - start)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
