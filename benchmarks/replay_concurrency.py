"""``kvstore bench replay --concurrency``: what restores from a throttled nvme cost the requests
running beside them, with loads beside the engine's steps (the connector's default) and inside
them (``async_load`` off), against vLLM alone.

One trace with an online server's arrivals (each request submitted at its time while the engine
steps): ``others`` short fresh prompts (misses) at a steady rate and, among them, ``longs`` long
prompts whose KV kvstore holds in nvme (stored earlier, then the sidecar restarted: its dram
spilled to nvme), read at a throttled rate set so that restoring a long prompt takes
``RESTORE_SHARE`` of its cold prefill (measured in the same run): a slow disk, but one still
worth restoring from (the long prompts are forced to restore; the deadline of a load is its
predicted prefill).

The short prompts arrive every ``ARRIVAL_SHARE`` of the long prompt's cold prefill, and the long
ones are spread over the same span: a load vLLM alone serves without a queue building up.

Engines, all with the same settings (the ``tiny`` random Llama unless ``--model``: on this
shared 2-core machine the ``small`` one's 2,048-token prefill took 28 s and every engine queued;
bf16, 32-token blocks, vLLM's own prefix cache off so every cached token came through the
connector):

- ``vllm``: vLLM alone, the long prompts computed;
- ``async``: vLLM + kvstore, loads beside the steps;
- ``sync``: vLLM + kvstore with ``async_load`` off, every load inside the step.

Each round stores fresh long prompts (under a salt of each kvstore engine's own, so one engine's
restore never finds what another's promoted to dram), restarts the sidecar, and runs the trace
through each engine in turn (the order rotating). Figures per engine: the other requests' time to
first token (vLLM's own) at p50 and p95, and requests/s (every request of the trace over the time
from the first arrival to the last completion); as ratios to vLLM alone in the same round, medians
over the rounds. Target: async's p95 within 1.2x of vLLM alone's, and below sync's.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.calibrate import BLOCK_SIZE
from benchmarks.common import Result, print_results, write_json
from benchmarks.server_process import ServerProcess
from benchmarks.vllm_engine import Engine
from kvstore.model_folder import block_bytes_of

RESTORE_SHARE = 0.6  # a long prompt's restore takes this share of its cold prefill
ARRIVAL_SHARE = 0.5  # the short prompts arrive this share of a long prompt's cold prefill apart
P95_TARGET = 1.2
ENGINES = ("vllm", "async", "sync")


@dataclass(frozen=True)
class ConcurrencySpec:
    rounds: int = 5
    others: int = 40  # short fresh prompts a round
    other_tokens: int = 128
    longs: int = 4  # long stored prompts a round, restored from nvme
    long_tokens: int = 2016  # 63 blocks


QUICK = ConcurrencySpec(rounds=3, others=24)


def run_concurrency(
    model_dir: Path, spec: ConcurrencySpec, json_path: str | None, console: Console
) -> dict[str, object]:
    """Runs the rounds, prints the table; returns what ``--json`` writes."""
    rng = random.Random(0)
    vocab = 500
    long_bytes = (spec.long_tokens // BLOCK_SIZE) * block_bytes_of(model_dir, BLOCK_SIZE)
    sidecar = ServerProcess(
        {
            "dram.capacity_bytes": "1GiB",
            "dram.prefault": "false",
            "nvme.capacity_bytes": "8GiB",
            "server.metrics_address": "",
        }
    )
    engines: dict[str, Engine] = {}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in ENGINES}
    try:
        engines["vllm"] = Engine(model_dir, connector=None)
        engines["async"] = Engine(model_dir, sidecar.unix, policy="restore")
        engines["sync"] = Engine(
            model_dir, sidecar.unix, policy="restore", connector_config={"async_load": False}
        )
        prefill_s = _cold_prefill_s(engines["vllm"], spec, rng, vocab)
        throttle = int(long_bytes / (RESTORE_SHARE * prefill_s))
        interval_s = ARRIVAL_SHARE * prefill_s
        console.print(
            f"[dim]a long prompt: {spec.long_tokens} tokens, {long_bytes / 2**20:.1f} MiB of KV, "
            f"cold prefill {prefill_s * 1e3:.0f} ms; nvme throttled to {throttle / 1e6:.1f} MB/s; "
            f"short prompts {interval_s * 1e3:.0f} ms apart[/]"
        )
        for r in range(spec.rounds):
            longs = [_prompt(rng, vocab, spec.long_tokens) for _ in range(spec.longs)]
            for name in ("async", "sync"):
                for prompt in longs:  # stored, for the trace to restore
                    engines[name].generate(prompt, salt=f"{name}-{r}", max_tokens=1)
            sidecar.restart({"nvme.throttle_bytes_per_s": str(throttle)})  # dram spills to nvme
            trace = _trace(spec, rng, vocab, longs, interval_s)
            order = ENGINES[r % 3 :] + ENGINES[: r % 3]
            for name in order:
                salted = [{**one, "salt": f"{name}-{r}"} if one.get("long") else one for one in trace]
                replies = engines[name].generate_timed([_request(one) for one in salted])
                rows[name].append(_figures(trace, replies))
            console.print(f"[dim]round {r + 1}/{spec.rounds}: " + _round_line(rows, r) + "[/]")
        failed = {
            name: engines[name].metrics().get("kvstore_connector_load_failed_blocks_total", 0.0)
            for name in ("async", "sync")
        }
    finally:
        for engine in engines.values():
            engine.close()
        sidecar.stop()
    results = _results(rows, spec, failed)
    print_results(
        "Restores from a throttled nvme beside other requests (medians over rounds)", results, console
    )
    doc: dict[str, object] = {
        "spec": spec.__dict__,
        "throttle_bytes_per_s": throttle,
        "interval_s": interval_s,
        "long_prefill_s": prefill_s,
        "rounds": rows,
    }
    if json_path:
        write_json(json_path, results, doc)
    return doc


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _cold_prefill_s(engine: Engine, spec: ConcurrencySpec, rng: random.Random, vocab: int) -> float:
    """The median time to first token of a fresh long prompt alone (after a warm-up)."""
    engine.generate(_prompt(rng, vocab, spec.long_tokens), max_tokens=1)
    return statistics.median(
        float(engine.generate(_prompt(rng, vocab, spec.long_tokens), max_tokens=1)["ttft"]) for _ in range(3)
    )


def _trace(
    spec: ConcurrencySpec, rng: random.Random, vocab: int, longs: list[list[int]], interval_s: float
) -> list[dict[str, Any]]:
    """The short prompts at a steady rate; the long ones spread over the same span."""
    trace: list[dict[str, Any]] = [
        {"at": i * interval_s, "prompt": _prompt(rng, vocab, spec.other_tokens), "max_tokens": 8}
        for i in range(spec.others)
    ]
    span = spec.others * interval_s
    for i, prompt in enumerate(longs):
        at = (i + 0.5) * span / len(longs)
        trace.append({"at": at, "prompt": prompt, "max_tokens": 4, "long": True})
    return trace


def _request(one: dict[str, Any]) -> dict[str, Any]:
    request = {k: one[k] for k in ("at", "prompt", "max_tokens")}
    if one.get("long"):
        request.update(salt=one["salt"], policy="restore")
    return request


def _figures(trace: list[dict[str, Any]], replies: list[dict[str, Any]]) -> dict[str, float]:
    others = [float(rep["ttft"]) for one, rep in zip(trace, replies, strict=True) if not one.get("long")]
    longs = [rep for one, rep in zip(trace, replies, strict=True) if one.get("long")]
    # the engine's clock: the first arrival is the trace's first request's first token less its TTFT
    first = min(float(rep["first_token_at"]) - float(rep["ttft"]) for rep in replies)
    last = max(float(rep["finished_at"]) for rep in replies)
    return {
        "other_ttft_p50_s": statistics.median(others),
        "other_ttft_p95_s": _p95(others),
        "long_ttft_p50_s": statistics.median(float(rep["ttft"]) for rep in longs),
        "long_cached_tokens": float(sum(int(rep["cached"]) for rep in longs)),
        "requests_per_s": len(replies) / (last - first),
    }


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _round_line(rows: dict[str, list[dict[str, float]]], r: int) -> str:
    return "; ".join(
        f"{name} p95 {rows[name][r]['other_ttft_p95_s'] * 1e3:.0f} ms, {rows[name][r]['requests_per_s']:.1f} req/s"
        for name in ENGINES
    )


def _ratio(rows: dict[str, list[dict[str, float]]], name: str, key: str, against: str = "vllm") -> float:
    return statistics.median(a[key] / b[key] for a, b in zip(rows[name], rows[against], strict=True))


def _results(
    rows: dict[str, list[dict[str, float]]], spec: ConcurrencySpec, failed: dict[str, float]
) -> list[Result]:
    def med(name: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[name])

    restored = med("async", "long_cached_tokens") / (spec.longs * spec.long_tokens)
    out: list[Result] = []
    for name, label in (("async", "loads beside the steps"), ("sync", "loads inside the step")):
        out.append(
            Result(
                f"others' p95 TTFT, {label}",
                med(name, "other_ttft_p95_s") * 1e3,
                "ms",
                "vLLM alone",
                med("vllm", "other_ttft_p95_s") * 1e3,
                f"<= {P95_TARGET}" if name == "async" else None,
                note=f"median of per-round ratios {_ratio(rows, name, 'other_ttft_p95_s'):.2f}x",
            )
        )
    out.append(
        Result(
            "others' p95 TTFT, beside vs inside the step",
            med("async", "other_ttft_p95_s") * 1e3,
            "ms",
            "loads inside the step",
            med("sync", "other_ttft_p95_s") * 1e3,
            "< 1",
            note=f"median of per-round ratios {_ratio(rows, 'async', 'other_ttft_p95_s', 'sync'):.2f}x",
        )
    )
    for name, label in (("async", "beside the steps"), ("sync", "inside the step")):
        out.append(
            Result(
                f"requests/s, loads {label}",
                med(name, "requests_per_s"),
                "req/s",
                "vLLM alone",
                med("vllm", "requests_per_s"),
                note=f"median of per-round ratios {_ratio(rows, name, 'requests_per_s'):.2f}x",
            )
        )
    out.append(
        Result(
            "long prompts' p50 TTFT, loads beside the steps",
            med("async", "long_ttft_p50_s") * 1e3,
            "ms",
            "vLLM alone (computed)",
            med("vllm", "long_ttft_p50_s") * 1e3,
            note=f"{restored:.0%} of their tokens restored; blocks that failed to load (recomputed): "
            f"{failed['async']:.0f} beside, {failed['sync']:.0f} inside the step",
        )
    )
    return out


def run_concurrency_bench(model: str | None, quick: bool, json_path: str | None) -> dict[str, object]:
    """The command's entry: the model given, or the ``tiny`` random Llama built on the spot."""
    import shutil

    from benchmarks.tiny_model import build_tiny_llama

    console = Console(stderr=True, width=110)
    folder = Path(tempfile.mkdtemp(prefix="kvconc-model-"))
    try:
        model_dir = Path(model) if model else build_tiny_llama(folder / "llama", seed=0)
        return run_concurrency(model_dir, QUICK if quick else ConcurrencySpec(), json_path, console)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
