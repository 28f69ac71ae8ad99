"""The store's figures as Prometheus metrics, read at scrape time (nothing between scrapes).

Every figure ``kvstore stats`` shows an admin has a series here, under the name in
``COUNTERS`` and ``GAUGES`` or, for a counter this table does not know yet, under
``kvstore_<counter>_total``, so a new counter is never missing from /metrics. Counters and gauges
of the table are exported from the first scrape, at 0 where nothing happened (the remote tier's
ones too, on a store with none), so dashboards and alert rules always find their series; the
others from the first scrape too where ``kvstore stats`` shows them at 0 (``counter_names``).

Left out, on purpose: blocks and bytes per model (``kvstore stats``' fingerprint table). Counting
them walks every block under the store's lock (170-500 ms over a 500k-block index, measured on the
2-core development machine), which every scrape would make every request wait for; ``kvstore
stats`` counts them on demand. Uptime and version are ``process_start_time_seconds`` and
``kvstore_build_info`` (kvstore.server.metrics).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.server.stats import counter_names
from kvstore.store import StoreStats, TieredStore

# counter key in StoreStats.counters -> (metric name, help)
COUNTERS = {
    "demotions": ("kvstore_demotions_total", "Blocks moved down a tier on eviction"),
    "promotions": ("kvstore_promotions_total", "Blocks copied up a tier on a hit"),
    "checksum_failures": (
        "kvstore_checksum_failures_total",
        "Blocks that failed their checksum (miss + delete)",
    ),
    "quota_evictions": ("kvstore_quota_evictions_total", "Blocks dropped to keep a tenant within its quota"),
    "quota_rejections": ("kvstore_quota_rejections_total", "Puts refused because a quota was full of pins"),
    "leases_expired": ("kvstore_leases_expired_total", "Leases that ran out before release"),
    "invalidated_blocks": ("kvstore_invalidated_blocks_total", "Blocks removed by Invalidate"),
    "put_blocks": ("kvstore_stored_blocks_total", "Blocks stored"),
    "put_unacknowledged_blocks": (
        "kvstore_put_unacknowledged_blocks_total",
        "Blocks a put placed straight into nvme's write queue (no arena room) that nvme had not "
        "committed within the 2 s pace: stored later, but not counted in the put's answer",
    ),
    "pace_timeouts": (
        "kvstore_pace_timeouts_total",
        "Writes that waited the longest allowed for a disk that was behind (their victims then dropped)",
    ),
    "nvme_busy_skipped_blocks": (
        "kvstore_nvme_busy_skipped_blocks_total",
        "Blocks not demoted into nvme because its write queue was full: dropped from the tier above",
    ),
    "retired_slots_freed_unwritten": (
        "kvstore_arena_slots_freed_unwritten_total",
        "Arena slots let go before nvme had written their blocks (a disk behind past the pace): "
        "a kill -9 then would lose those blocks",
    ),
    # The remote tier: the store's queue of copies to send, then the backend's own figures
    "remote_queued_blocks": (
        "kvstore_remote_queued_blocks_total",
        "Blocks queued to be copied to the remote tier",
    ),
    "remote_stored_blocks": ("kvstore_remote_stored_blocks_total", "Blocks the remote tier took"),
    "remote_dropped_blocks": (
        "kvstore_remote_dropped_blocks_total",
        "Blocks never copied to the remote tier (its queue full, or the remote refused): local only",
    ),
    "remote_gets": ("kvstore_remote_get_blocks_total", "Blocks asked of the remote tier"),
    "remote_hits": ("kvstore_remote_hit_blocks_total", "Blocks the remote tier served"),
    "remote_puts": ("kvstore_remote_put_blocks_total", "Blocks the remote backend stored"),
    "remote_failures": (
        "kvstore_remote_failures_total",
        "Remote calls (or a node's share of one) that failed: timeouts, refusals, nodes down",
    ),
    "remote_checksum_failures": (
        "kvstore_remote_checksum_failures_total",
        "Remote copies that failed their checksum: missed and deleted",
    ),
    "remote_unsealable": (
        "kvstore_remote_unsealable_blocks_total",
        "Sealed remote copies that did not open (tenant key shredded or absent): missed and deleted",
    ),
    "remote_expired": (
        "kvstore_remote_expired_blocks_total",
        "Remote copies read past their tenant's retention (or of unknown age under one): missed and deleted",
    ),
}
# Figures among the counters that go down as well as up
GAUGES = {
    "remote_nodes": ("kvstore_remote_nodes", "Shared-store nodes configured for the remote tier"),
    "remote_nodes_down": (
        "kvstore_remote_nodes_down",
        "Remote nodes in backoff now (their last call failed): their share of blocks misses",
    ),
}
_PER_TIER = re.compile(r"evicted_(\w+)_blocks")  # kvstore_evictions_total{tier}
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


class StoreCollector(Collector):
    """A scrape's view of one store; ``collect`` runs on the HTTP server's threads."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        stats = self._store.stats()
        yield from _tier_families(stats)
        for key, (name, doc) in COUNTERS.items():
            counter = CounterMetricFamily(name.removesuffix("_total"), doc)
            counter.add_metric([], stats.counters.get(key, 0))
            yield counter
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats.counters.get(key, 0))
        named = {name for name, _ in (*COUNTERS.values(), *GAUGES.values())}
        # at zero before they first count, as kvstore stats shows them
        counters = dict.fromkeys(counter_names([t.name for t in stats.tiers], self._store.has_remote), 0)
        counters.update(stats.counters)
        for key in sorted(counters.keys() - COUNTERS.keys() - GAUGES.keys()):
            name = f"kvstore_{_NOT_A_NAME.sub('_', key)}_total"
            if not _PER_TIER.fullmatch(key) and name not in named:
                counter = CounterMetricFamily(
                    name.removesuffix("_total"), f"The store's counter {key} (kvstore stats)"
                )
                counter.add_metric([], counters[key])
                yield counter
        yield GaugeMetricFamily(
            "kvstore_blocks", "Blocks held (each counted once, whatever tiers hold it)", value=stats.blocks
        )
        yield GaugeMetricFamily(
            "kvstore_leases", "Leases open now (blocks pinned for a reader)", value=stats.leases
        )
        absent = GaugeMetricFamily(
            "kvstore_tier_absent",
            "1 for each tier the server runs without: reason configuration (turned off) or failed "
            "(no CUDA, no room, a failed open); the log and kvstore stats say why",
            labels=["tier", "reason"],
        )
        for line in stats.absent_tiers:  # "<tier>: <why>"
            reason = "configuration" if "disabled in the configuration" in line else "failed"
            absent.add_metric([line.partition(":")[0], reason], 1)
        yield absent
        namespaces = GaugeMetricFamily(
            "kvstore_namespace_bytes", "Bytes held per namespace", labels=["namespace"]
        )
        for namespace, nbytes in stats.namespace_bytes.items():
            namespaces.add_metric([namespace], nbytes)
        yield namespaces


def _tier_families(stats: StoreStats) -> Iterator[Metric]:
    used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes of blocks held per tier", labels=["tier"])
    stored = GaugeMetricFamily(
        "kvstore_tier_stored_bytes", "Bytes on each tier's medium (after its codec, if any)", labels=["tier"]
    )
    capacity = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
    blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks held per tier", labels=["tier"])
    evictions = CounterMetricFamily("kvstore_evictions", "Blocks evicted from each tier", labels=["tier"])
    degraded = GaugeMetricFamily(
        "kvstore_tier_degraded",
        "1 while a tier takes no writes (its file system is full or read-only); reads go on",
        labels=["tier"],
    )
    write_failures = CounterMetricFamily(
        "kvstore_tier_write_failures",
        "Blocks a tier could not write (no room, read-only, a failed commit): dropped or refused",
        labels=["tier"],
    )
    damaged = CounterMetricFamily(
        "kvstore_tier_damaged_moved",
        "Damaged environments a tier moved aside at start (kept for inspection) before starting empty",
        labels=["tier"],
    )
    checksum_failures = CounterMetricFamily(
        "kvstore_tier_checksum_failures",
        "Blocks a tier found changed, torn or under another key (a miss, deleted); dram counts "
        "those it checks before serving them to another server",
        labels=["tier"],
    )
    for usage in stats.tiers:
        used.add_metric([usage.name], usage.used_bytes)
        stored.add_metric([usage.name], usage.stored_bytes)
        capacity.add_metric([usage.name], usage.capacity_bytes)
        blocks.add_metric([usage.name], usage.blocks)
        evictions.add_metric([usage.name], stats.counters.get(f"evicted_{usage.name}_blocks", 0))
        degraded.add_metric([usage.name], int(usage.degraded))
        write_failures.add_metric([usage.name], usage.write_failures)
        damaged.add_metric([usage.name], usage.damaged_moved)
        checksum_failures.add_metric([usage.name], usage.checksum_failures)
    yield from (
        used,
        stored,
        capacity,
        blocks,
        evictions,
        degraded,
        write_failures,
        damaged,
        checksum_failures,
    )


ConnectionFigures = Callable[[], tuple[Mapping[str, int], Mapping[str, int]]]


class ConnectionsCollector(Collector):
    """Open connections as ``kvstore stats`` counts them (kvstore.server.stats.Connections): by
    listener, and by tenant on the data port and socket; ``figures`` gives (by listener, by
    tenant) and is safe to call from the HTTP server's threads."""

    def __init__(self, figures: ConnectionFigures) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        by_listener, by_tenant = self._figures()
        listeners = GaugeMetricFamily(
            "kvstore_connections",
            "Open connections by listener (data port, data socket, grpc where this grpcio tells)",
            labels=["listener"],
        )
        for listener, count in by_listener.items():
            listeners.add_metric([listener], count)
        tenants = GaugeMetricFamily(
            "kvstore_tenant_connections", "Data-port and data-socket connections by tenant", labels=["tenant"]
        )
        for tenant, count in by_tenant.items():
            tenants.add_metric([tenant], count)
        yield from (listeners, tenants)
