"""The tiered block store: what lives where, who may see it, and what goes when space runs out.

``TieredStore`` (``kvstore.store.core``) is the facade every transport calls; its docstring
lists the calls and their order. The rooms behind it, one role each:

    model       scopes, block ids, tier keys, the index entry, config and results
    index       every block by id, namespace and parent; visibility
    eviction    prefix-aware GreedyDual-Size-Frequency victims
    pins        the one owner of pin counts, leases, and what a last release does
    placement   which tier gets a copy, making room, demotion, spill
    held        the line paced writes wait in, each holding the arena room it waited for
    governance  per-namespace quotas and retention
    arena       the same-host two-phase calls (resolve, reserve / commit / abort)
    rebuild     indexing the persistent tiers at start
    parts       the wiring, and the rule for what runs under the lock
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
