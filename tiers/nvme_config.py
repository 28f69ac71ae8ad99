"""The ``nvme`` tier's settings: ``NvmeConfig``, which is also the server's ``[nvme]`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tiers.base import Codec
from tiers.codec import DEFAULT_ZSTD_LEVEL

MiB = 1 << 20

Durability = Literal["cache", "durable"]


@dataclass(frozen=True)
class NvmeConfig:
    """The LMDB tier on local disk: the long tail below the arena, and what survives a restart."""

    enabled: bool = True  # keep an nvme tier
    path: str = ""  # its folder, which the tier owns; "": <data_dir>/nvme
    capacity_bytes: int = 16 << 30  # bytes of blocks it may hold (the LMDB map is sparse and larger)
    # cache: fast flags, synced every sync_interval_s (a power loss loses the writes since);
    # durable: every transaction synced. No torn block is readable in either
    durability: Durability = "cache"
    sync_interval_s: float = 1.0  # how often cache mode syncs
    # zstd-byteplane compresses only the high bytes of bf16 values
    codec: Codec = Codec.NONE
    zstd_level: int = DEFAULT_ZSTD_LEVEL  # zstd level for the codecs
    encryption_keys_dir: str = ""  # AES-256-GCM at rest, a key file per tenant here; "" = off
    batch_max_blocks: int = 64  # puts committed in one write transaction, at most
    batch_max_bytes: int = 32 * MiB  # bytes committed in one write transaction, at most
    # Puts queued for the disk; beyond: refused as busy (also what the buffer pool keeps for reuse)
    max_pending_bytes: int = 64 * MiB
    map_size_bytes: int = 0  # the LMDB map (sparse); 0: 2 * capacity_bytes + 64MiB
    throttle_bytes_per_s: int = 0  # benchmarks only: emulate a slower tier; 0 = off

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"nvme.capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.durability not in ("cache", "durable"):
            raise ValueError(f"nvme.durability must be 'cache' or 'durable', got {self.durability!r}")
        if self.sync_interval_s <= 0 or self.batch_max_blocks <= 0 or self.batch_max_bytes <= 0:
            raise ValueError("nvme.sync_interval_s, batch_max_blocks and batch_max_bytes must be positive")
        if self.max_pending_bytes <= 0:
            raise ValueError(f"nvme.max_pending_bytes must be positive, got {self.max_pending_bytes}")
        if self.map_size_bytes and self.map_size_bytes < self.capacity_bytes:
            raise ValueError("nvme.map_size_bytes must be at least nvme.capacity_bytes")

    @property
    def effective_map_size_bytes(self) -> int:
        if self.map_size_bytes:
            return self.map_size_bytes
        return 2 * self.capacity_bytes + 64 * MiB
