"""``kvstore bench fleet --trace FILE``: one of the field's traces (``benchmarks.traces``: Mooncake's
format or multi-turn chat) through the fleet, as Mooncake's paper measures it.

- **The trace itself**: its hit rate with unbounded capacity (a prefix cache that keeps every
  block, requests in order), in the format's own blocks (Mooncake's 512-token hash ids) and in
  tokens over the replay's blocks.
- **Local against global, simulated** (``NODES`` = 10 prefill nodes, as in the paper): each node
  its own LRU cache of ``share / NODES`` of the trace's distinct blocks, requests spread round
  robin, against one shared LRU pool of ``share`` of them, for each share in ``SHARES``; the
  ratio global/local beside the paper's (2.22x conversation, 2.36x synthetic).
- **Real sidecars**: the trace through ``benchmarks.fleet_real`` (four ``kvstore serve``
  sidecars, the real router), local-only against a shared kvstore server under them that holds
  the working set; the token hit rate kvstore reached against the unbounded one (target
  >= 0.9x with the shared tier), and the time per request (restore what is held, store the
  rest) local-only against through the shared tier.

Blocks are Qwen2.5-0.5B's (24 layers x 2 KV heads x 64 dims x K and V x 2 bytes = 6 KiB a token,
192 KiB per 16-token block): a small model's, so the blocks' count, not their bytes, sets the cost.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import Result, print_results, write_json
from benchmarks.fleet_sim import LruBlocks
from benchmarks.traces import (
    Request,
    block_keys,
    detect_format,
    hash_id_hit_rate,
    read_chat,
    read_mooncake,
    read_mooncake_rows,
    token_hit_rate_unbounded,
    unbounded_hit_rate,
    word_ids,
)
from kvstore.errors import InvalidArgument
from kvstore.keys import ModelIdentity

NODES = 10
SHARES = (0.1, 0.25, 0.5, 1.0)
PAPER_RATIO = "Mooncake's paper: 2.22x conversation, 2.36x synthetic"
MODEL = ModelIdentity(
    "Qwen/Qwen2.5-0.5B", "00" * 32, num_layers=24, num_kv_heads=2, head_dim=64, tokens_per_block=16
)
VOCAB = 151_936  # Qwen2.5's


def load(path: Path, tokens_per_id: int) -> tuple[str, list[Request], float | None]:
    """The trace's format, its requests, and (Mooncake) its unbounded hit rate over hash ids."""
    kind = detect_format(path)
    if kind == "mooncake":
        rows = read_mooncake_rows(path)
        return kind, read_mooncake(path, VOCAB, tokens_per_id), hash_id_hit_rate(rows)
    if kind == "chat":
        return kind, read_chat(path, word_ids(VOCAB)), None
    raise InvalidArgument(f"{path}: bench fleet reads Mooncake or chat traces, not {kind} lines")


def local_vs_global(keys: Sequence[Sequence[int]], nodes: int, capacity: int) -> tuple[float, float]:
    """Block hit rates: ``nodes`` caches of ``capacity // nodes`` blocks each, requests round
    robin, and one pool of ``capacity`` blocks."""
    local = [LruBlocks(max(1, capacity // nodes)) for _ in range(nodes)]
    pool = LruBlocks(capacity)
    hit_local = hit_global = total = 0
    for i, request in enumerate(keys):
        node = local[i % nodes]
        hit_local += node.prefix(request)
        hit_global += pool.prefix(request)
        total += len(request)
        node.touch(request)
        pool.touch(request)
    return hit_local / max(1, total), hit_global / max(1, total)


def _real_rows(trace: Sequence[Request], unbounded: float, speedup: float, rounds: int) -> list[Result]:
    """Per policy, ``rounds`` rounds of local-only and shared-tier replays (the order alternating,
    so a slow stretch of the machine hits both); medians over the rounds."""
    from benchmarks.fleet_real import REPLICAS, ReplayFigures, replay

    rows = []
    for policy in ("round-robin", "cost"):
        runs: dict[bool, list[ReplayFigures]] = {False: [], True: []}
        for r in range(rounds):
            for remote in (False, True) if r % 2 == 0 else (True, False):
                print(
                    f"real sidecars: {policy}, remote {'kvstore' if remote else 'none'}, round {r + 1} …",
                    file=sys.stderr,
                )
                runs[remote].append(replay(policy, remote, 0, trace=trace, model=MODEL, speedup=speedup))
        hit = {remote: statistics.median(f.hit_rate for f in runs[remote]) for remote in runs}
        per_request = {
            remote: statistics.median(statistics.median(f.request_s) for f in runs[remote]) for remote in runs
        }
        per_block = {
            remote: statistics.median(sum(f.request_s) / f.blocks for f in runs[remote]) for remote in runs
        }
        ratios = [
            statistics.median(s.request_s) / statistics.median(a.request_s)
            for a, s in zip(runs[False], runs[True], strict=True)
        ]
        rows.append(
            Result(
                f"real sidecars' hit rate with a shared tier, {policy}",
                hit[True],
                "",
                "unbounded capacity",
                unbounded,
                ">= 0.9",
                f"{REPLICAS} sidecars and a shared kvstore server holding the working set; "
                f"local-only {hit[False]:.3f}; median of {rounds} runs",
            )
        )
        rows.append(
            Result(
                f"real sidecars' time per request, shared tier vs local-only, {policy}",
                per_request[True] * 1e3,
                "ms",
                "local-only",
                per_request[False] * 1e3,
                None,
                f"each request's restore and store, median per run, median of {rounds} runs "
                f"(per-run ratios {', '.join(f'{x:.2f}' for x in ratios)}); mean per block "
                f"{per_block[True] * 1e3:.3f} ms vs {per_block[False] * 1e3:.3f} ms; "
                f"{MODEL.block_bytes >> 10} KiB blocks, requests at {speedup:g}x the trace's pace"
                + (" (0: back to back)" if not speedup else ""),
            )
        )
    return rows


def run_trace(path: Path, tokens_per_id: int, speedup: float, quick: bool, json_path: str | None) -> int:
    kind, requests, id_rate = load(path, tokens_per_id)
    tpb = MODEL.tokens_per_block
    prompts = [r.tokens for r in requests]
    unbounded = token_hit_rate_unbounded(prompts, tpb)
    keys = [block_keys(p, tpb) for p in prompts]
    distinct = len({k for ks in keys for k in ks})
    block_rate = unbounded_hit_rate(keys)  # the simulation's unit: blocks
    name = f"{path.stem} ({kind}, {len(requests)} requests)"
    rows = [
        Result(
            "the trace's hit rate with unbounded capacity",
            unbounded,
            "",
            note=f"tokens over {tpb}-token blocks; blocks {block_rate:.3f} of {distinct} distinct"
            + (
                f"; {tokens_per_id} tokens per hash id; over the format's own hash ids {id_rate:.3f}"
                if id_rate is not None
                else "; a token per word"
            ),
        )
    ]
    grid = []
    for share in SHARES:
        capacity = max(NODES, int(share * distinct))
        local, pooled = local_vs_global(keys, NODES, capacity)
        grid.append({"share": share, "capacity_blocks": capacity, "local": local, "global": pooled})
        rows.append(
            Result(
                f"hit rate, a global pool vs {NODES} local caches, {share:.0%} of the working set",
                pooled,
                "",
                f"{NODES} local caches",
                local,
                None,
                f"simulated: {NODES} nodes, round robin, {capacity} blocks in all; {PAPER_RATIO}",
            )
        )
    trace = requests[: 80 if quick else None]
    reference = token_hit_rate_unbounded(prompts[: len(trace)], tpb)
    rows += _real_rows(trace, reference, speedup, rounds=1 if quick else 3)
    print_results(f"kvstore bench fleet --trace {path}: {name}", rows)
    print("\nsimulated local vs global (block hit rate), " + PAPER_RATIO)
    for g in grid:
        ratio = g["global"] / g["local"] if g["local"] else float("inf")
        print(
            f"  {g['share']:>4.0%} of {distinct} blocks ({g['capacity_blocks']} in all): "
            f"local {g['local']:.3f}  global {g['global']:.3f}  ratio {ratio:.2f}x"
        )
    if json_path:
        write_json(json_path, rows, {"trace": str(path), "format": kind, "simulation": grid})
    return 0
