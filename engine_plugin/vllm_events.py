"""vLLM KV cache events for the blocks the connector saved to kvstore, carried by vLLM's own
publisher (``--kv-events-config``), as vLLM's LMCache connector does.

The path of one event, when vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``):

1. scheduler, ``build_connector_meta``: a save job gets its blocks' ``BlockStored`` events
   (``SavedBlockEvents.announce``), built as vLLM's block pool builds its own: vLLM's block hashes
   of the request (``request.block_hashes``), the parent block's hash, the token ids, the LoRA,
   the extra keys; ``medium="CPU"`` (the sidecar's arena), ``ownership="kvstore"``;
2. worker, ``wait_for_save``: a save that stored its blocks keeps its events; vLLM collects them
   with ``get_kv_connector_kv_cache_events`` (``worker_events``) after the step;
3. scheduler, ``update_connector_output``: vLLM has combined every worker's events; ``collect``
   keeps only those every worker reported (each tensor-parallel rank stores its own shard: a
   block is restorable only once every rank stored it), and ``take`` (the connector's
   ``take_events``) hands them to vLLM's publisher.

So a router that indexes vLLM's events (llm-d, Dynamo, AIBrix) learns, under the hashes it
already computes, which prefixes this engine can restore from kvstore. Evictions inside kvstore
are not announced here (the sidecar's own feed has them, under kvstore's keys: docs/events.md).

Threads: the scheduler side runs on vLLM's scheduler thread, the worker side on each worker's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from engine_plugin.sidecar_feed import SidecarFeed

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from engine_plugin.vllm_scheduler import SchedulerSide

MEDIUM = "CPU"  # what the connector saves to: the sidecar's dram arena
OWNERSHIP = "kvstore"


class KvstoreKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """vLLM's container of a step's connector events, counted per worker."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> KvstoreKVEvents:
        """Keep only the events every worker reported."""
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._aggregator.get_all_events())

    def get_number_of_workers(self) -> int:
        return int(self._aggregator.get_number_of_workers())

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


def worker_events(events: list[Any]) -> KvstoreKVEvents | None:
    """One worker's events of a step, for vLLM's ``get_kv_connector_kv_cache_events``."""
    if not events:
        return None
    out = KvstoreKVEvents(1)
    out.add_events(events)
    return out


class SavedBlockEvents:
    """The scheduler side's events: see the module docstring."""

    def __init__(self, block_size: int, locality: str, feed: SidecarFeed | None = None) -> None:
        self._block_size = block_size
        self._locality = locality
        self._feed = feed  # the sidecar's own feed: its evictions of announced blocks
        self._requests: dict[str, Request] = {}
        self._ready: list[KVCacheEvent] = []

    def track(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def announce(self, req_id: str, first: int, last: int, keys: Sequence[bytes] = ()) -> list[Any]:
        """A ``BlockStored`` for blocks [first, last) of the request, or none where vLLM has not
        hashed them (a request it never showed the connector); ``keys``: their kvstore keys (rank
        0), watched on the sidecar's feed."""
        request = self._requests.get(req_id)
        if request is None or len(request.block_hashes) < last or last <= first:
            return []
        size = self._block_size
        hashes = request.block_hashes
        if self._feed is not None:
            for key, block_hash in zip(keys, hashes[first:last], strict=False):
                self._feed.watch(bytes(key), maybe_convert_block_hash(block_hash))
        lora = request.lora_request
        extra = [
            generate_block_hash_extra_keys(request, i * size, (i + 1) * size, 0)[0]
            for i in range(first, last)
        ]
        return [
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
                parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                token_ids=list(request.all_token_ids[first * size : last * size]),
                block_size=size,
                lora_id=lora.adapter_id if lora else None,
                medium=MEDIUM,
                lora_name=lora.name if lora else None,
                extra_keys=to_event_extra_keys(extra) if any(e is not None for e in extra) else None,
                group_idx=0,
                locality=self._locality,
                ownership=OWNERSHIP,
            )
        ]

    def collect(self, events: object) -> None:
        """``update_connector_output``: the step's events, which vLLM combined over the workers;
        only those every worker reported are kept."""
        if isinstance(events, KvstoreKVEvents):
            self._ready.extend(events.aggregate().get_all_events())

    def take(self) -> list[KVCacheEvent]:
        """``take_events``: what was collected since the last call, and the announced blocks the
        sidecar let go meanwhile."""
        ready, self._ready = self._ready, []
        removed = self._feed.take_removed() if self._feed is not None else []
        if removed:
            ready.append(
                BlockRemoved(
                    block_hashes=removed,
                    medium=MEDIUM,
                    group_idx=0,
                    locality=self._locality,
                    ownership=OWNERSHIP,
                )
            )
        return ready

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()


def saved_block_events(
    vllm_config: VllmConfig, scheduler: SchedulerSide | None, block_size: int, same_host: bool
) -> SavedBlockEvents | None:
    """The scheduler side's events, wired into its save jobs, where vLLM publishes KV events."""
    config = vllm_config.kv_events_config
    if scheduler is None or config is None or not config.enable_kv_cache_events:
        return None
    endpoint = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("sidecar_events")
    feed = SidecarFeed(str(endpoint)) if endpoint else None
    events = SavedBlockEvents(block_size, "LOCAL" if same_host else "REMOTE", feed)
    scheduler.announce = events.announce
    return events
