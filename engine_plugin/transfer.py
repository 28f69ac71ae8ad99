"""Moving whole blocks between one rank's KV caches and kvstore: the arena or the data port.

    transfer = BlockTransfer(caches, layouts, fingerprint, block_bytes, same_host=True)
    loaded = transfer.fetch(kv, keys, block_ids)       # blocks restored: a prefix of keys
    transfer.store(kv, keys, block_ids, parent)        # the blocks are stored (or were already)
    transfer.compare(kv, keys, block_ids)              # per block: stored vs computed (audits)

Same host (the sidecar's Unix socket, whose client maps its arena): ``fetch`` resolves the
present prefix to arena slots, pinned under a lease, copies each slot straight into the engine's
block and releases the lease; ``store`` reserves arena slots, gathers each block's layers
straight into its slot and commits (or aborts on any failure). Remote (``host:port``): ``fetch``
reads the bytes off the data port and copies them in; ``store`` gathers each block into a host
buffer and puts them. Either way a block is one contiguous copy per layer (two for the
``kv-split`` layout: ``engine_plugin.kv_layout``), and the device copies are synchronized before
a slot is released or committed, or ``fetch``/``store`` returns.

Buffers: no view of the arena outlives a call. Errors: every ``KvStoreError`` passes to the
caller (``engine_plugin.sidecar.SidecarLink.call`` turns it into a recompute or a skipped save),
except a release that fails after a load's copies are done: the load stands, and the pin
expires on its own. Thread rules: one caller at a time (the worker's thread); ``kv`` is shared.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from engine_plugin import kv_layout
from kvstore.client import Client
from kvstore.errors import KvStoreError
from kvstore.keys import BlockKey, Fingerprint

log = logging.getLogger(f"vllm.{__name__}")


class BlockTransfer:
    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layouts: Sequence[kv_layout.LayerLayout],
        fingerprint: Fingerprint,
        block_bytes: int,
        same_host: bool,
    ) -> None:
        self._caches = list(caches)
        self._layouts = list(layouts)
        self._fingerprint = fingerprint
        self._block_bytes = block_bytes
        self._same_host = same_host

    def fetch(self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        """Restore the present prefix of ``keys`` into ``block_ids``; how many blocks."""
        if self._same_host:
            return self._fetch_from_arena(kv, keys, block_ids)
        blocks = kv.get(self._fingerprint, keys)
        for data, block_id in zip(blocks, block_ids, strict=False):
            kv_layout.scatter(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), self._block_views(block_id)
            )
        kv_layout.synchronize(self._caches)
        return len(blocks)

    def store(
        self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int], parent: BlockKey | None
    ) -> None:
        """Store blocks ``block_ids`` under ``keys``, chained after ``parent``."""
        if self._same_host:
            self._store_in_arena(kv, keys, block_ids, parent)
            return
        blocks = self._gathered(block_ids)
        kv.put(self._fingerprint, keys, [b.numpy().data for b in blocks], parent=parent)

    def compare(self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> list[float | None]:
        """Per block, how far what kvstore holds under ``keys`` is from what the engine holds in
        ``block_ids`` (computed just now): the largest absolute difference over the computed
        block's largest magnitude, both read as the caches' dtype (0.0: identical; inf: not the
        same size, not finite, or — for a non-float dtype — any byte differs). None for a block
        kvstore does not hold (the present prefix is compared)."""
        stored = self._stored_copies(kv, keys)
        computed = self._gathered(block_ids[: len(stored)])
        dtype = self._caches[0].dtype
        differences: list[float | None] = [
            _difference(a, b, dtype) for a, b in zip(stored, computed, strict=True)
        ]
        return differences + [None] * (len(block_ids) - len(computed))

    def _gathered(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Host copies of the engine's blocks ``block_ids``, the device copies synchronized."""
        blocks = [torch.empty(self._block_bytes, dtype=torch.uint8) for _ in block_ids]
        for target, block_id in zip(blocks, block_ids, strict=True):
            kv_layout.gather(self._block_views(block_id), target)
        kv_layout.synchronize(self._caches)
        return blocks

    def _stored_copies(self, kv: Client, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        """The present prefix of ``keys`` as host copies (an arena view does not outlive a call)."""
        if not self._same_host:
            return [
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                for data in kv.get(self._fingerprint, keys)
            ]
        resolved = kv.resolve(self._fingerprint, keys)
        try:
            return [torch.frombuffer(view, dtype=torch.uint8).clone() for view in resolved.views]
        finally:
            if resolved.lease_id:
                release_after_load(kv, resolved.lease_id)

    def _fetch_from_arena(self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        resolved = kv.resolve(self._fingerprint, keys)
        try:
            for view, block_id in zip(resolved.views, block_ids, strict=False):
                kv_layout.scatter(torch.frombuffer(view, dtype=torch.uint8), self._block_views(block_id))
            kv_layout.synchronize(self._caches)  # device copies done before the slots go
        finally:
            if resolved.lease_id:
                release_after_load(kv, resolved.lease_id)
        return len(resolved.views)

    def _store_in_arena(
        self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int], parent: BlockKey | None
    ) -> None:
        pending = kv.reserve(self._fingerprint, keys, [self._block_bytes] * len(keys), parent=parent)
        try:
            for view, block_id in zip(pending.views, block_ids, strict=True):
                if view is None:
                    continue  # already stored, or another writer has it
                kv_layout.gather(self._block_views(block_id), torch.frombuffer(view, dtype=torch.uint8))
            kv_layout.synchronize(self._caches)  # device copies done before the commit
        except BaseException:
            kv.abort(pending.reservation_id)
            raise
        kv.commit(pending.reservation_id)

    def _block_views(self, block_id: int) -> list[torch.Tensor]:
        return kv_layout.block_views(self._caches, self._layouts, block_id)


def release_after_load(kv: Client, lease_id: int) -> None:
    """The blocks are copied: a release that fails or runs past the load's deadline must not
    turn the load into a failure. The pin expires on its own."""
    try:
        kv.release(lease_id)
    except KvStoreError as exc:
        log.debug("releasing lease %d after a load: %s", lease_id, exc)


def _difference(stored: torch.Tensor, computed: torch.Tensor, dtype: torch.dtype) -> float:
    """See ``BlockTransfer.compare``: both are whole blocks of bytes."""
    if stored.numel() != computed.numel():
        return math.inf
    if not dtype.is_floating_point or computed.numel() % dtype.itemsize:
        return 0.0 if torch.equal(stored, computed) else math.inf
    a, b = stored.view(dtype).float(), computed.view(dtype).float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    largest = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    if largest == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / largest
