"""``kvstore bench replay``'s run: each workload's requests through every configuration's engine in
turn, and kvstore's restore against vLLM's own prefix-cache hit."""

import shutil
import statistics
from pathlib import Path

from rich.console import Console

from benchmarks.calibrate import BLOCK_SIZE
from benchmarks.common import Result
from benchmarks.replay_setup import RESTORE_TARGET, Config, ReplaySpec, Served, fresh_tokens
from benchmarks.replay_traces import TraceRequest
from benchmarks.server_process import ServerProcess
from benchmarks.vllm_engine import Engine
from kvstore.client import connect


def replay_workload(
    workload: str,
    requests: list[TraceRequest],
    configs: list[Config],
    engines: dict[str, Engine],
    servers: dict[str, ServerProcess],
    folder: Path,
    console: Console,
) -> dict[str, Served]:
    for name, engine in engines.items():  # every workload starts from empty caches
        engine.reset_prefix_cache()
        if name in servers:
            with connect(servers[name].unix) as admin:
                admin.invalidate(everything=True)
    shutil.rmtree(folder / "example", ignore_errors=True)
    served = {c.name: Served() for c in configs}
    before = {name: _restored_by_tier(engines[name]) for name in servers}
    for i, request in enumerate(requests):
        turn = configs[i % len(configs) :] + configs[: i % len(configs)]
        for config in turn:
            out = engines[config.name].generate(
                list(request.tokens), salt=request.salt, max_tokens=request.max_tokens
            )
            s = served[config.name]
            s.prompt.append(len(request.tokens))
            s.cached.append(int(out["cached"]))
            s.ttft.append(float(out["ttft"]))
            s.seconds.append(float(out["seconds"]))
            s.generated.append(len(out["tokens"]))
        if (i + 1) % 10 == 0 or i + 1 == len(requests):
            rates = "  ".join(
                f"{c.name} {sum(served[c.name].cached) / max(1, sum(served[c.name].prompt)):.0%}"
                for c in configs
            )
            console.print(f"[dim]  {workload}: {i + 1}/{len(requests)} requests; token hit rate {rates}[/]")
    for name, server in servers.items():
        with connect(server.unix) as admin:
            served[name].held_bytes = sum(int(t["used_bytes"]) for t in admin.stats()["tiers"])
        after = _restored_by_tier(engines[name])
        served[name].restored_bytes = {t: after[t] - before[name].get(t, 0) for t in after}
    if "example" in served:
        served["example"].held_bytes = _folder_bytes(folder / "example")
    return served


def _restored_by_tier(engine: Engine) -> dict[str, int]:
    series = "kvstore_connector_restored_bytes_total{tier="
    return {k[len(series) : -1]: int(v) for k, v in engine.metrics().items() if k.startswith(series)}


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def restore_vs_local(
    engines: dict[str, Engine], spec: ReplaySpec, vocab: int, console: Console
) -> list[Result]:
    """Per round and engine (in turn, so noise hits both alike): a suffix after the prefix with
    vLLM holding it, then another after resetting vLLM's cache (kvstore restores the prefix);
    per engine, the median of its rounds' ratios. ``engines``: how each loads ("whole" first)."""
    console.print(f"[dim]restore vs vLLM's own hit, {spec.prefix_tokens}-token prefix …[/]")
    prefix = fresh_tokens(spec.prefix_tokens, 77, vocab)
    for engine in engines.values():
        for seed in range(2):  # a new engine warms up first: not measured
            engine.generate(fresh_tokens(256, 95_000 + seed, vocab), max_tokens=1)
        engine.generate(prefix + fresh_tokens(32, 1, vocab), max_tokens=1)  # computed once, stored in kvstore
    ratios: dict[str, list[float]] = {name: [] for name in engines}
    local_s: dict[str, list[float]] = {name: [] for name in engines}
    restored_s: dict[str, list[float]] = {name: [] for name in engines}
    cached: list[int] = []
    for r in range(spec.rounds):
        names = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in names:
            engine = engines[name]
            local = engine.generate(prefix + fresh_tokens(32, 100 + r, vocab), max_tokens=1)
            engine.reset_prefix_cache()
            restored = engine.generate(
                prefix + fresh_tokens(32, 200 + r, vocab), max_tokens=1, policy="restore"
            )
            cached.append(int(restored["cached"]))
            local_s[name].append(float(local["ttft"]))
            restored_s[name].append(float(restored["ttft"]))
            ratios[name].append(restored_s[name][-1] / local_s[name][-1])
    if min(cached) < spec.prefix_tokens - BLOCK_SIZE:
        return [
            Result(
                "restore TTFT vs vLLM's own hit",
                None,
                "ms",
                note=f"a restore missed: cached {min(cached)} tokens",
            )
        ]
    rows = []
    for name in engines:
        whole = name == "whole"
        rows.append(
            Result(
                f"restore TTFT vs vLLM's own hit, {spec.prefix_tokens} tokens"
                + ("" if whole else f" ({name} loads)"),
                statistics.median(ratios[name]),
                "x",
                "vLLM's prefix-cache hit",
                1.0,
                f"<= {RESTORE_TARGET}" if whole else None,
                f"median of {spec.rounds} paired rounds' ratios; medians: restore "
                f"{statistics.median(restored_s[name]) * 1e3:.1f} ms, vLLM's hit "
                f"{statistics.median(local_s[name]) * 1e3:.1f} ms"
                + ("" if whole else "; the connector's default loads whole blocks before the forward"),
            )
        )
    if "layer-wise" in engines:  # the A/B that sets layerwise_load's default
        pairs = [lw / w for lw, w in zip(restored_s["layer-wise"], restored_s["whole"], strict=True)]
        rows.append(
            Result(
                f"layer-wise restore TTFT vs whole-block restore, {spec.prefix_tokens} tokens",
                statistics.median(pairs),
                "x",
                "whole-block restore",
                1.0,
                None,
                f"median of {spec.rounds} rounds' ratios, the two engines alternating; per-round "
                f"ratios {', '.join(f'{p:.2f}' for p in pairs)}",
            )
        )
    return rows
