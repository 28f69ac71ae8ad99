"""A restart's first step: index what the persistent tiers already hold, so the cache
survives restarts.

Every stored block names its scope and key in its tier key and keeps its chain depth, parent
and birth time in its metadata; a block whose key the store cannot parse, or whose fingerprint
does not match its key, is deleted (it could never be found). Called once, before the store
serves anything, so it takes no lock. A tier a salvage indexed at this start is taken over from
that index rather than scanned again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from kvstore.store.eviction import Eviction
from kvstore.store.index import BlockIndex
from kvstore.store.model import Block, StoreConfig, new_block, parse_meta, parse_tier_key
from tiers import Tier

log = logging.getLogger("kvstore.store")


def rebuild(
    tiers: Sequence[Tier],
    config: StoreConfig,
    index: BlockIndex,
    eviction: Eviction,
    indexed: Mapping[int, Iterable[Block]] | None = None,
) -> None:
    """``indexed``: per tier position, what that tier holds as an index built at this start
    already knows it (the salvage's, ``kvstore.store.salvage``): taken over, not scanned again."""
    found = 0
    for t, tier in enumerate(tiers):
        known = (indexed or {}).get(t)
        if known is None:
            found += index_tier(t, tier, config, index, eviction)
        else:
            for b in known:
                block = new_block(
                    config, b.scope, b.key, b.size_bytes, b.parent, b.depth, b.tkey, b.stored_at_s
                )
                found += _add(t, block, index, eviction)
    index.order_by_age()
    if found:
        log.info("rebuilt the index: %d blocks found on persistent tiers", found)


def index_tier(t: int, tier: Tier, config: StoreConfig, index: BlockIndex, eviction: Eviction) -> int:
    """Index what ``tier`` (position ``t``) holds; how many blocks were new to the index."""
    found = unnamed = 0
    for stored in tier.scan():
        ident = parse_tier_key(stored.key)
        if ident is None or ident[0].fingerprint != stored.fingerprint:
            unnamed += 1
            tier.delete(stored.key)
            continue
        depth, parent, stored_at_s = parse_meta(stored.meta)
        block = new_block(
            config, ident[0], ident[1], stored.size_bytes, parent, depth, stored.key, stored_at_s
        )
        found += _add(t, block, index, eviction)
    if unnamed:
        log.warning("tier %s held %d blocks the store cannot name; deleted them", tier.name, unnamed)
    if found:  # one line per scan of a tier that holds blocks: a start scans each once
        log.info("indexed tier %s: %d blocks", tier.name, found)
    return found


def _add(t: int, block: Block, index: BlockIndex, eviction: Eviction) -> int:
    there = index.get(block.ident)
    if there is None:
        block.tiers.add(t)
        index.admit(block)
        eviction.touch(block)
        return 1
    there.tiers.add(t)
    eviction.push(there)
    return 0
