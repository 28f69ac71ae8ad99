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
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from benchmarks.calibrate import BLOCK_SIZE, measure_tiers, prefill_points
from benchmarks.common import Result, print_results, write_json
from benchmarks.replay_report import config_figures, plot_figures, print_table, target_rows, unbounded_rows
from benchmarks.replay_run import replay_workload, restore_vs_local
from benchmarks.replay_setup import (
    CONFIGS,
    FULL,
    NVME_CONFIG_ARENA,
    QUICK,
    Config,
    ReplaySpec,
    Served,
    fresh_tokens,
    make_engine,
    make_traces,
    print_peers,
    try_peers,
    vocab_of,
)
from benchmarks.replay_traces import distinct_tokens
from benchmarks.server_process import ServerProcess
from benchmarks.service_setup import bench_server
from benchmarks.vllm_engine import Engine
from engine_plugin.calibration import Calibration, fit_prefill
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.model_folder import block_bytes_of


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
    vocab = vocab_of(model_dir)
    traces = make_traces(
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
    peer_rows = try_peers(model_dir, pool_bytes, console) if (spec.peers if peers is None else peers) else []
    servers: dict[str, ServerProcess] = {}
    engines: dict[str, Engine] = {}
    try:
        console.print("[dim]tiers, engines and the cold prefill curve …[/]")
        calibration = folder / "calibration.json"
        for config in configs_run:
            if config.arena_bytes:
                servers[config.name] = bench_server(arena_bytes=config.arena_bytes)
            engines[config.name] = make_engine(config, model_dir, servers, pool_bytes, folder, calibration)
            for seed in range(3):  # first requests warm an engine up: not measured
                engines[config.name].generate(
                    fresh_tokens(256, 90_000 + 10 * len(engines) + seed, vocab), max_tokens=1
                )
            if config.name == "vllm":  # the cold curve, and the connector's calibration from it
                points = prefill_points(engines["vllm"], (256, 1024, 2048, 3072), reps=3, seed=7)
                cold = fit_prefill(points)
                tiers = measure_tiers(block_bytes, many=max(16, (16 << 20) // block_bytes), reps=2)
                Calibration(tiers, cold, points).save(calibration)
        served: dict[str, dict[str, Served]] = {}
        for workload, requests in traces.items():
            served[workload] = replay_workload(
                workload, requests, configs_run, engines, servers, folder, console
            )
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
            restore = restore_vs_local(loads, spec, vocab, console)
    finally:
        for engine in engines.values():
            engine.close()
        for server in servers.values():
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)  # the model, the calibration, the peer's files
    figures = {
        workload: {name: config_figures(s, cold, pool_bytes) for name, s in by_config.items()}
        for workload, by_config in served.items()
    }
    for workload, by_config in figures.items():
        print_table(console, workload, by_config, configs_run, len(traces[workload]))
    working_sets = {w: distinct_tokens(reqs, BLOCK_SIZE) * token_bytes for w, reqs in traces.items()}
    results = [*restore, *target_rows(figures, working_sets, pool_bytes), *unbounded_rows(figures, traces)]
    results += peer_rows
    if peer_rows:
        print_peers(console, peer_rows)
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
        plot_figures(figures, {c.name: c.label for c in configs_run}, plot_path, str(extra["model"]))
    return {"results": [r.as_json() for r in results], **extra}
