"""What the Stats RPC answers, and the per-tenant token counts behind its hit rate.

An admin sees every figure; a tenant sees its own only (how full the tiers are with other
tenants' blocks is theirs to know, not its): its counters, its bytes per tier, its fingerprints,
its tokens. ``TokenCounts`` is fed by every lookup (``KvStoreService.record_hits``) and is safe
to share between threads.

Every counter the store keeps is in the answer from the start, at zero until it counts (an
operator reads "0 checksum failures", not a missing line): ``counter_names`` lists them, and
tests/test_cli_reports.py checks the list against the store's code. ``Connections`` counts what
is open on each listener, for admins.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore import __version__
from kvstore.keys import Fingerprint
from kvstore.server.auth import Caller
from kvstore.server.models import ModelRegistry
from kvstore.store import TieredStore
from proto import kvstore_pb2 as pb
from tiers import TierUsage

if TYPE_CHECKING:
    from kvstore.server.dataport import DataPort

log = logging.getLogger(__name__)

# The store's counters (kvstore/store/*.py), shown at zero before they first count.
STORE_COUNTERS = (
    "lookup_hit_blocks",
    "lookup_miss_blocks",
    "get_hit_blocks",
    "get_miss_blocks",
    "put_blocks",
    "put_dedup_blocks",
    "put_doomed_blocks",
    "put_unacknowledged_blocks",
    "promotions",
    "demotions",
    "deleted_blocks",
    "invalidated_blocks",
    "fleet_invalidated_blocks",
    "invalidation_marks_written",
    "checksum_failures",
    "leases_expired",
    "reservations_expired",
    "quota_evictions",
    "quota_rejections",
    "retention_expired_blocks",
    "pace_timeouts",
    "retired_slots",
    "retired_slots_freed_unwritten",
    "cleaned_blocks",
    "write_behind_blocks",
    "write_behind_queued_blocks",
    "write_behind_dropped_blocks",
)
PER_TIER_COUNTERS = ("get_{}_blocks", "evicted_{}_blocks", "{}_refused_blocks", "{}_busy_skipped_blocks")
REMOTE_COUNTERS = (
    "remote_lookup_hit_blocks",
    "remote_filled_blocks",
    "remote_queued_blocks",
    "remote_stored_blocks",
    "remote_dropped_blocks",
    "remote_handled_blocks",
    "invalidation_ledger_losses",  # invalidations found lost (kvstore.store.ledger): failed closed
)
# Counted per namespace too (``Parts.count``): what a tenant sees of its own.
TENANT_COUNTERS = (
    "lookup_hit_blocks",
    "lookup_miss_blocks",
    "get_hit_blocks",
    "get_miss_blocks",
    "put_blocks",
    "remote_lookup_hit_blocks",
    "remote_filled_blocks",
)


def counter_names(tiers: Sequence[str], remote: bool, admin: bool = True) -> list[str]:
    """The counters a Stats answer always holds, for a store of these tiers."""
    if not admin:
        return [n for n in TENANT_COUNTERS if remote or not n.startswith("remote_")]
    names = [*STORE_COUNTERS, *(form.format(t) for t in tiers for form in PER_TIER_COUNTERS)]
    return names + list(REMOTE_COUNTERS if remote else ())


class TokenCounts:
    """Per tenant: prompt tokens looked up, and how many of them were found."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: Counter[str] = Counter()
        self._hit: Counter[str] = Counter()

    def add(self, tenant: str, asked_tokens: int, hit_tokens: int) -> None:
        with self._lock:
            self._asked[tenant] += asked_tokens
            self._hit[tenant] += hit_tokens

    def figures(self, caller: Caller) -> dict[str, int]:
        """The Stats fields: all tenants' totals for an admin, else the caller's own."""
        with self._lock:
            if caller.admin:
                return {"lookup_tokens": self._asked.total(), "hit_tokens": self._hit.total()}
            return {"lookup_tokens": self._asked[caller.tenant], "hit_tokens": self._hit[caller.tenant]}


class Connections:
    """Open connections on a server's listeners: its data port and data socket (each counts its
    own, and by tenant those past their hello), and its gRPC server's transports, which gRPC's
    channelz reports (found by the Unix socket the server listens on). Safe to share between
    threads."""

    def __init__(self, data_ports: Mapping[str, DataPort | None], grpc_socket_path: str) -> None:
        self._data_ports = {name: port for name, port in data_ports.items() if port is not None}
        self._grpc_socket_path = grpc_socket_path

    def figures(self, caller: Caller) -> tuple[dict[str, int], dict[str, int]]:
        """(open connections by listener, data connections by tenant): an admin's are all of
        them, a tenant's only its own data connections (how busy the server is with others is
        not its to know)."""
        by_listener: dict[str, int] = {}
        by_tenant: Counter[str] = Counter()
        for name, port in self._data_ports.items():
            total, tenants = port.connections()
            by_listener[name] = total
            by_tenant.update(tenants)
        if not caller.admin:
            return {}, {caller.tenant: by_tenant[caller.tenant]}
        grpc_open = grpc_transports(self._grpc_socket_path)
        if grpc_open is not None:
            by_listener["grpc"] = grpc_open
        return by_listener, dict(by_tenant)


def grpc_transports(socket_path: str) -> int | None:
    """The open transports (client connections) of the gRPC server in this process listening
    on ``socket_path``, from gRPC's channelz; None where this grpcio does not tell (channelz is
    reached through grpcio's own module: the public grpcio-channelz wraps the same calls)."""
    try:
        from grpc._cython import cygrpc

        server_id = None
        for server in json.loads(cygrpc.channelz_get_servers(0)).get("server", []):
            names = [s.get("name", "") for s in server.get("listenSocket", [])]
            if any(name.endswith(socket_path) for name in names):
                server_id = int(server["ref"]["serverId"])
        if server_id is None:
            return None
        count, start = 0, 0
        while True:
            page = json.loads(cygrpc.channelz_get_server_sockets(server_id, start, 1000))
            refs = page.get("socketRef", [])
            count += len(refs)
            if page.get("end", True) or not refs:
                return count
            start = int(refs[-1]["socketId"]) + 1
    except (ImportError, AttributeError, KeyError, TypeError, ValueError) as exc:
        log.debug("gRPC connections not counted: %s", exc)
        return None


def stats_response(
    store: TieredStore,
    caller: Caller,
    models: ModelRegistry,
    tokens: TokenCounts,
    uptime_s: float,
    addresses: Sequence[str],
    connections: Connections | None = None,
) -> pb.StatsResponse:
    stats = store.stats()
    if caller.admin:
        counters = dict(stats.counters)
        tenant_bytes = dict(stats.namespace_bytes)
        blocks = stats.blocks
        tiers = [_tier_stats(u, u.used_bytes, u.blocks, u.stored_bytes) for u in stats.tiers]
    else:
        counters = dict(stats.namespace_counters.get(caller.namespace, {}))
        tenant_bytes = {caller.namespace: stats.namespace_bytes.get(caller.namespace, 0)}
        own = store.tier_usage_of(caller.namespace)
        tiers = [_tier_stats(u, own[u.name][1], own[u.name][0], own[u.name][1]) for u in stats.tiers]
    usage = store.fingerprint_usage(None if caller.admin else caller.namespace)
    if not caller.admin:
        blocks = sum(n for n, _ in usage.values())
    shown = dict.fromkeys(counter_names([t.name for t in stats.tiers], store.has_remote, caller.admin), 0)
    shown.update(counters)
    by_listener, by_tenant = connections.figures(caller) if connections is not None else ({}, {})
    return pb.StatsResponse(
        tiers=tiers,
        counters={k: v for k, v in shown.items() if v >= 0},
        tenant_bytes=tenant_bytes,
        absent_tiers=list(stats.absent_tiers),
        blocks=blocks,
        leases=stats.leases,
        tenant=caller.tenant,
        version=__version__,
        uptime_s=uptime_s,
        addresses=list(addresses),
        **tokens.figures(caller),
        fingerprints=_fingerprint_stats(models, usage),
        connections=by_listener,
        tenant_connections=by_tenant,
    )


def _fingerprint_stats(
    models: ModelRegistry, usage: Mapping[Fingerprint, tuple[int, int]]
) -> list[pb.FingerprintStats]:
    out = []
    for fingerprint, (blocks, nbytes) in sorted(usage.items()):
        identity = models.get(fingerprint)
        out.append(
            pb.FingerprintStats(
                fingerprint=fingerprint,
                model_id=identity.model_id if identity else "",
                blocks=blocks,
                bytes=nbytes,
                tp_rank=identity.tp_rank if identity else 0,
                tp_world_size=identity.tp_world_size if identity else 0,
            )
        )
    return out


def _tier_stats(usage: TierUsage, used_bytes: int, blocks: int, stored_bytes: int) -> pb.TierStats:
    return pb.TierStats(
        name=usage.name,
        capacity_bytes=usage.capacity_bytes,
        used_bytes=used_bytes,
        blocks=blocks,
        checksum_failures=usage.checksum_failures,
        stored_bytes=stored_bytes,
    )
