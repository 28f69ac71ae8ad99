"""What the connector's scheduler side tells its workers each step (vLLM's connector metadata).

``engine_plugin.vllm_scheduler`` builds one ``KvstoreConnectorMetadata`` per step in
``build_connector_meta``; vLLM binds it on every worker before the step's forward pass, where
``engine_plugin.vllm_worker`` reads it (loads before the forward pass, saves, audits and the
step's timing after it). It is plain data (lists, ints, strings, bytes): vLLM serializes it to worker
processes. Every tensor-parallel rank gets the same metadata and moves only its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_plugin.transfer import InPlace
from kvstore.keys import BlockKey

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError as exc:  # pragma: no cover - only without vllm installed
    raise ImportError("engine_plugin.vllm_metadata needs vllm (pip install 'kvstore[vllm]')") from exc


@dataclass
class TransferJob:
    """One request's blocks to load into, or save out of, the engine's KV caches."""

    req_id: str
    rank_keys: list[list[BlockKey]]  # per tensor-parallel rank: each rank stores its own shard
    block_ids: list[int]  # the engine's blocks, one per key
    timeout_s: float  # the worker's deadline for it (engine_plugin.sidecar says how it is chosen)
    parents: list[BlockKey | None] = field(default_factory=list)  # saves: per rank, the chain's parent
    tiers: tuple[str, ...] = ()  # loads: where the scheduler saw each block (slowest over ranks)
    # loads: beside the steps (engine_plugin.async_loads), the request waiting in vLLM for it
    asynchronous: bool = False
    # loads: per rank, its blocks' arena slots when the arena holds every one (else None: resolve)
    in_place: list[InPlace | None] = field(default_factory=list)
    # saves, where vLLM publishes KV events: vLLM's BlockStored for these blocks, handed back to
    # vLLM once stored (engine_plugin.vllm_events)
    announce: list[Any] = field(default_factory=list)


@dataclass
class KvstoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[TransferJob] = field(default_factory=list)  # asynchronous ones too
    saves: list[TransferJob] = field(default_factory=list)
    # blocks just computed that kvstore also holds: compare the two (``audit_fraction``)
    audits: list[TransferJob] = field(default_factory=list)
    # (tokens computed before this step, tokens computed in it) of every scheduled request
    steps: list[tuple[int, int]] = field(default_factory=list)
