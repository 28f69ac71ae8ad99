"""A restart's first step: index what the persistent tiers already hold, so the cache
survives restarts.

Every stored block names its scope and key in its tier key and keeps its chain depth, parent
and birth time in its metadata; a block whose key the store cannot parse, or whose fingerprint
does not match its key, is deleted (it could never be found). Called once, before the store
serves anything, so it takes no lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.store.eviction import Eviction
from kvstore.store.index import BlockIndex
from kvstore.store.model import StoreConfig, new_block, parse_meta, parse_tier_key
from tiers import Tier

log = logging.getLogger("kvstore.store")


def rebuild(tiers: Sequence[Tier], config: StoreConfig, index: BlockIndex, eviction: Eviction) -> None:
    found = 0
    for t, tier in enumerate(tiers):
        unnamed = 0
        for stored in tier.scan():
            ident = parse_tier_key(stored.key)
            if ident is None or ident[0].fingerprint != stored.fingerprint:
                unnamed += 1
                tier.delete(stored.key)
                continue
            block = index.get(ident)
            if block is None:
                depth, parent, stored_at_s = parse_meta(stored.meta)
                block = new_block(config, ident[0], ident[1], stored.size_bytes, parent, depth)
                block.tkey = stored.key
                block.stored_at_s = stored_at_s
                block.tiers.add(t)
                index.admit(block)
                eviction.touch(block)
                found += 1
            else:
                block.tiers.add(t)
                eviction.push(block)
        if unnamed:
            log.warning("tier %s held %d blocks the store cannot name; deleted them", tier.name, unnamed)
    index.order_by_age()
    if found:
        log.info("rebuilt the index: %d blocks found on persistent tiers", found)
