"""One request's restore-versus-recompute decision, from the plan to its measured outcome.

    record = DecisionRecord(req_id, plan, hit_blocks, further_blocks, prompt_tokens, time.perf_counter())
    record.note_step(tokens_done)    # each scheduled step; the one reaching the prompt's end
                                     # marks it prefilled
    record.close(stats, block_size)  # once: logged and added to the stats

The scheduler side (``engine_plugin.vllm_scheduler``) opens a record at the plan and closes it
at the first connector output after the prefill was scheduled (its measured time to first
token: plan to that output), or when the request finishes first (unmeasured). Figures cover
only the blocks after those vLLM's own prefix cache held (``plan.local_tokens``).
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
    prefilled: bool = False

    def note_step(self, done_tokens: int) -> None:
        """A step was scheduled that computes the request up to ``done_tokens``."""
        if done_tokens >= self.prompt_tokens:
            self.prefilled = True  # the step's output (first token) closes the record

    def close(self, stats: KvstoreConnectorStats, block_size: int) -> None:
        """Log the decision and add it to ``stats``, with its measured time to first token."""
        plan = self.plan
        actual = time.perf_counter() - self.planned_at if self.prefilled else None
        log.info(
            "request %s: vLLM holds %d tokens; %d of %d further blocks hit, %s %d tokens: ttft "
            "predicted %.1f ms, measured %s (all-recompute predicted %.1f ms, all-restore %.1f ms)",
            self.req_id,
            plan.local_tokens,
            self.hit_blocks,
            self.further_blocks,
            plan.decision,
            plan.restore_tokens,
            plan.predicted_ttft_s * 1e3,
            "-" if actual is None else f"{actual * 1e3:.1f} ms",
            plan.all_recompute_s * 1e3,
            plan.all_restore_s * 1e3,
        )
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
