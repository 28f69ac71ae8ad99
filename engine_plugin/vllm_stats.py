"""What the kvstore connector tells vLLM about its decisions and transfers.

Two channels, both vLLM's own:

- ``ObservedWork`` (a ``KVConnectorWorkerMetadata``) goes from the worker-side connector to the
  scheduler-side one after every step: the measured restores (tier, bytes, seconds) and the
  measured prefill of a step that computed one request (prefix tokens, new tokens, seconds). The
  scheduler folds them into its ``Calibration``, so the next plan uses them.
- ``KvstoreConnectorStats`` (a ``KVConnectorStats``) goes to vLLM's stat loggers: every decision
  with its predicted and measured time to first token, and every restore. vLLM prints the
  reduced figures in its periodic log line and, through ``KvstorePromMetrics``, exports them on
  its ``/metrics`` endpoint (and in ``LLM.get_metrics()``) as

      kvstore_connector_decisions_total{decision="restore"|"partial"|"recompute"}
      kvstore_connector_hit_tokens_total, kvstore_connector_restored_tokens_total
                                    (both: only tokens beyond what vLLM's own prefix cache held)
      kvstore_connector_local_tokens_total          (prompt tokens vLLM's prefix cache held)
      kvstore_connector_predicted_ttft_seconds, kvstore_connector_actual_ttft_seconds
      kvstore_connector_ttft_actual_over_predicted   (histograms, by decision)
      kvstore_connector_restored_bytes_total{tier}, kvstore_connector_restore_seconds{tier}
      kvstore_connector_load_failed_blocks_total
      kvstore_connector_saved_blocks_total, kvstore_connector_failed_save_blocks_total
      kvstore_connector_audited_blocks_total{result="agree"|"mismatch"}
      kvstore_connector_audit_difference     (histogram: per audited block, the largest difference
                                              between stored and recomputed KV over the block's
                                              largest magnitude)
      kvstore_connector_restores_disabled    (gauge: 1 once an audit found a mismatch)
      kvstore_connector_sidecar_unreachable_total{call="lookup"|"load"|"save"|"release"|"audit"}
                                    (calls that timed out, found no sidecar, or were not made
                                     while the circuit breaker was open)
      kvstore_connector_tier_bandwidth_bytes_per_second{tier},
      kvstore_connector_tier_latency_seconds{tier},
      kvstore_connector_prefill_{fixed,token,token_context}_seconds  (gauges: what the cost model
                                                                     uses now, online updates in)

Both are plain data (lists and numbers), so they cross process boundaries with vLLM's own
serialization when the scheduler and the workers run in different processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

DECISIONS = ("restore", "partial", "recompute")
TTFT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
RATIO_BUCKETS = [0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0]
AUDIT_BUCKETS = [0.0, 1e-6, 1e-4, 1e-3, 4e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0]


@dataclass
class ObservedWork(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Measurements of one step on the workers, for the scheduler's calibration."""

    transfers: list[tuple[str, int, float]] = field(default_factory=list)  # tier, bytes, seconds
    prefills: list[tuple[int, int, float]] = field(default_factory=list)  # prefix, new tokens, seconds
    # req_id, blocks that agree, blocks that do not, the largest difference seen
    audits: list[tuple[str, int, int, float]] = field(default_factory=list)
    # the prefill probe at the worker's start (engine_plugin.prefill_probe): seconds a token
    prefill_per_token_s: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, ObservedWork):
            # Tensor-parallel ranks move their own shards at the same time: one restore each;
            # they compute together, at the pace of the slowest.
            return ObservedWork(
                self.transfers + other.transfers,
                self.prefills + other.prefills,
                self.audits + other.audits,
                max(self.prefill_per_token_s, other.prefill_per_token_s),
            )
        return self

    def __bool__(self) -> bool:
        return bool(self.transfers or self.prefills or self.audits or self.prefill_per_token_s)


def _empty() -> dict[str, Any]:
    return {
        "decisions": [],
        "restores": [],
        "failed_blocks": 0,
        "saved_blocks": 0,
        "failed_save_blocks": 0,
        "unreachable": {},
        "calibration": {},
        "audited": {},  # "agree" | "mismatch" -> blocks
        "audit_differences": [],
        "restores_off": False,
    }


class KvstoreConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """``data`` holds ``decisions`` (dicts: decision, local_tokens, hit_tokens, restored_tokens,
    predicted_ttft_s, actual_ttft_s), ``restores`` ([tier, bytes, seconds]), ``failed_blocks``
    (loads), ``saved_blocks`` and ``failed_save_blocks`` (ints), ``unreachable`` (call -> sidecar
    calls failed or not made) and ``calibration`` (the cost model's current inputs, or empty)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data or {})
        for key, value in _empty().items():
            self.data.setdefault(key, value)

    def reset(self) -> None:
        self.data = _empty()

    def take(self) -> KvstoreConnectorStats | None:
        """What was gathered since the last take, as a new object (None: nothing), and start
        over. This object keeps gathering, so what is bound to it (a sidecar link's
        ``on_unreachable``) counts into the next report."""
        if self.is_empty():
            return None
        taken = KvstoreConnectorStats(self.data)
        self.reset()
        return taken

    @property
    def calibration(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.data["calibration"])

    def set_calibration(
        self, tiers: dict[str, tuple[float, float]], prefill: tuple[float, float, float]
    ) -> None:
        """``tiers``: name -> (bandwidth bytes/s, latency s); ``prefill``: (fixed, per token,
        per token-pair) seconds."""
        self.data["calibration"] = {"tiers": {k: list(v) for k, v in tiers.items()}, "prefill": list(prefill)}

    @property
    def decisions(self) -> list[dict[str, Any]]:
        return cast(list[dict[str, Any]], self.data["decisions"])

    @property
    def restores(self) -> list[list[Any]]:
        return cast(list[list[Any]], self.data["restores"])

    @property
    def failed_blocks(self) -> int:
        return int(cast(int, self.data["failed_blocks"]))

    @property
    def saved_blocks(self) -> int:
        return int(cast(int, self.data["saved_blocks"]))

    @property
    def failed_save_blocks(self) -> int:
        return int(cast(int, self.data["failed_save_blocks"]))

    @property
    def unreachable(self) -> dict[str, int]:
        return cast(dict[str, int], self.data["unreachable"])

    def add_decision(self, record: dict[str, Any]) -> None:
        self.decisions.append(record)

    def add_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        self.restores.append([tier, nbytes, seconds])

    def add_failed(self, blocks: int) -> None:
        """Blocks whose load failed (vLLM recomputes them)."""
        self.data["failed_blocks"] = self.failed_blocks + blocks

    def add_saved(self, blocks: int) -> None:
        self.data["saved_blocks"] = self.saved_blocks + blocks

    def add_failed_save(self, blocks: int) -> None:
        self.data["failed_save_blocks"] = self.failed_save_blocks + blocks

    def add_unreachable(self, call: str, calls: int = 1) -> None:
        self.unreachable[call] = self.unreachable.get(call, 0) + calls

    @property
    def audited(self) -> dict[str, int]:
        return cast(dict[str, int], self.data["audited"])

    @property
    def audit_differences(self) -> list[float]:
        return cast(list[float], self.data["audit_differences"])

    def add_audit(self, agree: int, mismatch: int, differences: list[float]) -> None:
        for result, blocks in (("agree", agree), ("mismatch", mismatch)):
            if blocks:
                self.audited[result] = self.audited.get(result, 0) + blocks
        self.audit_differences.extend(differences)

    def set_restores_off(self) -> None:
        self.data["restores_off"] = True

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, KvstoreConnectorStats):
            self.decisions.extend(other.decisions)
            self.restores.extend(other.restores)
            self.add_failed(other.failed_blocks)
            self.add_saved(other.saved_blocks)
            self.add_failed_save(other.failed_save_blocks)
            for call, calls in other.unreachable.items():
                self.add_unreachable(call, calls)
            self.add_audit(
                other.audited.get("agree", 0), other.audited.get("mismatch", 0), other.audit_differences
            )
            if other.data["restores_off"]:
                self.set_restores_off()
            if other.calibration:
                self.data["calibration"] = other.calibration  # the latest one counts
        return self

    def is_empty(self) -> bool:
        return not (
            self.decisions
            or self.restores
            or self.failed_blocks
            or self.saved_blocks
            or self.failed_save_blocks
            or self.unreachable
            or self.calibration
            or self.audited
            or self.data["restores_off"]
        )

    def reduce(self) -> dict[str, int | float]:
        decisions = self.decisions
        out: dict[str, int | float] = {d: sum(1 for r in decisions if r["decision"] == d) for d in DECISIONS}
        out["restored_tokens"] = sum(int(r["restored_tokens"]) for r in decisions)
        out["local_tokens"] = sum(int(r.get("local_tokens", 0)) for r in decisions)
        ratios = sorted(
            r["actual_ttft_s"] / r["predicted_ttft_s"]
            for r in decisions
            if r.get("actual_ttft_s") and r["predicted_ttft_s"] > 0
        )
        if ratios:
            out["ttft_actual_over_predicted_median"] = round(ratios[len(ratios) // 2], 3)
        seconds = sum(float(s) for _, _, s in self.restores)
        if seconds > 0:
            out["restore_GB_per_s"] = round(sum(int(b) for _, b, _ in self.restores) / seconds / 1e9, 3)
        out["failed_blocks"] = self.failed_blocks
        out["saved_blocks"] = self.saved_blocks
        out["failed_save_blocks"] = self.failed_save_blocks
        out["sidecar_unreachable"] = sum(self.unreachable.values())
        if self.audited:
            out["audited_agree"] = self.audited.get("agree", 0)
            out["audited_mismatch"] = self.audited.get("mismatch", 0)
        if self.calibration:
            fixed, token, pair = self.calibration["prefill"]
            out["predicted_prefill_1k_tokens_ms"] = round(
                (fixed + 1024 * token + pair * 1024 * 1024 / 2) * 1e3, 1
            )
        return out


class KvstorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        by_decision = [*labelnames, "decision"]
        by_tier = [*labelnames, "tier"]
        by_call = [*labelnames, "call"]

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            return self._counter_cls(name=f"kvstore_connector_{name}", documentation=doc, labelnames=labels)

        def histogram(name: str, doc: str, labels: list[str], buckets: list[float]) -> Any:
            return self._histogram_cls(
                name=f"kvstore_connector_{name}", documentation=doc, buckets=buckets, labelnames=labels
            )

        def gauge(name: str, doc: str, labels: list[str]) -> Any:
            return self._gauge_cls(
                name=f"kvstore_connector_{name}",
                documentation=doc,
                labelnames=labels,
                multiprocess_mode="mostrecent",
            )

        self.decisions = counter(
            "decisions", "Restore-versus-recompute decisions of the kvstore connector.", by_decision
        )
        self.hit_tokens = counter(
            "hit_tokens", "Prompt tokens found in kvstore beyond what vLLM held itself.", labelnames
        )
        self.restored_tokens = counter(
            "restored_tokens", "Prompt tokens the plan chose to restore from kvstore.", labelnames
        )
        self.local_tokens = counter(
            "local_tokens", "Prompt tokens vLLM's own prefix cache held (not looked up).", labelnames
        )
        self.predicted = histogram(
            "predicted_ttft_seconds",
            "Time to first token the cost model predicted for its plan.",
            by_decision,
            TTFT_BUCKETS_S,
        )
        self.actual = histogram(
            "actual_ttft_seconds",
            "Measured time from the plan to the end of the request's prefill.",
            by_decision,
            TTFT_BUCKETS_S,
        )
        self.ratio = histogram(
            "ttft_actual_over_predicted",
            "Measured over predicted time to first token, per decision.",
            by_decision,
            RATIO_BUCKETS,
        )
        self.restored_bytes = counter(
            "restored_bytes", "Bytes restored from kvstore into the engine's KV cache.", by_tier
        )
        self.restore_seconds = histogram(
            "restore_seconds", "Duration of one request's restore from kvstore.", by_tier, TTFT_BUCKETS_S
        )
        self.failed = counter(
            "load_failed_blocks", "Blocks whose restore failed and were recomputed instead.", labelnames
        )
        self.saved = counter("saved_blocks", "Blocks saved to kvstore after the forward pass.", labelnames)
        self.failed_saves = counter(
            "failed_save_blocks", "Blocks not saved: the save failed or the sidecar was out.", labelnames
        )
        self.unreachable = counter(
            "sidecar_unreachable",
            "Sidecar calls that timed out or failed, or were not made while the breaker was open.",
            by_call,
        )
        self.audited = counter(
            "audited_blocks",
            "Restorable blocks recomputed instead and compared with what kvstore holds.",
            [*labelnames, "result"],
        )
        self.audit_difference = histogram(
            "audit_difference",
            "Per audited block: largest |stored - recomputed| over the block's largest magnitude.",
            labelnames,
            AUDIT_BUCKETS,
        )
        self.restores_disabled = gauge(
            "restores_disabled",
            "1 once an audit found stored KV that differs: no restores, no saves.",
            labelnames,
        )
        self.tier_bandwidth = gauge(
            "tier_bandwidth_bytes_per_second",
            "Restore bandwidth per tier the cost model uses now (calibrated, updated online).",
            by_tier,
        )
        self.tier_latency = gauge(
            "tier_latency_seconds", "Fixed restore latency per tier the cost model uses now.", by_tier
        )
        self.prefill = [
            gauge(
                f"prefill_{what}_seconds",
                f"Prefill model coefficient the cost model uses now: {doc}.",
                labelnames,
            )
            for what, doc in (
                ("fixed", "fixed time per prefill"),
                ("token", "time per new token"),
                ("token_context", "time per (new token, earlier token) pair of attention"),
            )
        ]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for record in transfer_stats_data.get("decisions", []):
            decision = record["decision"]
            self.decisions.labels(*labels, decision).inc()
            self.hit_tokens.labels(*labels).inc(record["hit_tokens"])
            self.restored_tokens.labels(*labels).inc(record["restored_tokens"])
            self.local_tokens.labels(*labels).inc(record.get("local_tokens", 0))
            self.predicted.labels(*labels, decision).observe(record["predicted_ttft_s"])
            actual = record.get("actual_ttft_s")
            if actual:
                self.actual.labels(*labels, decision).observe(actual)
                if record["predicted_ttft_s"] > 0:
                    self.ratio.labels(*labels, decision).observe(actual / record["predicted_ttft_s"])
        for tier, nbytes, seconds in transfer_stats_data.get("restores", []):
            self.restored_bytes.labels(*labels, tier).inc(nbytes)
            self.restore_seconds.labels(*labels, tier).observe(seconds)
        if transfer_stats_data.get("failed_blocks"):
            self.failed.labels(*labels).inc(transfer_stats_data["failed_blocks"])
        if transfer_stats_data.get("saved_blocks"):
            self.saved.labels(*labels).inc(transfer_stats_data["saved_blocks"])
        if transfer_stats_data.get("failed_save_blocks"):
            self.failed_saves.labels(*labels).inc(transfer_stats_data["failed_save_blocks"])
        for call, calls in transfer_stats_data.get("unreachable", {}).items():
            self.unreachable.labels(*labels, call).inc(calls)
        for result, blocks in transfer_stats_data.get("audited", {}).items():
            self.audited.labels(*labels, result).inc(blocks)
        for difference in transfer_stats_data.get("audit_differences", []):
            self.audit_difference.labels(*labels).observe(difference)
        if transfer_stats_data.get("restores_off"):
            self.restores_disabled.labels(*labels).set(1)
        calibration = transfer_stats_data.get("calibration")
        if calibration:
            for tier, (bandwidth, latency) in calibration["tiers"].items():
                self.tier_bandwidth.labels(*labels, tier).set(bandwidth)
                self.tier_latency.labels(*labels, tier).set(latency)
            for metric, value in zip(self.prefill, calibration["prefill"], strict=True):
                metric.labels(*labels).set(value)


def _unregister_previous() -> None:
    """A second engine in one process (tests) registers the same names again."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith("kvstore_connector_"):
            REGISTRY.unregister(collector)
