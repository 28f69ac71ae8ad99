"""The tiered block store: what lives where, who may see it, and what goes when space runs out.

``TieredStore`` (``kvstore.store.core``) is the facade every transport calls; its docstring
lists the calls and their order. It builds the rooms behind it, one role each, and hands each
the others it uses in its constructor:

    model       scopes, block ids, tier keys, the index entry, config and results
    index       every block by id, namespace and parent; visibility
    eviction    prefix-aware GreedyDual-Size-Frequency victims
    pins        the one owner of pin counts, leases, and what a last release does
    placement   which tier gets a copy, making room, demotion, spill, retired arena slots
    pacing      a write's wait for a disk that is behind, outside the lock
    held        the line paced writes wait in, each holding the arena room it waited for
    governance  per-namespace quotas and retention; what stands in a new block's way
    counts      the counters, all told and per namespace
    parts       the lower rooms wired, expiry, the lock and the rule for what runs under it
    reads       lookups and restores (copies outside the lock, promotion after)
    writes      puts, and what follows a new block (write-through, -behind, cleaner, remote)
    arena       the same-host two-phase calls (resolve, reserve / commit / abort)
    behind      write-behind into the persistent tier (``CopyDown``: one block copied down)
    write_behind  the bounded queue and its thread, for both write-behinds (disk, remote)
    cleaner     a full arena's next victims copied into the disk ahead of their eviction
    remote      the fleet's remote tier: lookups past the local prefix, read-through, queue
    invalidations  the marks in the remote tier that carry an invalidation to every sidecar
    changes     what the store tells a listener about the copies it holds (KV events)
    rebuild     indexing the persistent tiers at start
    salvage     a killed server's arena blocks copied into the persistent tier
"""

from kvstore.store.core import TieredStore
from kvstore.store.model import (
    ArenaSlot,
    BlockId,
    LookupResult,
    Reservation,
    Resolved,
    Scope,
    StoreConfig,
    StoreStats,
    namespace_of_tier_key,
    parse_tier_key,
    tier_key,
)

__all__ = [
    "ArenaSlot",
    "BlockId",
    "LookupResult",
    "Reservation",
    "Resolved",
    "Scope",
    "StoreConfig",
    "StoreStats",
    "TieredStore",
    "namespace_of_tier_key",
    "parse_tier_key",
    "tier_key",
]
