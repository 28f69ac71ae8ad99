"""Storage media for KV blocks: one module per medium, one contract for all (see ``base``).

This package imports nothing else of the project.
"""

from tiers.base import (
    BlockHeader,
    BytesLike,
    Codec,
    InPlaceTier,
    Slot,
    StoredBlock,
    Tier,
    TierKey,
    TierUsage,
    WriteQueue,
)
from tiers.errors import (
    BlockTooLarge,
    SlotBusy,
    TierBusy,
    TierClosed,
    TierCorrupt,
    TierError,
    TierFull,
    TierUnavailable,
)

__all__ = [
    "BlockHeader",
    "BlockTooLarge",
    "BytesLike",
    "Codec",
    "InPlaceTier",
    "Slot",
    "SlotBusy",
    "StoredBlock",
    "Tier",
    "TierBusy",
    "TierClosed",
    "TierCorrupt",
    "TierError",
    "TierFull",
    "TierKey",
    "TierUnavailable",
    "TierUsage",
    "WriteQueue",
]
