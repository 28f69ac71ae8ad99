"""What the client's calls return: small frozen dataclasses, and the operator's stats as a dict.

Views in ``ResolvedBlocks`` and ``PendingWrite`` are slices of the server's shared arena, mapped
into this process: valid until ``release(lease_id)``, respectively ``commit``/``abort``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proto import kvstore_pb2 as pb

TIER_NAME = {pb.TIER_HBM: "hbm", pb.TIER_DRAM: "dram", pb.TIER_NVME: "nvme", pb.TIER_REMOTE: "remote"}


@dataclass(frozen=True)
class Lookup:
    hit_blocks: int
    tiers: tuple[str, ...]
    lease_id: int
    # ``lookup_tiers(..., slots=True)`` over the Unix socket: the arena and the (offset, size)
    # of each pinned hit it holds (None: read it through ``resolve``), for ``arena_views``
    arena: str = ""
    slots: tuple[tuple[int, int] | None, ...] = ()


@dataclass(frozen=True)
class ResolvedBlocks:
    """Arena views of the present prefix; valid until ``release(lease_id)``."""

    views: list[memoryview]
    tiers: tuple[str, ...]
    lease_id: int


@dataclass(frozen=True)
class PendingWrite:
    """Arena views to fill (None: nothing to write for that key), then ``commit``."""

    views: list[memoryview | None]
    reservation_id: int


def stats_dict(r: pb.StatsResponse) -> dict[str, Any]:
    """The Stats response as plain data (what ``kvstore stats --json`` prints)."""
    return {
        "tenant": r.tenant,
        "tiers": [
            {
                "name": t.name,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "blocks": t.blocks,
                "checksum_failures": t.checksum_failures,
                "stored_bytes": t.stored_bytes,
            }
            for t in r.tiers
        ],
        "counters": dict(r.counters),
        "tenant_bytes": dict(r.tenant_bytes),
        "absent_tiers": list(r.absent_tiers),
        "blocks": r.blocks,
        "leases": r.leases,
        "version": r.version,
        "uptime_s": r.uptime_s,
        "addresses": list(r.addresses),
        "lookup_tokens": r.lookup_tokens,
        "hit_tokens": r.hit_tokens,
        "fingerprints": [
            {
                "fingerprint": f.fingerprint.hex(),
                "model_id": f.model_id,
                "blocks": f.blocks,
                "bytes": f.bytes,
                "tp_rank": f.tp_rank,
                "tp_world_size": f.tp_world_size,
            }
            for f in r.fingerprints
        ],
        "connections": dict(r.connections),
        "tenant_connections": dict(r.tenant_connections),
    }
