"""``kvstore bench replay``'s figures: each configuration's hit rates and times to first token, the
rows against the targets, the tables and the plot."""

import statistics
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from benchmarks.calibrate import BLOCK_SIZE
from benchmarks.common import Result, plot_title
from benchmarks.replay_setup import COMPARED, HIT_SHARE, Config, Served
from benchmarks.replay_traces import TraceRequest, unbounded_hit_rate
from kvstore.cost_model import PrefillModel


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def config_figures(s: Served, cold: PrefillModel, pool_bytes: int) -> dict[str, object]:
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


def target_rows(
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


def unbounded_rows(
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


def print_table(
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


def plot_figures(
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
