"""What the Stats RPC answers, and the per-tenant token counts behind its hit rate.

An admin sees every figure; a tenant sees its own only (how full the tiers are with other
tenants' blocks is theirs to know, not its): its counters, its bytes per tier, its fingerprints,
its tokens. ``TokenCounts`` is fed by every lookup (``KvStoreService.record_hits``) and is safe
to share between threads.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence

from kvstore import __version__
from kvstore.keys import Fingerprint
from kvstore.server.auth import Caller
from kvstore.server.models import ModelRegistry
from kvstore.store import TieredStore
from proto import kvstore_pb2 as pb
from tiers import TierUsage


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


def stats_response(
    store: TieredStore,
    caller: Caller,
    models: ModelRegistry,
    tokens: TokenCounts,
    uptime_s: float,
    addresses: Sequence[str],
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
    return pb.StatsResponse(
        tiers=tiers,
        counters={k: v for k, v in counters.items() if v >= 0},
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
