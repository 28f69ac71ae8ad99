"""Prometheus metrics of a kvstore server, named ``kvstore_<what>_<unit>[_total]``.

Request-path figures are recorded as they happen (token hit rate by tenant and tier, latency
histograms); occupancy and the store's own counters (evictions, demotions, promotions,
checksum failures) are read from the store at scrape time, so they cost nothing between
scrapes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import GC_COLLECTOR, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.store import TieredStore

log = logging.getLogger(__name__)

_LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
)
_STORE_COUNTERS = {
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
    "remote_unsealable": (
        "kvstore_remote_unsealable_blocks_total",
        "Sealed remote copies that did not open (tenant key shredded or absent): missed and deleted",
    ),
    "remote_expired": (
        "kvstore_remote_expired_blocks_total",
        "Remote copies read past their tenant's retention (or of unknown age under one): missed and deleted",
    ),
    "put_blocks": ("kvstore_stored_blocks_total", "Blocks stored"),
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
}


class _StoreCollector(Collector):
    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Any]:
        stats = self._store.stats()
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes of blocks held per tier", labels=["tier"])
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
            capacity.add_metric([usage.name], usage.capacity_bytes)
            blocks.add_metric([usage.name], usage.blocks)
            evictions.add_metric([usage.name], stats.counters.get(f"evicted_{usage.name}_blocks", 0))
            degraded.add_metric([usage.name], int(usage.degraded))
            write_failures.add_metric([usage.name], usage.write_failures)
            damaged.add_metric([usage.name], usage.damaged_moved)
            checksum_failures.add_metric([usage.name], usage.checksum_failures)
        yield from (used, capacity, blocks, evictions, degraded, write_failures, damaged, checksum_failures)
        for key, (name, doc) in _STORE_COUNTERS.items():
            family = CounterMetricFamily(name.removesuffix("_total"), doc)
            family.add_metric([], stats.counters.get(key, 0))
            yield family
        tenants = GaugeMetricFamily(
            "kvstore_namespace_bytes", "Bytes held per namespace", labels=["namespace"]
        )
        for namespace, nbytes in stats.namespace_bytes.items():
            tenants.add_metric([namespace], nbytes)
        yield tenants


class Metrics:
    """The metrics of one server; ``serve(address)`` exposes them at ``http://address/metrics``."""

    def __init__(self, store: TieredStore) -> None:
        self.registry = CollectorRegistry()
        # python_gc_collections_total{generation}: a server runs no full collection after start
        # (kvstore.server.serve.hold_full_collections)
        self.registry.register(GC_COLLECTOR)
        self.lookup_tokens = Counter(
            "kvstore_lookup_tokens_total",
            "Prompt tokens looked up, by tenant and result (hit or miss); models registered only",
            ["tenant", "result"],
            registry=self.registry,
        )
        self.lookup_blocks = Counter(
            "kvstore_lookup_blocks_total",
            "Blocks looked up, by tenant and result (hit or miss)",
            ["tenant", "result"],
            registry=self.registry,
        )
        self.hit_tokens = Counter(
            "kvstore_hit_tokens_total",
            "Tokens found in cache, by tenant and the tier holding them; models registered only",
            ["tenant", "tier"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "kvstore_request_seconds",
            "Latency of each request by its RPC method, whether gRPC or the data port carried it",
            ["method"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.restore_seconds = Histogram(
            "kvstore_restore_seconds",
            "Latency of serving blocks (Resolve same-host, Get remote)",
            ["path"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.store_seconds = Histogram(
            "kvstore_store_seconds",
            "Latency of taking blocks in (Commit same-host, Put remote)",
            ["path"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(store))
        # Children of the per-tenant counters; a dict read and write is atomic under the GIL,
        # and two threads that both miss make the same child (labels returns the one it has).
        self._by_tenant: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._by_tier: dict[tuple[str, str], Any] = {}
        self._by_method: dict[str, Any] = {}
        self._http: Any = None
        self._thread: threading.Thread | None = None

    def observe_request(self, method: str, seconds: float) -> None:
        child = self._by_method.get(method)
        if child is None:
            child = self._by_method[method] = self.request_seconds.labels(method)
        child.observe(seconds)

    def record_lookup(
        self, tenant: str, hit_blocks: int, miss_blocks: int, tiers: Sequence[str], tokens_per_block: int
    ) -> None:
        hit, miss, hit_tok, miss_tok = self._lookup_children(tenant)
        hit.inc(hit_blocks)
        miss.inc(miss_blocks)
        if tokens_per_block:
            hit_tok.inc(hit_blocks * tokens_per_block)
            miss_tok.inc(miss_blocks * tokens_per_block)
            for tier in set(tiers):
                self._hit_tokens_child(tenant, tier).inc(tiers.count(tier) * tokens_per_block)

    def _lookup_children(self, tenant: str) -> tuple[Any, Any, Any, Any]:
        """A tenant's lookup counters, found once (``labels`` takes a lock and builds a key on
        every call; a lookup asks for several)."""
        children = self._by_tenant.get(tenant)
        if children is None:
            children = self._by_tenant[tenant] = (
                self.lookup_blocks.labels(tenant, "hit"),
                self.lookup_blocks.labels(tenant, "miss"),
                self.lookup_tokens.labels(tenant, "hit"),
                self.lookup_tokens.labels(tenant, "miss"),
            )
        return children

    def _hit_tokens_child(self, tenant: str, tier: str) -> Any:
        child = self._by_tier.get((tenant, tier))
        if child is None:
            child = self._by_tier[(tenant, tier)] = self.hit_tokens.labels(tenant, tier)
        return child

    def serve(self, address: str) -> int:
        """Start the /metrics endpoint; returns the port bound (``host:0`` picks a free one)."""
        host, _, port = address.rpartition(":")
        result = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        self._http, self._thread = result if isinstance(result, tuple) else (None, None)
        bound = int(self._http.server_port) if self._http is not None else int(port)
        log.info("metrics at http://%s:%d/metrics", host or "127.0.0.1", bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
