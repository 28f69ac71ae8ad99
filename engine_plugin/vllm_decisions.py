"""One request's restore-versus-recompute decision, from the plan to its measured outcome.

    record = DecisionRecord(req_id, plan, hit_blocks, further_blocks, prompt_tokens, time.perf_counter())
    record.note_step(tokens_done)    # each scheduled step; the one reaching the prompt's end
                                     # marks it prefilled
    record.close(stats, block_size)  # once: logged and added to the stats

The scheduler side (``engine_plugin.vllm_scheduler``) opens a record at the plan and closes it
at the first connector output after the prefill was scheduled (its measured time to first
token: plan to that output), or when the request finishes first (unmeasured). Figures cover
only the blocks after those vLLM's own prefix cache held (``plan.local_tokens``).

Each record is one INFO line in the engine's log, what happened in plain words:

    request R: restore 992 tokens from dram, compute 8 (predicted 9.1 ms vs recompute 104.0 ms; measured 11.6 ms)
    request R: recompute all 1000 tokens (a full miss: none of the 31 blocks is in kvstore; predicted ...)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine_plugin.vllm_stats import KvstoreConnectorStats
from kvstore.cost_model import Plan

# Under vLLM's logger tree, so that decisions show up in the engine's own log at its level.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class DecisionRecord:
    req_id: str
    plan: Plan
    hit_blocks: int  # of the blocks after vLLM's own, those found in kvstore
    further_blocks: int  # the prompt's full blocks after vLLM's own
    prompt_tokens: int
    planned_at: float  # perf_counter at the plan
    tiers: tuple[str, ...] = ()  # per hit block, the tier it is read from
    why: str = ""  # what the plan alone cannot tell: a forced policy, a sidecar that did not answer
    prefilled: bool = False

    def note_step(self, done_tokens: int) -> None:
        """A step was scheduled that computes the request up to ``done_tokens``."""
        if done_tokens >= self.prompt_tokens:
            self.prefilled = True  # the step's output (first token) closes the record

    def close(self, stats: KvstoreConnectorStats, block_size: int) -> None:
        """Log the decision (one INFO line) and add it to ``stats``, with its measured time to
        first token."""
        plan = self.plan
        actual = time.perf_counter() - self.planned_at if self.prefilled else None
        log.info("request %s: %s", self.req_id, self.describe(block_size, actual))
        stats.add_decision(
            {
                "decision": plan.decision,
                "local_tokens": plan.local_tokens,
                "hit_tokens": self.hit_blocks * block_size,
                "restored_tokens": plan.restore_tokens,
                "predicted_ttft_s": plan.predicted_ttft_s,
                "actual_ttft_s": actual,
            }
        )

    def describe(self, block_size: int, actual_s: float | None) -> str:
        """What was decided and why, in the engine log's words: ``restore N tokens from dram
        (predicted a ms vs recompute b ms)`` or ``recompute all N tokens (the reason)``."""
        plan = self.plan
        measured = "not measured" if actual_s is None else f"measured {actual_s * 1e3:.1f} ms"
        own = plan.local_tokens
        held = f"vLLM's own cache holds {own} tokens; " if own else ""
        if plan.restore_blocks:
            restored = plan.restore_tokens
            hit = min(self.hit_blocks, plan.usable_blocks) * block_size
            what = f"{restored} tokens" if restored == hit else f"{restored} of {hit} hit tokens"
            return (
                f"{held}restore {what} from {_tiers(self.tiers[: plan.restore_blocks])}, compute "
                f"{self.prompt_tokens - own - restored} (predicted {plan.predicted_ttft_s * 1e3:.1f} ms "
                f"vs recompute {plan.all_recompute_s * 1e3:.1f} ms; {self.why + '; ' if self.why else ''}{measured})"
            )
        computed = self.prompt_tokens - own
        what = f"recompute the other {computed}" if own else f"recompute all {computed} tokens"
        reason = self._reason(block_size)
        if self.why or not reason.endswith("no faster"):
            reason += f"; predicted {plan.predicted_ttft_s * 1e3:.1f} ms"
        else:  # the plan's own reason: the two predictions side by side
            reason = reason.replace(", no faster", f" vs recompute {plan.predicted_ttft_s * 1e3:.1f} ms")
        return f"{held}{what} ({reason}; {measured})"

    def _reason(self, block_size: int) -> str:
        plan = self.plan
        own_blocks = plan.local_tokens // block_size
        restorable = max(0, (self.prompt_tokens - 1) // block_size - own_blocks)
        if self.why:
            return self.why
        if restorable == 0:
            if own_blocks:
                return "nothing to restore: vLLM's own cache holds every block but the last token's"
            return "nothing to restore: the prompt's last token is always computed"
        if self.hit_blocks == 0:
            after = " after vLLM's own" if own_blocks else ""
            if self.further_blocks == 1:
                return f"a full miss: the one block{after} is not in kvstore"
            return f"a full miss: none of the {self.further_blocks} blocks{after} is in kvstore"
        hit = plan.usable_blocks * block_size
        return (
            f"restoring the {hit} hit tokens from {_tiers(self.tiers[: plan.usable_blocks])} predicted "
            f"{plan.all_restore_s * 1e3:.1f} ms, no faster"
        )


def _tiers(tiers: tuple[str, ...]) -> str:
    """``dram``, or ``dram (20 blocks) and nvme (11)`` when they come from several."""
    counts: dict[str, int] = {}
    for tier in tiers:
        counts[tier] = counts.get(tier, 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), "kvstore")
    parts = [f"{tier} ({n} block{'s' if n > 1 else ''})" for tier, n in counts.items()]
    return ", ".join(parts[:-1]) + " and " + parts[-1]
