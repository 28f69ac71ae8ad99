"""``kvstore bench replay``: a trace through the real vLLM CPU engine, with and without kvstore,
next to what a user would run instead.

Configurations, all with the same engine settings (the ``small`` random Llama unless ``--model``,
bf16, 32-token blocks, vLLM's own prefix cache on, a KV pool of ``pool_tokens`` tokens: small
enough that the trace's working set does not fit and vLLM evicts):

- ``vllm``: vLLM alone.
- ``kvstore-dram``: vLLM + the kvstore connector, its sidecar's dram arena holding the trace.
- ``kvstore-nvme``: the same with an arena of one 32 MiB page, so most restores read from nvme
  (the share each tier served is in the JSON: the connector's restored bytes by tier).
- ``example``: vLLM + its ``ExampleConnector`` (safetensors files per prompt).
- ``--peers`` also starts every other KV connector vLLM ships that could offload on this machine
  and reports which start and, for each that does not, the error it gave.

Every configuration's engine runs at once, one request at a time across them: each request of the
trace goes to each engine in turn (the order rotating), so a slow stretch of this shared machine
hits every configuration alike, and the figures of one request are paired across them.

Per workload and configuration: token hit rate (prompt tokens the engine did not compute: vLLM's
prefix cache or the connector), the distribution of hit lengths, prefill tokens saved, time to
first token (vLLM's own first-token latency of the request) at p50/p95/p99 over hits (at least
half of the prompt cached) and misses separately, requests/s and tokens/s while serving
(prompt and generated tokens over the sum of the requests' times: one request at a time), and
TTFT saved per GB-hour of cache: the cold prefill time of each prompt (a curve fitted to cold
prefills measured in the same run) minus its measured time to first token, summed, over the
cache's bytes (vLLM's pool plus what the connector's store held at the end) times the time
serving.

Also: kvstore's restore against vLLM's own prefix-cache hit on the same prompt (``prefix_tokens``
tokens, a fresh suffix each time): in the ``kvstore-dram`` engine, the prompt's prefix is served
by vLLM's cache in one request and, after ``reset_prefix_cache``, restored from kvstore in the
next (forced to restore), round after round; the figure is the median of the per-round ratios.

Paired: over the requests where a kvstore engine found at least a block more of the prompt than
vLLM alone did, the median of its time to first token over vLLM alone's for the same request.

Targets (ratios in this run): kvstore's restore within 1.1x of vLLM's own hit; kvstore's token hit
rate above, and its p95 time to first token below, vLLM alone's and ExampleConnector's on every
workload whose working set (its distinct prefix blocks) exceeds vLLM's pool; the paired ratio
below 1.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.calibrate import BLOCK_SIZE, measure_tiers, prefill_points
from benchmarks.common import Result, plot_title, print_results, write_json
from benchmarks.replay_traces import (
    WORKLOADS,
    TraceRequest,
    distinct_tokens,
    generate,
    read_trace,
    unbounded_hit_rate,
)
from benchmarks.server_process import ServerProcess
from benchmarks.service import bench_server
from benchmarks.vllm_engine import Engine
from engine_plugin.calibration import Calibration, fit_prefill
from kvstore.client import connect
from kvstore.cost_model import PrefillModel
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.model_folder import block_bytes_of

RESTORE_TARGET = 1.1
HIT_SHARE = 0.5  # a request is a hit when at least this share of its prompt was cached
# The other KV connectors vLLM ships that offload KV (the disaggregation ones, NIXL and MoRIIO,
# move KV between engines instead), each with the extra config it needs to get past its own checks.
PEERS: dict[str, dict[str, object]] = {
    "LMCacheConnectorV1": {},
    "SimpleCPUOffloadConnector": {},
    "OffloadingConnector": {"cpu_bytes_to_use": 256 << 20},
    "MooncakeStoreConnector": {},  # reads MOONCAKE_CONFIG_PATH: a running Mooncake master's config
    "FlexKVConnectorV1": {},
}
PEER_START_S = 90
CONFIGS = ("vllm", "kvstore-dram", "kvstore-nvme", "example")
# kvstore against each peer, per workload: (figure, key, scale, unit, target)
COMPARED = (
    ("token hit rate", "token_hit_rate", 100.0, "%", "> 1"),
    ("p95 TTFT", "ttft_all_p95_s", 1e3, "ms", "< 1"),
)
NVME_CONFIG_ARENA = 32 << 20  # one arena page, the least there is: most restores read from nvme


@dataclass(frozen=True)
class ReplaySpec:
    model_size: str
    workloads: tuple[str, ...]
    sessions: int
    pool_tokens: int  # vLLM's KV pool, in tokens (at least the 4096-token context)
    prefix_tokens: int  # the restore-vs-vLLM-hit prompt
    rounds: int
    peers: bool
    layerwise: bool = False  # restore-vs-hit also on an engine that loads layer-wise


QUICK = ReplaySpec(
    "small",
    ("agent", "chats"),
    sessions=6,
    pool_tokens=5120,
    prefix_tokens=3008,
    rounds=9,
    peers=False,
    layerwise=True,
)
FULL = ReplaySpec(
    "small",
    tuple(WORKLOADS),
    sessions=16,
    pool_tokens=5120,
    prefix_tokens=3008,
    rounds=9,
    peers=True,
    layerwise=True,
)


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    connector: str | None
    arena_bytes: int = 0  # the kvstore sidecar's dram arena; 0: no sidecar


@dataclass
class Served:
    """What one configuration did on one workload, request by request."""

    prompt: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    held_bytes: int = 0
    restored_bytes: dict[str, int] = field(default_factory=dict)  # the connector's, by tier


def run_replay(
    model: str | None,
    quick: bool,
    json_path: str | None,
    plot_path: str | None,
    *,
    trace: str | None = None,
    tokenizer: str | None = None,
    tokens_per_id: int = BLOCK_SIZE,
    limit: int | None = None,
    workloads: Sequence[str] | None = None,
    peers: bool | None = None,
    configs: Sequence[str] | None = None,
    spec: ReplaySpec | None = None,
    console: Console | None = None,
) -> dict[str, object]:
    """Runs the replay, prints its tables and returns what ``--json`` writes."""
    from benchmarks.tiny_model import build_tiny_llama

    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise FailedPrecondition("--plot needs matplotlib: pip install 'kvstore[plot]'")
    spec = spec or (QUICK if quick else FULL)
    console = console or Console(stderr=True)
    folder = Path(tempfile.mkdtemp(prefix="kvreplay-"))
    model_dir = Path(model) if model else build_tiny_llama(folder / "llama", seed=0, size=spec.model_size)
    vocab = _vocab(model_dir)
    traces = _traces(
        spec, vocab, trace, Path(tokenizer) if tokenizer else model_dir, workloads, tokens_per_id, limit
    )
    block_bytes = block_bytes_of(model_dir, BLOCK_SIZE)
    token_bytes = block_bytes // BLOCK_SIZE
    pool_bytes = spec.pool_tokens * token_bytes
    trace_bytes = sum(len(r.tokens) for reqs in traces.values() for r in reqs) * token_bytes
    every = [
        Config("vllm", "vLLM alone", None),
        Config("kvstore-dram", "vLLM + kvstore (dram)", "kvstore", trace_bytes + (64 << 20)),
        Config("kvstore-nvme", "vLLM + kvstore (nvme)", "kvstore", NVME_CONFIG_ARENA),
        Config("example", "vLLM + ExampleConnector", "ExampleConnector"),
    ]
    wanted = set(configs or CONFIGS) | {"vllm"}  # vLLM alone: the reference, and the cold curve
    unknown = wanted - set(CONFIGS)
    if unknown:
        raise InvalidArgument(f"unknown configuration {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    configs_run = [c for c in every if c.name in wanted]
    started = time.monotonic()
    peer_rows = _try_peers(model_dir, pool_bytes, console) if (spec.peers if peers is None else peers) else []
    servers: dict[str, ServerProcess] = {}
    engines: dict[str, Engine] = {}
    try:
        console.print("[dim]tiers, engines and the cold prefill curve …[/]")
        calibration = folder / "calibration.json"
        for config in configs_run:
            if config.arena_bytes:
                servers[config.name] = bench_server(arena_bytes=config.arena_bytes)
            engines[config.name] = _engine(config, model_dir, servers, pool_bytes, folder, calibration)
            for seed in range(3):  # first requests warm an engine up: not measured
                engines[config.name].generate(
                    _fresh(256, 90_000 + 10 * len(engines) + seed, vocab), max_tokens=1
                )
            if config.name == "vllm":  # the cold curve, and the connector's calibration from it
                points = prefill_points(engines["vllm"], (256, 1024, 2048, 3072), reps=3, seed=7)
                cold = fit_prefill(points)
                tiers = measure_tiers(block_bytes, many=max(16, (16 << 20) // block_bytes), reps=2)
                Calibration(tiers, cold, points).save(calibration)
        served: dict[str, dict[str, Served]] = {}
        for workload, requests in traces.items():
            served[workload] = _replay(workload, requests, configs_run, engines, servers, folder, console)
        restore: list[Result] = []
        if "kvstore-dram" in engines:
            loads = {"whole": engines["kvstore-dram"]}
            if spec.layerwise:  # the same sidecar, an engine copying a layer at a time
                engines["kvstore-layerwise"] = Engine(
                    model_dir,
                    servers["kvstore-dram"].unix,
                    calibration=str(calibration),
                    prefix_caching=True,
                    kv_cache_bytes=pool_bytes,
                    connector_config={"layerwise_load": True},
                )
                loads["layer-wise"] = engines["kvstore-layerwise"]
            restore = _restore_vs_local(loads, spec, vocab, console)
    finally:
        for engine in engines.values():
            engine.close()
        for server in servers.values():
            server.stop()
        shutil.rmtree(folder / "example", ignore_errors=True)
    figures = {
        workload: {name: _figures(s, cold, pool_bytes) for name, s in by_config.items()}
        for workload, by_config in served.items()
    }
    for workload, by_config in figures.items():
        _print_table(console, workload, by_config, configs_run, len(traces[workload]))
    working_sets = {w: distinct_tokens(reqs, BLOCK_SIZE) * token_bytes for w, reqs in traces.items()}
    results = [*restore, *_target_rows(figures, working_sets, pool_bytes), *_unbounded_rows(figures, traces)]
    results += peer_rows
    if peer_rows:
        _print_peers(console, peer_rows)
    print_results(f"replay ({time.monotonic() - started:.0f} s, model {model_dir.name})", results)
    extra: dict[str, object] = {
        "model": str(model_dir) if model else f"{spec.model_size} random Llama",
        "pool_tokens": spec.pool_tokens,
        "pool_bytes": pool_bytes,
        "working_set_bytes": working_sets,
        "cold_prefill": {"fixed_s": cold.fixed_s, "per_token_s": cold.per_token_s},
        "replay": figures,
        "configs": {c.name: c.label for c in configs_run},
    }
    if json_path:
        write_json(json_path, results, extra)
    if plot_path:
        _plot(figures, {c.name: c.label for c in configs_run}, plot_path, str(extra["model"]))
    return {"results": [r.as_json() for r in results], **extra}


# ----------------------------------------------------------------------------- set-up


def _vocab(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _fresh(length: int, seed: int, vocab: int) -> list[int]:
    """A prompt no trace shares."""
    return [(i * 7919 + seed * 104_729) % (vocab - 3) + 3 for i in range(length)]


def _traces(
    spec: ReplaySpec,
    vocab: int,
    trace: str | None,
    tokenizer: Path,
    workloads: Sequence[str] | None,
    tokens_per_id: int = BLOCK_SIZE,
    limit: int | None = None,
) -> dict[str, list[TraceRequest]]:
    if trace:
        return {Path(trace).stem: read_trace(Path(trace), vocab, tokenizer, tokens_per_id)[:limit]}
    names = tuple(workloads or spec.workloads)
    for name in names:
        if name not in WORKLOADS:
            raise InvalidArgument(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return {name: generate(name, spec.sessions, vocab, seed=11) for name in names}


def _engine(
    config: Config,
    model_dir: Path,
    servers: dict[str, ServerProcess],
    pool_bytes: int,
    folder: Path,
    calibration: Path,
) -> Engine:
    if config.connector == "kvstore":
        return Engine(
            model_dir,
            servers[config.name].unix,
            calibration=str(calibration),
            prefix_caching=True,
            kv_cache_bytes=pool_bytes,
        )
    extra = {"shared_storage_path": str(folder / "example")} if config.connector == "ExampleConnector" else {}
    return Engine(
        model_dir,
        connector=config.connector,
        connector_config=extra,
        prefix_caching=True,
        kv_cache_bytes=pool_bytes,
    )


def _try_peers(model_dir: Path, pool_bytes: int, console: Console) -> list[Result]:
    """Start each other connector once; each that fails is reported with the error it gave."""
    rows = []
    for name, extra in PEERS.items():
        console.print(f"[dim]peer {name} …[/]")
        try:
            engine = Engine(
                model_dir,
                connector=name,
                connector_config=extra,
                prefix_caching=True,
                kv_cache_bytes=pool_bytes,
                start_s=PEER_START_S,
            )
        except (RuntimeError, TimeoutError) as e:
            rows.append(Result(f"peer {name}", None, "", note=f"does not start here: {_reason(str(e))}"))
            continue
        engine.close()
        rows.append(Result(f"peer {name}", None, "", note="starts here, but is not in the replay yet"))
    return rows


def _print_peers(console: Console, rows: list[Result]) -> None:
    table = Table(title="the other vLLM KV connectors on this machine")
    table.add_column("connector")
    table.add_column("result")
    for row in rows:
        table.add_row(row.metric.removeprefix("peer "), row.note)
    Console(width=100).print(table)


_ERROR = re.compile(r"(?:^|\s)([A-Za-z_.]*(?:Error|Exception)):\s*(.+)$")


def _reason(log: str) -> str:
    """The last ``SomethingError: message`` line of an engine's log."""
    for line in reversed(log.splitlines()):
        found = _ERROR.search(line.replace("[rank0]:", ""))
        if found and "the engine exited" not in line:
            return f"{found.group(1)}: {found.group(2).strip()}"[:160]
    return log.strip().splitlines()[-1][:160] if log.strip() else "no output"


# ----------------------------------------------------------------------------- the replay


def _replay(
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


def _restore_vs_local(
    engines: dict[str, Engine], spec: ReplaySpec, vocab: int, console: Console
) -> list[Result]:
    """Per round and engine (in turn, so noise hits both alike): a suffix after the prefix with
    vLLM holding it, then another after resetting vLLM's cache (kvstore restores the prefix);
    per engine, the median of its rounds' ratios. ``engines``: how each loads ("whole" first)."""
    console.print(f"[dim]restore vs vLLM's own hit, {spec.prefix_tokens}-token prefix …[/]")
    prefix = _fresh(spec.prefix_tokens, 77, vocab)
    for engine in engines.values():
        for seed in range(2):  # a new engine warms up first: not measured
            engine.generate(_fresh(256, 95_000 + seed, vocab), max_tokens=1)
        engine.generate(prefix + _fresh(32, 1, vocab), max_tokens=1)  # computed once, stored in kvstore
    ratios: dict[str, list[float]] = {name: [] for name in engines}
    local_s: dict[str, list[float]] = {name: [] for name in engines}
    restored_s: dict[str, list[float]] = {name: [] for name in engines}
    cached: list[int] = []
    for r in range(spec.rounds):
        names = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in names:
            engine = engines[name]
            local = engine.generate(prefix + _fresh(32, 100 + r, vocab), max_tokens=1)
            engine.reset_prefix_cache()
            restored = engine.generate(prefix + _fresh(32, 200 + r, vocab), max_tokens=1, policy="restore")
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


# ----------------------------------------------------------------------------- figures


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _figures(s: Served, cold: PrefillModel, pool_bytes: int) -> dict[str, object]:
    hits = [i for i, (p, c) in enumerate(zip(s.prompt, s.cached, strict=True)) if c >= HIT_SHARE * p]
    misses = sorted(set(range(len(s.prompt))) - set(hits))
    lengths = [c for c in s.cached if c > 0]
    busy_s = sum(s.seconds)
    saved_s = sum(cold.seconds(0, p) - t for p, t in zip(s.prompt, s.ttft, strict=True))
    cache_gb = (pool_bytes + s.held_bytes) / 1e9
    out: dict[str, object] = {
        "requests": len(s.prompt),
        "prompt_tokens": sum(s.prompt),
        "token_hit_rate": sum(s.cached) / max(1, sum(s.prompt)),
        "prefill_tokens_saved": sum(s.cached),
        "hits": len(hits),
        "hit_lengths": {q: _pct(lengths, p) for q, p in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))}
        | {"max": max(lengths, default=None)},
        "requests_per_s": len(s.prompt) / busy_s,
        "tokens_per_s": (sum(s.prompt) + sum(s.generated)) / busy_s,
        "ttft_saved_s": saved_s,
        "cache_bytes": pool_bytes + s.held_bytes,
        "ttft_saved_s_per_gb_hour": saved_s / (cache_gb * busy_s / 3600),
        "restored_bytes_by_tier": s.restored_bytes,
        "per_request": [[p, c, round(t, 4)] for p, c, t in zip(s.prompt, s.cached, s.ttft, strict=True)],
    }
    for group, which in (("all", range(len(s.ttft))), ("hits", hits), ("misses", misses)):
        times = [s.ttft[i] for i in which]
        for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
            out[f"ttft_{group}_{q}_s"] = _pct(times, p)
    return out


def _target_rows(
    figures: dict[str, dict[str, dict[str, object]]], working_sets: dict[str, int], pool_bytes: int
) -> list[Result]:
    """kvstore against vLLM alone and ExampleConnector, on workloads larger than vLLM's pool."""
    rows = []
    for workload, by_config in figures.items():
        exceeds = working_sets[workload] > pool_bytes
        note = "" if exceeds else "the trace fits vLLM's pool: no target"
        for ours in ("kvstore-dram", "kvstore-nvme"):
            if ours not in by_config:
                continue
            mine = by_config[ours]
            paired = _where_ours_held_more(by_config["vllm"], mine)
            rows.append(
                Result(
                    f"{workload}: TTFT where kvstore held more, {ours}",
                    statistics.median(paired) if paired else None,
                    "x",
                    "vLLM alone, same request",
                    1.0,
                    "< 1" if paired else None,
                    f"median over the {len(paired)} requests where the engine found at least a block "
                    "more than vLLM alone did",
                )
            )
            for peer in ("vllm", "example"):
                if peer not in by_config:
                    continue
                theirs = by_config[peer]
                for figure, key, scale, unit, target in COMPARED:
                    rows.append(
                        Result(
                            f"{workload}: {figure}, {ours}",
                            float(str(mine[key])) * scale,
                            unit,
                            peer,
                            float(str(theirs[key])) * scale,
                            target if exceeds else None,
                            note,
                        )
                    )
    return rows


def _unbounded_rows(
    figures: dict[str, dict[str, dict[str, object]]], traces: dict[str, list[TraceRequest]]
) -> list[Result]:
    """The hit rate kvstore reached against the trace's own with unbounded capacity (its dram
    arena holds the whole trace)."""
    rows = []
    for workload, by_config in figures.items():
        if "kvstore-dram" not in by_config:
            continue
        unbounded = unbounded_hit_rate(traces[workload], BLOCK_SIZE)
        rows.append(
            Result(
                f"{workload}: token hit rate vs the trace's unbounded-capacity one, kvstore-dram",
                float(str(by_config["kvstore-dram"]["token_hit_rate"])),
                "",
                "unbounded capacity",
                unbounded,
                ">= 0.9",
                f"{BLOCK_SIZE}-token blocks, each salt its own cache; vLLM alone "
                f"{float(str(by_config['vllm']['token_hit_rate'])):.3f}",
            )
        )
    return rows


def _where_ours_held_more(vllm: dict[str, object], ours: dict[str, object]) -> list[float]:
    """TTFT ratios, ours over vLLM alone's, of the requests whose cached prefix was at least a
    block longer here than there (the same prompt, served by both)."""
    theirs_rows = vllm["per_request"]
    ours_rows = ours["per_request"]
    assert isinstance(theirs_rows, list) and isinstance(ours_rows, list)
    ratios = []
    for (_, c_vllm, t_vllm), (_, c_ours, t_ours) in zip(theirs_rows, ours_rows, strict=True):
        if c_ours >= c_vllm + BLOCK_SIZE:
            ratios.append(t_ours / t_vllm)
    return ratios


def _print_table(
    console: Console, workload: str, by_config: dict[str, dict[str, object]], configs: list[Config], n: int
) -> None:
    def ms(v: object) -> str:
        return "—" if v is None else f"{float(str(v)) * 1e3:.0f}"

    table = Table(title=f"{workload}: {n} requests (TTFT in ms; a hit has >= half its prompt cached)")
    for col in (
        "config",
        "hit rate",
        "hits",
        "hit p50/p95/p99",
        "miss p50/p95/p99",
        "req/s",
        "tok/s",
        "s/GB-h",
    ):
        table.add_column(col, justify="left" if col == "config" else "right")
    for c in configs:
        f = by_config[c.name]
        table.add_row(
            c.name,
            f"{float(str(f['token_hit_rate'])):.0%}",
            f"{f['hits']}",
            "/".join(ms(f[f"ttft_hits_{q}_s"]) for q in ("p50", "p95", "p99")),
            "/".join(ms(f[f"ttft_misses_{q}_s"]) for q in ("p50", "p95", "p99")),
            f"{float(str(f['requests_per_s'])):.1f}",
            f"{float(str(f['tokens_per_s'])):,.0f}",
            f"{float(str(f['ttft_saved_s_per_gb_hour'])):,.0f}",
        )
    Console(width=100).print(table)


def _plot(
    figures: dict[str, dict[str, dict[str, object]]],
    labels: dict[str, str],
    path: str,
    model: str,
    machine: dict[str, object] | None = None,
) -> None:
    """Token hit rate and p95 time to first token per workload, a bar per configuration
    (kvstore's solid, the others hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(figures)
    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.9))
    width = 0.8 / len(labels)
    for k, (name, label) in enumerate(labels.items()):
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(workloads))]
        style = {"hatch": "" if name.startswith("kvstore") else "//", "edgecolor": "black", "label": label}
        hit_ax.bar(
            xs, [float(str(figures[w][name]["token_hit_rate"])) * 100 for w in workloads], width, **style
        )
        ttft_ax.bar(
            xs, [float(str(figures[w][name]["ttft_all_p95_s"])) * 1e3 for w in workloads], width, **style
        )
    for ax, ylabel in ((hit_ax, "token hit rate (%)"), (ttft_ax, "p95 time to first token (ms)")):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(ylabel)
    hit_ax.set_ylim(0, 100)
    handles, names = hit_ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(
        plot_title(
            "workload replay on vLLM CPU, one request at a time", model, "no bandwidth emulated", machine
        ),
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
