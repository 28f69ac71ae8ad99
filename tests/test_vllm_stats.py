"""The connector's stats: what crosses from the workers, how it adds up, what Prometheus shows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the connector's stats build on vllm's connector interfaces")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from engine_plugin.vllm_stats import KvstoreConnectorStats, KvstorePromMetrics, ObservedWork

LABELS = {"model_name": "tiny", "engine": "0"}


def _decision(
    decision: str, predicted: float, actual: float | None, restored: int = 0, local: int = 0
) -> dict[str, object]:
    return {
        "decision": decision,
        "local_tokens": local,
        "hit_tokens": 640,
        "restored_tokens": restored,
        "predicted_ttft_s": predicted,
        "actual_ttft_s": actual,
    }


def test_stats_add_up_across_workers_and_reduce() -> None:
    scheduler = KvstoreConnectorStats()
    scheduler.add_decision(_decision("restore", 0.010, 0.012, restored=608))
    scheduler.add_decision(_decision("recompute", 0.100, 0.090, local=96))
    scheduler.add_decision(_decision("partial", 0.050, None, restored=320))  # aborted before its prefill
    scheduler.add_unreachable("lookup")
    worker = KvstoreConnectorStats()
    worker.add_restore("dram", 1_000_000, 0.001)
    worker.add_failed(2)
    worker.add_saved(31)
    worker.add_failed_save(5)
    worker.add_unreachable("save")
    other_rank = KvstoreConnectorStats()
    other_rank.add_unreachable("save", 2)
    # What crosses a process boundary is ``data``; vLLM rebuilds the object from it.
    merged = (
        KvstoreConnectorStats(dict(scheduler.to_dict()))
        .aggregate(KvstoreConnectorStats(worker.to_dict()))
        .aggregate(KvstoreConnectorStats(other_rank.to_dict()))
    )
    assert isinstance(merged, KvstoreConnectorStats) and not merged.is_empty()
    assert merged.unreachable == {"lookup": 1, "save": 3}
    reduced = merged.reduce()
    assert (reduced["restore"], reduced["partial"], reduced["recompute"]) == (1, 1, 1)
    assert reduced["restored_tokens"] == 928
    assert reduced["ttft_actual_over_predicted_median"] == pytest.approx(1.2)  # of 0.9 and 1.2
    assert reduced["restore_GB_per_s"] == pytest.approx(1.0)
    assert reduced["failed_blocks"] == 2
    assert (reduced["saved_blocks"], reduced["failed_save_blocks"]) == (31, 5)
    assert (reduced["sidecar_unreachable"], reduced["local_tokens"]) == (4, 96)
    merged.reset()
    assert merged.is_empty()
    alone = KvstoreConnectorStats()
    alone.add_unreachable("load")
    assert not alone.is_empty()  # a refused call alone is worth reporting
    older, newer = KvstoreConnectorStats(), KvstoreConnectorStats()
    older.set_calibration({"dram": (1e9, 0.001)}, (0.0, 0.001, 0.0))
    newer.set_calibration({"dram": (2e9, 0.001)}, (0.0, 0.0005, 0.0))
    assert not newer.is_empty()  # a calibration alone is worth reporting
    latest = older.aggregate(newer)
    assert isinstance(latest, KvstoreConnectorStats)
    assert (
        latest.calibration["tiers"]["dram"][0] == 2e9
        and latest.reduce()["predicted_prefill_1k_tokens_ms"] == 512
    )


def test_worker_observations_concatenate() -> None:
    a = ObservedWork([("dram", 10, 0.1)], [(0, 512, 0.2)])
    b = ObservedWork([("nvme", 20, 0.3)], [])
    both = a.aggregate(b)
    assert isinstance(both, ObservedWork)
    assert both.transfers == [("dram", 10, 0.1), ("nvme", 20, 0.3)] and both.prefills == [(0, 512, 0.2)]


def test_prometheus_series() -> None:
    metrics = KvstorePromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        list(LABELS),
        {0: list(LABELS.values())},
    )
    stats = KvstoreConnectorStats()
    stats.add_decision(_decision("restore", 0.010, 0.015, restored=608, local=64))
    stats.add_restore("nvme", 4096, 0.002)
    stats.add_failed(3)
    stats.add_saved(7)
    stats.add_failed_save(2)
    stats.add_unreachable("lookup", 2)
    stats.add_unreachable("save")
    stats.set_calibration({"dram": (2e9, 0.0005)}, (0.002, 0.0004, 1e-8))
    metrics.observe(stats.to_dict())

    def value(name: str, **extra: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**LABELS, **extra})

    assert value("kvstore_connector_decisions_total", decision="restore") == 1
    assert value("kvstore_connector_restored_tokens_total") == 608
    assert value("kvstore_connector_hit_tokens_total") == 640
    assert value("kvstore_connector_actual_ttft_seconds_sum", decision="restore") == pytest.approx(0.015)
    assert value("kvstore_connector_ttft_actual_over_predicted_sum", decision="restore") == pytest.approx(1.5)
    assert value("kvstore_connector_restored_bytes_total", tier="nvme") == 4096
    assert value("kvstore_connector_load_failed_blocks_total") == 3
    assert value("kvstore_connector_local_tokens_total") == 64
    assert value("kvstore_connector_saved_blocks_total") == 7
    assert value("kvstore_connector_failed_save_blocks_total") == 2
    assert value("kvstore_connector_sidecar_unreachable_total", call="lookup") == 2
    assert value("kvstore_connector_sidecar_unreachable_total", call="save") == 1
    assert value("kvstore_connector_tier_bandwidth_bytes_per_second", tier="dram") == 2e9
    assert value("kvstore_connector_tier_latency_seconds", tier="dram") == 0.0005
    assert value("kvstore_connector_prefill_token_seconds") == 0.0004
    assert value("kvstore_connector_prefill_token_context_seconds") == 1e-8
    # A second engine in the same process registers the same names without an error.
    KvstorePromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        list(LABELS),
        {0: list(LABELS.values())},
    )
    assert value("kvstore_connector_decisions_total", decision="restore") is None  # fresh series
