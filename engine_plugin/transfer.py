"""Moving whole blocks between one rank's KV caches and kvstore: the arena or the data port.

    transfer = BlockTransfer(caches, layouts, fingerprint, block_bytes, same_host=True,
                             num_blocks=num_blocks)
    loaded = transfer.fetch(kv, keys, block_ids)       # blocks restored: a prefix of keys
    transfer.store(kv, keys, block_ids, parent)        # the blocks are stored (or were already)
    transfer.compare(kv, keys, block_ids)              # per block: stored vs computed (audits)

Same host (the sidecar's Unix socket, whose client maps its arena): ``fetch`` resolves the
present prefix to arena slots, pinned under a lease, copies each slot straight into the engine's
block and releases the lease; given the slots a pinning lookup found (``InPlace``), it copies
them and checks that lookup's lease held, one round trip after the copy instead of two.
``store`` reserves arena slots, gathers each block's layers straight into its slot and commits
(or aborts on any failure). Remote (``host:port``): ``fetch`` reads the bytes off the data
port and copies them in; ``store`` gathers each block into a host buffer and puts them (with
caches on a GPU, through a pinned staging buffer of this side's, a chunk of up to
``device_copy.STAGE_BYTES`` at a time). Either way the copies are ``engine_plugin.kv_layout``'s;
on a GPU they run on the copier's own stream, and the host waits for their event (not for the
device, nor the engine's stream) before a slot is released or committed, or ``fetch``/``store``
returns, a copy that failed midway too.

Buffers: no view of the arena outlives a call. Errors: every ``KvStoreError`` passes to the
caller (``engine_plugin.sidecar.SidecarLink.call`` turns it into a recompute or a skipped save),
except a release that fails after a load's copies are done: the load stands, and the pin
expires on its own. Thread rules: one caller at a time (the worker's thread); ``kv`` is shared.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from engine_plugin import device_copy, kv_layout
from engine_plugin.host_buffers import Buffer
from kvstore.client import Client
from kvstore.errors import FailedPrecondition, KvStoreError
from kvstore.keys import BlockKey, Fingerprint

log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class InPlace:
    """Where a load's blocks lie in the sidecar's arena, pinned by someone else's lookup
    (``Client.lookup_tiers(..., slots=True)``: the connector's scheduler) under ``lease_id``,
    which this side never releases: it copies the slots and then checks the lease held."""

    arena: str
    lease_id: int
    slots: list[tuple[int, int]]  # (offset, size), one per block of the load


@dataclass
class StagedLoad:
    """A same-host load resolved, not yet copied: arena slots pinned under ``lease_id`` (this
    side's own, released by ``finish``), or under ``confirm_lease`` (an ``InPlace``'s, checked
    by ``finish``)."""

    views: list[memoryview]
    block_ids: list[int]
    tiers: tuple[str, ...]
    lease_id: int
    confirm_lease: int = 0


class BlockTransfer:
    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layouts: Sequence[kv_layout.LayerLayout],
        fingerprint: Fingerprint,
        block_bytes: int,
        same_host: bool,
        num_blocks: int,
        remote_staging: bool | None = None,
    ) -> None:
        self._caches = list(caches)
        self._layouts = list(layouts)
        self._fingerprint = fingerprint
        self._block_bytes = block_bytes
        self._same_host = same_host
        self._copier = kv_layout.BlockCopier(self._caches, self._layouts, num_blocks)
        on_gpu = any(c.is_cuda for c in self._caches)
        # Copies between the arena and caches on a GPU run by DMA only out of a mapping this
        # process registered (the sidecar's registration covers the sidecar's mapping alone).
        self._pin_arena = same_host and on_gpu
        if self._copier.block_bytes != block_bytes:
            raise ValueError(f"the caches hold {self._copier.block_bytes} B per block, not {block_bytes}")
        # Remote with caches on a GPU (``remote_staging`` None): blocks come off the data port
        # into a pinned buffer of this side's, a chunk at a time, and go to the device from
        # there, and saves the other way. Out of pageable memory CUDA stages every copy itself:
        # 7.6 against 51.6 GB/s on an H200 host (`kvstore bench device`).
        self._staging: list[memoryview] = []
        if (not same_host and on_gpu) if remote_staging is None else remote_staging:
            per = max(1, device_copy.STAGE_BYTES // block_bytes)
            host = torch.empty(per * block_bytes, dtype=torch.uint8, pin_memory=on_gpu)
            whole = host.numpy().data
            self._staging = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(per)]

    def prepare(self, kv: Client) -> bool:
        """Same host with caches on a GPU: the arena's mapping in this process registered with
        CUDA (once a client; ``Client.pin_arena_for_cuda``), so that registering is not part of
        a restore; whether it is. False otherwise: nothing to do, or copies staged by CUDA."""
        return self._pin_arena and kv.pin_arena_for_cuda()

    def fetch(
        self,
        kv: Client,
        keys: Sequence[BlockKey],
        block_ids: Sequence[int],
        in_place: InPlace | None = None,
    ) -> int:
        """Restore the present prefix of ``keys`` into ``block_ids``; how many blocks. Same host
        with ``in_place`` (every block's slot, already pinned): copy those slots, no resolve."""
        if self._same_host:
            return self._fetch_from_arena(kv, keys, block_ids, in_place)
        if self._staging:
            return self._fetch_staged(kv, keys[: len(block_ids)], block_ids)
        blocks = kv.get(self._fingerprint, keys)[: len(block_ids)]
        self._scatter(blocks, block_ids[: len(blocks)])
        return len(blocks)

    def store(
        self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int], parent: BlockKey | None
    ) -> None:
        """Store blocks ``block_ids`` under ``keys``, chained after ``parent``."""
        if self._same_host:
            self._store_in_arena(kv, keys, block_ids, parent)
            return
        if self._staging:
            self._store_staged(kv, keys, block_ids, parent)
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

    def _fetch_staged(self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        """Remote, a chunk of the staging buffer at a time: received straight into it, then
        copied in (synchronized before the buffer takes the next chunk); stops at the first miss.
        A block of another size than this layout's (a foreign or damaged writer) is refused as
        it arrives (``InvalidArgument``): a short one would leave stale bytes in its slot."""
        loaded, per = 0, len(self._staging)
        for first in range(0, len(keys), per):
            chunk = keys[first : first + per]
            got = kv.get_into(self._fingerprint, chunk, self._staging[: len(chunk)], exact=True)
            self._scatter(self._staging[:got], block_ids[first : first + got])
            loaded += got
            if got < len(chunk):
                break
        return loaded

    def _store_staged(
        self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int], parent: BlockKey | None
    ) -> None:
        """Remote, a chunk of the staging buffer at a time: gathered into it, synchronized, put
        (each chunk chained after the one before)."""
        per = len(self._staging)
        for first in range(0, len(keys), per):
            count = min(per, len(keys) - first)
            self._copier.gather(block_ids[first : first + count], self._staging[:count])
            self._copier.synchronize()
            after = parent if first == 0 else keys[first - 1]
            kv.put(self._fingerprint, keys[first : first + count], self._staging[:count], parent=after)

    def _gathered(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Host copies of the engine's blocks ``block_ids``, the device copies synchronized."""
        blocks = [torch.empty(self._block_bytes, dtype=torch.uint8) for _ in block_ids]
        self._copier.gather(block_ids, [b.numpy().data for b in blocks])
        self._copier.synchronize()
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

    def _fetch_from_arena(
        self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int], in_place: InPlace | None
    ) -> int:
        staged = self.stage(kv, keys, block_ids, in_place)
        copied = False
        try:
            self._scatter(staged.views, staged.block_ids)  # device copies done before the slots go
            copied = True
        finally:
            if not copied:
                self._settle()
            stands = self.finish(kv, staged, copied)
        if not stands:
            raise FailedPrecondition(
                f"the pin of lease {staged.confirm_lease} ended before the restore's copy was "
                "confirmed: its blocks may have been replaced, recompute them"
            )
        return len(staged.block_ids)

    # ----------------------------------------------------------------- layer-wise loads

    @property
    def layerwise(self) -> bool:
        """Whether loads can be staged and copied a layer at a time (``stage``): same host
        (into host caches, or caches on a GPU with an event per layer)."""
        return self._same_host

    def stage(
        self,
        kv: Client,
        keys: Sequence[BlockKey],
        block_ids: Sequence[int],
        in_place: InPlace | None = None,
    ) -> StagedLoad:
        """Arena slots of the present prefix of ``keys``, pinned, for ``start_by_layer`` and then
        ``finish``: resolved now, or ``in_place``'s (pinned already). Same host only."""
        self.prepare(kv)
        if in_place is not None:
            views = kv.arena_views(in_place.arena, in_place.slots[: len(block_ids)])
            tiers = ("dram",) * len(views)  # the arena is the dram tier
            staged = StagedLoad(views, list(block_ids[: len(views)]), tiers, 0, in_place.lease_id)
        else:
            resolved = kv.resolve(self._fingerprint, keys)
            views = resolved.views[: len(block_ids)]
            staged = StagedLoad(views, list(block_ids[: len(views)]), resolved.tiers, resolved.lease_id)
        try:
            self._copier.check(staged.views, staged.block_ids)
        except ValueError as exc:
            self.finish(kv, staged, copied=False)
            raise FailedPrecondition(f"cannot restore these blocks: {exc}") from exc
        return staged

    def start_by_layer(self, staged: Sequence[StagedLoad], loader: Executor) -> kv_layout.LayerCopy:
        """Start copying every block of ``staged`` into the caches a layer at a time, beside
        the forward pass (``kv_layout.BlockCopier.start_by_layer``); ``finish`` each only after
        the copy's ``wait``."""
        views = [view for one in staged for view in one.views]
        block_ids = [block_id for one in staged for block_id in one.block_ids]
        return self._copier.start_by_layer(views, block_ids, loader)

    def finish(self, kv: Client, staged: StagedLoad, copied: bool = True) -> bool:
        """The copies are done (or abandoned, not ``copied``): let go of the slots. Whether the
        copy stands: for slots pinned by another's lease, whether that lease held until now
        (held now means held throughout: a lease id is never granted again); a failed check
        raises, and the copy must be thrown away as well."""
        staged.views = []
        if staged.lease_id:
            release_after_load(kv, staged.lease_id)
        if staged.confirm_lease and copied:
            return kv.lease_held(staged.confirm_lease)
        return True

    @property
    def num_layers(self) -> int:
        return self._copier.num_layers

    def _store_in_arena(
        self, kv: Client, keys: Sequence[BlockKey], block_ids: Sequence[int], parent: BlockKey | None
    ) -> None:
        self.prepare(kv)
        pending = kv.reserve(self._fingerprint, keys, [self._block_bytes] * len(keys), parent=parent)
        try:
            wanted = [(b, v) for b, v in zip(block_ids, pending.views, strict=True) if v is not None]
            # a None view: already stored, or another writer has it
            self._copier.gather([b for b, _ in wanted], [v for _, v in wanted])
            self._copier.synchronize()  # device copies done before the commit
        except BaseException:
            self._settle()
            kv.abort(pending.reservation_id)
            raise
        kv.commit(pending.reservation_id)

    def _settle(self) -> None:
        """After a copy that failed midway: wait for whatever of it the device had started, so
        that no copy still reads a slot once its lease is let go, or writes one once its
        reservation is given back to be reused. A device that fails even that (a CUDA error
        is sticky) must not hide the first failure, which is what the caller raises."""
        try:
            self._copier.synchronize()
        except RuntimeError as exc:
            log.warning("kvstore connector: waiting for a failed copy's device work: %s", exc)

    def _scatter(self, sources: Sequence[Buffer], block_ids: Sequence[int]) -> None:
        """Copy stored blocks in, synchronized; a block of another size than this layout's (a
        foreign or damaged writer) is a ``FailedPrecondition``, for vLLM to recompute."""
        try:
            self._copier.scatter(sources, block_ids)
        except ValueError as exc:
            raise FailedPrecondition(f"cannot restore these blocks: {exc}") from exc
        self._copier.synchronize()


def release_after_load(kv: Client, lease_id: int) -> None:
    """The blocks are copied: a release that fails or runs past the load's deadline must not
    turn the load into a failure. The pin expires on its own."""
    try:
        kv.release(lease_id, wait=False)  # off the restore's path: no round trip
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
