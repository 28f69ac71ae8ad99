"""``kvstore bench decisions --converge``: a plan that starts from a wrong calibration, with and
without exploration (``kvstore.cost_model.explore``), request by request until it decides right.

The connector's own parts, closed in a loop: ``engine_plugin.calibration.Calibration`` learns
from each request's measured restore and prefill, ``plan_restore`` decides from its snapshot and
``explore`` takes the other side now and then, as ``engine_plugin.vllm_scheduler`` does. The
engine is replaced by a ground truth that times what the plan chose: the small benchmark model
on vLLM CPU as ``kvstore bench decisions --quick`` measured it (256 KiB blocks of 16 tokens,
prefill ~18 ms + 0.18 ms a token: 122 ms for 576 tokens), restores from an nvme tier throttled
around the crossover (~91 MB/s, where restoring a token costs what computing it does) with a
3 ms fixed cost per restore; each time log-normal (sigma 0.1), and 3% of prefills a stall 3x
as long (a busy shared machine). Seeded: every run repeats exactly.

Two wrong starts, one per side of the crossover:

- ``restore wins, calibrated slow``: the tier restores at 2x the crossover, the calibration says
  4x slower (a few restores timed in a stall): every plan recomputes, and without exploration
  no restore is ever timed again;
- ``recompute wins, calibrated fast``: the tier restores at 0.5x the crossover, the calibration
  file's prefill points were timed 3x too slow (``kvstore bench calibrate`` in a stall): every
  plan restores, and the restores' prefills are short suffixes that cannot outweigh the file's
  whole prompts in the fit.

Per start, per seed: the request from which the plan's own choice (before any exploration) is
the faster side for every later request (the two within 5% count either way), or none within
the run; and the run's mean time to first token over an oracle's that always took the faster
side (what deciding wrong and exploring cost together).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from engine_plugin.calibration import Calibration
from kvstore.cost_model import EXPLORE_FRACTION, PrefillModel, TierCost, explore, plan_restore

BLOCK_BYTES = 256 * 1024
TOKENS_PER_BLOCK = 16
SUFFIX_TOKENS = 64
TRUE_PREFILL = PrefillModel(fixed_s=0.018, per_token_s=0.00018)
CROSSOVER_BYTES_PER_S = BLOCK_BYTES / TOKENS_PER_BLOCK / TRUE_PREFILL.per_token_s  # ~91 MB/s
RESTORE_LATENCY_S = 0.003
NOISE_SIGMA = 0.1
STALL_SHARE, STALL_FACTOR = 0.03, 3.0
TIE = 0.05  # the two sides this close: either is right


@dataclass(frozen=True)
class Start:
    name: str
    true_tier: TierCost
    calibrated_tier: TierCost
    calibrated_prefill: PrefillModel
    points: tuple[tuple[int, int, float], ...] = ()  # the calibration file's prefill points


SLOW = PrefillModel(3 * TRUE_PREFILL.fixed_s, 3 * TRUE_PREFILL.per_token_s)


STARTS = (
    Start(
        "restore wins, calibrated slow",
        TierCost(2 * CROSSOVER_BYTES_PER_S, RESTORE_LATENCY_S),
        TierCost(0.5 * CROSSOVER_BYTES_PER_S, RESTORE_LATENCY_S),
        TRUE_PREFILL,
    ),
    Start(
        "recompute wins, calibrated fast",
        TierCost(0.5 * CROSSOVER_BYTES_PER_S, RESTORE_LATENCY_S),
        TierCost(0.5 * CROSSOVER_BYTES_PER_S, RESTORE_LATENCY_S),
        SLOW,
        tuple((0, n, SLOW.seconds(0, n)) for n in (128, 512, 1024, 2048, 3072)),
    ),
)


@dataclass
class Run:
    right: list[bool] = field(default_factory=list)  # per request: the plan's own choice was right
    explored: int = 0
    ttft_s: float = 0.0
    oracle_s: float = 0.0

    def converged_at(self) -> int | None:
        """The 1-based request from which every choice was right; None when the last was wrong."""
        if not self.right or not self.right[-1]:
            return None
        wrong = [i for i, ok in enumerate(self.right) if not ok]
        return (wrong[-1] + 2) if wrong else 1


def run(start: Start, explore_fraction: float, seed: int, requests: int) -> Run:
    rng = random.Random(seed)
    calibration = Calibration({"nvme": start.calibrated_tier}, start.calibrated_prefill, list(start.points))
    truth = {"nvme": start.true_tier}
    out = Run()

    def timed(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, NOISE_SIGMA)

    for _ in range(requests):
        prefix = rng.randrange(512, 3009, TOKENS_PER_BLOCK)
        prompt = prefix + SUFFIX_TOKENS
        hits = ["nvme"] * (prefix // TOKENS_PER_BLOCK)
        snap = calibration.snapshot()
        plan = plan_restore(hits, BLOCK_BYTES, TOKENS_PER_BLOCK, prompt, snap.tiers, snap.prefill)
        best = plan_restore(hits, BLOCK_BYTES, TOKENS_PER_BLOCK, prompt, truth, TRUE_PREFILL)
        restore_s, recompute_s = best.all_restore_s, best.all_recompute_s
        tie = abs(restore_s - recompute_s) <= TIE * min(restore_s, recompute_s)
        out.right.append(tie or (plan.restore_blocks > 0) == (restore_s < recompute_s))
        blocks = plan.restore_blocks
        explored = explore(plan, rng.random(), explore_fraction) if explore_fraction else None
        if explored is not None:
            blocks, out.explored = explored, out.explored + 1
        held = blocks * TOKENS_PER_BLOCK
        if blocks:
            cost = start.true_tier
            load_s = cost.latency_s + blocks * BLOCK_BYTES / cost.bandwidth_bytes_per_s
            calibration.observe_transfer("nvme", blocks * BLOCK_BYTES, timed(load_s))
        prefill_s = timed(TRUE_PREFILL.seconds(held, prompt - held))
        if rng.random() < STALL_SHARE:
            prefill_s *= STALL_FACTOR
        calibration.observe_prefill(held, prompt - held, prefill_s)
        # what the choice costs, without the noise (which the oracle cannot avoid either)
        taken = plan_restore(hits, BLOCK_BYTES, TOKENS_PER_BLOCK, prompt, truth, TRUE_PREFILL, blocks)
        out.ttft_s += taken.predicted_ttft_s
        out.oracle_s += min(restore_s, recompute_s)
    return out


def report(seeds: int = 5, requests: int = 600, fraction: float = EXPLORE_FRACTION) -> list[str]:
    lines = [
        "kvstore bench decisions --converge: the plan from a wrong calibration, request by request",
        f"truth: small model on vLLM CPU (prefill {TRUE_PREFILL.fixed_s * 1e3:.0f} ms + "
        f"{TRUE_PREFILL.per_token_s * 1e3:.2f} ms a token), {BLOCK_BYTES // 1024} KiB blocks of "
        f"{TOKENS_PER_BLOCK} tokens, prefixes 512-3008 tokens from nvme with {RESTORE_LATENCY_S * 1e3:.0f} ms "
        f"a restore, crossover {CROSSOVER_BYTES_PER_S / 1e6:.0f} MB/s; times log-normal sigma {NOISE_SIGMA}, "
        f"{STALL_SHARE:.0%} of prefills stalled {STALL_FACTOR:.0f}x",
        f"{seeds} seeds x {requests} requests per start; converged: the request from which the plan's own "
        f"choice is the faster side to the end (within {TIE:.0%}: either)",
        "",
    ]
    for start in STARTS:
        lines.append(f"{start.name}:")
        for share in (0.0, fraction):
            runs = [run(start, share, seed, requests) for seed in range(seeds)]
            at = [r.converged_at() for r in runs]
            done = sorted(a for a in at if a is not None)
            median = f"median {statistics.median(done):.0f} requests" if done else "never"
            overhead = statistics.median(r.ttft_s / r.oracle_s for r in runs)
            explored = statistics.median(r.explored for r in runs)
            label = f"explore_fraction {share:g}" + (" (default)" if share == EXPLORE_FRACTION else "")
            lines.append(
                f"  {label:<30} converged in {len(done)} of {seeds} runs, {median} "
                f"(each: {', '.join('-' if a is None else str(a) for a in at)}); "
                f"mean ttft {overhead:.2f}x the oracle's; {explored:.0f} requests explored"
            )
        lines.append("")
    return lines


def run_converge(out_path: str | None = None) -> int:
    lines = report()
    text = "\n".join(lines)
    print(text)
    if out_path:
        with open(out_path, "w") as out:
            out.write(text + "\n")
    return 0
