"""The scheduler's lookup across tensor-parallel ranks: each rank's sidecar is asked for its
shard's hit (pinned under a lease, with arena slots); a block is usable only when every rank
holds it, so the hit is the shortest over the ranks and, per block, the slowest tier any rank
holds it in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_plugin.transfer import InPlace
from kvstore.client import Client, Lookup
from kvstore.cost_model import DEFAULT_TIERS
from kvstore.keys import BlockKey, Fingerprint

PIN_TTL_S = 30.0  # a pin outlives a stalled engine by this much at most

_TIER_ORDER = {name: i for i, name in enumerate(DEFAULT_TIERS)}  # fastest first


@dataclass(frozen=True)
class RankHit:
    hit_blocks: int  # the shortest hit over the ranks: a block is usable only with every shard
    tiers: tuple[str, ...]  # per block, the slowest tier any rank holds it in
    lookups: tuple[Lookup, ...] = ()  # per rank, as the sidecar answered (leases, arena slots)

    @property
    def lease_ids(self) -> tuple[int, ...]:
        return tuple(lookup.lease_id for lookup in self.lookups if lookup.lease_id)


NO_HIT = RankHit(0, ())
UNANSWERED = RankHit(0, ())  # no hit because the sidecar did not say (told apart by identity)


def in_place_slots(lookups: Sequence[Lookup], n: int) -> list[InPlace | None]:
    """Per rank, the first ``n`` blocks of its pinned hit as arena slots, when the arena holds
    every one of them (else None: that rank's worker resolves them)."""
    out: list[InPlace | None] = []
    for lookup in lookups:
        slots = lookup.slots[:n]
        held = [slot for slot in slots if slot is not None]
        whole = bool(lookup.lease_id) and len(held) == n
        out.append(InPlace(lookup.arena, lookup.lease_id, held) if whole else None)
    return out


def lookup_ranks(
    kv: Client, fingerprints: Sequence[Fingerprint], rank_keys: Sequence[Sequence[BlockKey]]
) -> RankHit:
    # A failure after some ranks answered leaves their pins to expire (PIN_TTL_S): releasing
    # them would wait on the same sidecar that just failed.
    lookups = [
        kv.lookup_tiers(fp, keys, pin_ttl_s=PIN_TTL_S, slots=True)
        for fp, keys in zip(fingerprints, rank_keys, strict=True)
    ]
    hit = min(lookup.hit_blocks for lookup in lookups)
    tiers = tuple(
        max((lookup.tiers[i] for lookup in lookups), key=lambda t: _TIER_ORDER.get(t, len(_TIER_ORDER)))
        for i in range(hit)
    )
    return RankHit(hit, tiers, tuple(lookups))
