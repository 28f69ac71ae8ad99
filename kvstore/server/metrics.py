"""Prometheus metrics of a kvstore server, named ``kvstore_<what>_<unit>[_total]``.

Request-path figures are recorded as they happen (token hit rate by tenant and tier, latency
histograms); the store's figures (every one ``kvstore stats`` shows, kvstore.server.metrics_store)
are read at scrape time, so they cost nothing between scrapes. Beside them: the process
(``process_*``: CPU, memory, file descriptors, start time), ``python_gc_*`` and
``kvstore_build_info``. The port also answers probes (kvstore.server.metrics_http).
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Sequence
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from kvstore import __version__
from kvstore.server.metrics_http import MetricsHttpServer
from kvstore.server.metrics_store import ConnectionFigures, ConnectionsCollector, StoreCollector
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


class Metrics:
    """The metrics of one server. ``serve(address)`` starts the metrics port (kvstore.server.
    metrics_http) before the store opens, so ``/healthz`` answers and ``/readyz`` says "starting"
    while it does; ``watch(store)`` adds the store's figures once it is open; ``state`` is what
    ``/readyz`` reports ("starting", "ready", "draining")."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.state = "starting"
        self.port = 0  # bound by serve
        # python_gc_collections_total{generation}: a server runs no full collection after start
        # (kvstore.server.serve.hold_full_collections)
        self.registry.register(GC_COLLECTOR)
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds,
        # process_max_fds, process_start_time_seconds (uptime), process_virtual_memory_bytes
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)  # python_info{version,implementation}
        build = Gauge(
            "kvstore_build_info",
            "Always 1; its labels say which kvstore and which Python this server runs",
            ["version", "python"],
            registry=self.registry,
        )
        build.labels(__version__, platform.python_version()).set(1)
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
        # Children of the per-tenant counters; a dict read and write is atomic under the GIL,
        # and two threads that both miss make the same child (labels returns the one it has).
        self._by_tenant: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._by_tier: dict[tuple[str, str], Any] = {}
        self._by_method: dict[str, Any] = {}
        self._http = MetricsHttpServer(self.registry, lambda: self.state)

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

    def watch(self, store: TieredStore) -> None:
        """Export the store's figures (kvstore.server.metrics_store) from the next scrape on."""
        self.registry.register(StoreCollector(store))

    def watch_connections(self, figures: ConnectionFigures) -> None:
        """Export open connections (``figures``: by listener, by tenant) from the next scrape on."""
        self.registry.register(ConnectionsCollector(figures))

    def serve(self, address: str) -> int:
        """Start the metrics port on ``address`` (``host:port``, ``host:0``, or ``"auto"``); the
        port bound. Raises OSError or ValueError when it cannot be bound."""
        self.port = self._http.start(address)
        log.info("metrics at %s/metrics, probes at /healthz and /readyz", self._http.url)
        return self.port

    @property
    def url(self) -> str:
        """``http://host:port`` of the metrics port, once serving."""
        return self._http.url

    def close(self) -> None:
        self._http.close()
