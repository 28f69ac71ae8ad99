"""vLLM's KV cache events on the wire, for the sidecar's publisher and the router's subscriber.

The structs mirror ``vllm.distributed.kv_events`` (vLLM 0.32) field for field, so vLLM's own
decoder reads what kvstore publishes and kvstore reads what vLLM publishes, without importing
vLLM here: a ``KVEventBatch`` is a msgpack array ``[ts, events, data_parallel_rank]`` and each
event a map tagged ``"type"`` with its class name. ZMQ framing, as vLLM's ``ZmqEventPublisher``
sends it: three frames ``(topic, sequence, payload)``, the sequence an 8-byte big-endian count
of batches (a gap means batches were lost). ``tests/test_kv_events.py`` decodes with vLLM's
own types.

What the sidecar's events carry (see docs/events.md): ``block_hashes`` are kvstore block keys
(32 bytes, ``kvstore.keys``: chained from a root that mixes the model fingerprint and cache salt,
so a key names model + salt + whole prefix), ``parent_block_hash`` the key of the block before
the first one, ``token_ids`` empty (the sidecar stores keys, not tokens), ``block_size`` the
model's tokens per block where an engine registered it (else 0), ``medium`` the tier: ``GPU``
(hbm), ``CPU`` (dram), ``STORAGE`` (nvme); ``locality`` ``LOCAL``, ``ownership`` ``kvstore``.

Needs msgspec (the ``events`` extra, with pyzmq).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

# vLLM's medium names (vllm.distributed.kv_events.MEDIUM_*) for kvstore's tier names
MEDIUM_OF_TIER = {"hbm": "GPU", "dram": "CPU", "nvme": "STORAGE"}
OWNERSHIP = "kvstore"
LOCAL = "LOCAL"
_TIER_OF_MEDIUM = {medium: tier for tier, medium in MEDIUM_OF_TIER.items()}
_FASTEST_FIRST = tuple(MEDIUM_OF_TIER.values())  # GPU, CPU, STORAGE


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class SidecarIndex:
    """What one sidecar holds, by key, kept from its feed: copies per medium (the same key held
    for two tenants is two copies). A sequence that starts over (a restarted sidecar) empties
    it; a gap is counted. Not thread-safe: its user locks."""

    def __init__(self) -> None:
        self.copies: dict[bytes | int, Counter[str]] = {}
        self.last_seq = -1
        self.gaps = 0

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        if seq <= self.last_seq:  # the sequence started over: a restarted sidecar
            self.copies.clear()
        elif self.last_seq >= 0 and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                for key in event.block_hashes:
                    self.copies.setdefault(key, Counter())[event.medium or ""] += 1
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    held = self.copies.get(key)
                    if held is None:
                        continue
                    held[event.medium or ""] -= 1
                    if held[event.medium or ""] <= 0:
                        del held[event.medium or ""]
                    if not held:
                        del self.copies[key]
            elif isinstance(event, AllBlocksCleared):
                self.copies.clear()

    def prefix_tiers(self, keys: Sequence[bytes | int]) -> tuple[str, ...]:
        """The tier of each leading key held (its fastest copy), up to the first not held."""
        out: list[str] = []
        for key in keys:
            held = self.copies.get(key)
            if not held:
                break
            medium = next((m for m in _FASTEST_FIRST if held.get(m)), next(iter(held)))
            out.append(_TIER_OF_MEDIUM.get(medium, medium.lower()))
        return tuple(out)


def sequence_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def sequence_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)  # vLLM's replay end marker is -1


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    return msgspec.msgpack.Decoder(KVEventBatch)
