"""Restore versus recompute: how many leading tokens of a prefix hit to load, from measurements.

Pure functions over measured inputs; no I/O, no engine. The connector feeds them the tier of
each hit block, the bytes per block, the calibrated cost of each tier and of prefill, and acts
on the returned ``Plan``.

The engine may already hold the prompt's first ``L`` tokens itself (its own prefix cache, a
whole number of blocks): those are neither restored nor counted, and the hits are the blocks
after them. Time to first token when the first ``k`` of those hit blocks are restored and the
rest is computed:

    ttft(k) = load(k) + prefill(prefix = L + k * B, suffix = n - L - k * B)
    load(k) = sum over tiers used by blocks < k of the tier's fixed latency
            + sum over blocks i < k of block_bytes / bandwidth(tier of block i)
    prefill(p, s) = fixed + per_token * s + per_token_context * s * (2p + s) / 2

The last term is attention: each new token attends to everything before it, so computing ``s``
tokens after a prefix of ``p`` costs about s * (p + s / 2) token-pairs. ``plan_restore`` takes
the ``k`` (0 .. hit blocks) with the smallest predicted ttft: zero when loading loses, a partial
prefix when later blocks sit in a slow tier. Ties go to the smaller ``k`` (less I/O).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TierCost:
    """What moving bytes out of one tier into the engine costs."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0  # paid once per request that reads from the tier
    decode_bytes_per_s: float = math.inf  # a codec on the way (zstd): its decode speed

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or not self.decode_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError(f"tier cost needs positive bandwidths and a non-negative latency: {self}")

    def seconds_per_byte(self) -> float:
        return 1.0 / self.bandwidth_bytes_per_s + 1.0 / self.decode_bytes_per_s


@dataclass(frozen=True)
class PrefillModel:
    """Prefill time of ``suffix`` new tokens after ``prefix`` cached ones (see module docstring)."""

    fixed_s: float
    per_token_s: float
    per_token_context_s: float = 0.0

    def seconds(self, prefix_tokens: int, suffix_tokens: int) -> float:
        if suffix_tokens <= 0:
            return self.fixed_s
        s, p = suffix_tokens, prefix_tokens
        return self.fixed_s + self.per_token_s * s + self.per_token_context_s * s * (2 * p + s) / 2


@dataclass(frozen=True)
class Plan:
    restore_blocks: int
    restore_tokens: int
    predicted_ttft_s: float
    predicted_load_s: float
    predicted_prefill_s: float
    all_recompute_s: float  # predicted ttft with nothing restored (what the engine's own cache leaves)
    all_restore_s: float  # predicted ttft with every hit block restored
    usable_blocks: int  # hit blocks that could be restored (the last prompt token is computed)
    local_tokens: int = 0  # leading tokens the engine held itself: not part of any figure above

    @property
    def decision(self) -> str:
        """``recompute``, ``restore`` (every hit block) or ``partial``."""
        if self.restore_blocks == 0:
            return "recompute"
        return "restore" if self.restore_blocks == self.usable_blocks else "partial"


def plan_restore(
    hit_tiers: Sequence[str],
    block_bytes: int,
    tokens_per_block: int,
    prompt_tokens: int,
    tiers: Mapping[str, TierCost],
    prefill: PrefillModel,
    restore_blocks: int | None = None,
    local_tokens: int = 0,
) -> Plan:
    """The number of leading hit blocks to restore that minimizes predicted time to first token,
    or, with ``restore_blocks`` given, the prediction for restoring that many (capped at what is
    usable; benchmarks force a policy this way and still record what the model expected).

    ``local_tokens`` (a multiple of ``tokens_per_block``) is what the engine already holds at
    the prompt's head; ``hit_tiers[i]`` is the tier holding the i-th block after it (the hits
    follow it without a gap). At least one token is always computed (the engine needs a last
    token to sample from), so a hit covering the whole prompt is restored at most to
    ``prompt_tokens - 1``.
    """
    curve = ttft_curve(hit_tiers, block_bytes, tokens_per_block, prompt_tokens, tiers, prefill, local_tokens)
    if restore_blocks is None:
        best_k = min(range(len(curve)), key=lambda k: (curve[k][1], k))  # ties: less I/O
    else:
        best_k = max(0, min(restore_blocks, len(curve) - 1))
    load, ttft = curve[best_k]
    return Plan(
        restore_blocks=best_k,
        restore_tokens=best_k * tokens_per_block,
        predicted_ttft_s=ttft,
        predicted_load_s=load,
        predicted_prefill_s=ttft - load,
        all_recompute_s=curve[0][1],
        all_restore_s=curve[-1][1],
        usable_blocks=len(curve) - 1,
        local_tokens=local_tokens,
    )


# Exploration (``explore``): a plan the calibration got wrong stays wrong when only the chosen
# side is ever measured (a recompute measures no restore bandwidth). Where the other side is
# predicted within EXPLORE_BAND of the chosen one (up to 2x its time), EXPLORE_FRACTION of
# the requests take it instead. What that costs is bounded: where the prediction is right, an
# explored request takes at most 1 + EXPLORE_BAND times as long, so the requests near the
# crossover take at most EXPLORE_FRACTION * EXPLORE_BAND (5%) longer on average, and less the
# nearer they are (at the crossover itself, nothing); elsewhere nothing is explored.
EXPLORE_FRACTION = 0.05
EXPLORE_BAND = 1.0


def explore(
    plan: Plan, draw: float, fraction: float = EXPLORE_FRACTION, band: float = EXPLORE_BAND
) -> int | None:
    """The restore blocks to take instead of ``plan``'s, or None to follow it. ``draw`` is a
    uniform random number in [0, 1) (the caller's seeded generator, for repeatable tests).

    The other side of recomputing is restoring every usable block; that of restoring (every
    block or a part), recomputing.
    Taken when ``draw < fraction`` and its predicted time is within ``(1 + band)`` times the
    plan's: near the crossover, where a wrong calibration can put the plan on the wrong side."""
    if plan.usable_blocks == 0 or not draw < fraction:
        return None
    if plan.restore_blocks == 0:
        other, other_s = plan.usable_blocks, plan.all_restore_s
    else:
        other, other_s = 0, plan.all_recompute_s
    if other_s > (1 + band) * plan.predicted_ttft_s:
        return None
    return other


def ttft_curve(
    hit_tiers: Sequence[str],
    block_bytes: int,
    tokens_per_block: int,
    prompt_tokens: int,
    tiers: Mapping[str, TierCost],
    prefill: PrefillModel,
    local_tokens: int = 0,
) -> list[tuple[float, float]]:
    """``(load_s, ttft_s)`` for restoring k = 0 .. usable hit blocks after ``local_tokens``."""
    if tokens_per_block <= 0 or block_bytes < 0 or prompt_tokens < 0:
        raise ValueError("tokens_per_block must be positive, sizes non-negative")
    if local_tokens < 0 or local_tokens % tokens_per_block:
        raise ValueError(f"local_tokens is a whole number of blocks, got {local_tokens}")
    local_blocks = local_tokens // tokens_per_block
    usable = min(len(hit_tiers), max(0, max(0, prompt_tokens - 1) // tokens_per_block - local_blocks))
    for tier in hit_tiers[:usable]:
        if tier not in tiers:
            raise KeyError(f"no cost calibrated for tier {tier!r}")
    curve = [(0.0, prefill.seconds(local_tokens, prompt_tokens - local_tokens))]
    load = 0.0
    seen: set[str] = set()
    for k in range(1, usable + 1):
        cost = tiers[hit_tiers[k - 1]]
        if hit_tiers[k - 1] not in seen:
            seen.add(hit_tiers[k - 1])
            load += cost.latency_s
        load += block_bytes * cost.seconds_per_byte()
        held = local_tokens + k * tokens_per_block
        curve.append((load, load + prefill.seconds(held, prompt_tokens - held)))
    return curve


# Used until a calibration file says otherwise (``kvstore bench calibrate``), fastest first:
# restoring from dram beats recomputing; the fleet's remote tier is another host, read through.
DEFAULT_TIERS = {
    "hbm": TierCost(50e9, 0.0001),
    "dram": TierCost(5e9, 0.0005),
    "nvme": TierCost(1e9, 0.001),
    "remote": TierCost(0.5e9, 0.002),
}
# The fixed part is an engine's cost of a request before its first token whatever its length:
# 11-13 ms with vLLM CPU for a restored prompt of the tiny test model (2 ms before, which made
# a first restore's prediction 2-8x short). The per-token part differs by model and device
# beyond any default; the connector fits both from its first timed prefills.
DEFAULT_PREFILL = PrefillModel(fixed_s=0.010, per_token_s=0.0004, per_token_context_s=0.0)
