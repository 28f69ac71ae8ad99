"""The connector's worker side: the engine's KV caches, loads and saves, timing observations.

One ``WorkerSide`` per tensor-parallel rank, in that rank's worker process; vLLM calls it from
its model-runner thread only (no locks), in this order:

    register_kv_caches(kv_caches)       once, before any step
    step_started()                      each step, as its metadata is bound (before the forward)
    start_load_kv(meta)                 before the forward pass: the step's loads (or after
                                        it, when all of them are asynchronous)
    wait_for_save(meta)                 after it: the step's saves, audits and prefill timing
    get_finished()                      the asynchronous loads done since the last step
    build_connector_worker_meta()       the step's measurements, for the scheduler's calibration
    get_block_ids_with_load_errors()    the blocks vLLM must recompute
    get_stats()                         the figures since the last call, for vLLM's stat loggers

Loads and saves move only this rank's shard (its keys in each ``TransferJob``), through one
``engine_plugin.transfer.BlockTransfer`` (the arena on the same host, the data port otherwise),
inside the link's deadline for each job. An asynchronous load (``TransferJob.asynchronous``)
goes to ``engine_plugin.async_loads.AsyncLoader``, with a link and a ``BlockTransfer`` of its
own, and is counted here once done. Every failure — sidecar down or hung, block missing,
corrupt — leaves the blocks not loaded to vLLM's recompute (``get_block_ids_with_load_errors``),
never wrong output; a save that fails is skipped and counted.

Audits (``audit_fraction``): for an audited request the scheduler planned no load; once its
blocks are computed, each is compared with the block kvstore holds under the same key
(``BlockTransfer.compare``); one that differs by more than ``audit_tolerance`` is a mismatch.

Measurements (``ObservedWork``): every load whose blocks came from one tier (tier, bytes,
seconds), and the forward pass of a step that prefills one request alone (prefix tokens, new
tokens, seconds: the step's time from ``step_started`` to ``wait_for_save`` less its loads).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_plugin import kv_layout
from engine_plugin.async_loads import AsyncLoader
from engine_plugin.prefill_probe import ModelShapes, probe_per_token_s
from engine_plugin.sidecar import SidecarLink
from engine_plugin.transfer import BlockTransfer, InPlace, StagedLoad
from engine_plugin.vllm_metadata import KvstoreConnectorMetadata, TransferJob
from engine_plugin.vllm_stats import KvstoreConnectorStats, ObservedWork
from kvstore.client import Client
from kvstore.keys import ModelIdentity

log = logging.getLogger(f"vllm.{__name__}")

# Registering the arena's mapping with CUDA pins every page of it: 1.05-1.29 s for 4 GiB on an
# H200 host (`kvstore bench device`), so a minute covers ~200 GiB; it happens once an engine.
PIN_ARENA_S = 60.0
# After a step that ran nothing, how long to wait for an asynchronous load to end: a request
# arriving meanwhile waits this much more at most.
IDLE_WAIT_S = 0.01


class WorkerSide:
    """See the module docstring. ``link`` reports its failed calls into ``stats``."""

    def __init__(
        self,
        link: SidecarLink,
        stats: KvstoreConnectorStats,
        identity: ModelIdentity,
        rank: int,
        same_host: bool,
        num_blocks: int | None,
        audit_tolerance: float = 0.0,
        layerwise: bool = False,
        shapes: ModelShapes | None = None,
        load_connect: Callable[[], Client] | None = None,
    ) -> None:
        self._link = link
        self._load_connect = load_connect  # the asynchronous loads' client (None: loads in the step)
        self._async: AsyncLoader | None = None
        self._done_inline: set[str] = set()  # asynchronous loads run in the step (no loader)
        self._shapes = shapes  # the model's linear layers, for the prefill probe at start
        self._layerwise = layerwise  # same-host loads copy a layer at a time (on a GPU: events)
        self._loading: _Loading | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._layer_index: dict[str, int] = {}
        self._audit_tolerance = audit_tolerance  # an audited block differing by more: a mismatch
        self._stats = stats
        self._identity = identity
        self._rank = rank
        self._same_host = same_host
        self._num_blocks = num_blocks  # of the engine's KV cache config; else the caches' shape
        self._transfer: BlockTransfer | None = None
        self._load_errors: set[int] = set()
        self._observed = ObservedWork()
        self.kv_events: list[Any] = []  # vLLM events of blocks saved since vLLM last took them
        self._step_started = 0.0  # when this step's metadata arrived (before its forward)
        self._step_load_s = 0.0  # time this step spent restoring

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        num_blocks = self._num_blocks or caches[0].shape[0]
        layouts = [kv_layout.describe(cache, num_blocks) for cache in caches]
        layer_bytes = sum(layout.block_bytes for layout in layouts)
        if layer_bytes != self._identity.block_bytes:
            raise ValueError(
                f"registered KV caches hold {layer_bytes} B per block, the fingerprint's layout "
                f"{self._identity.block_bytes} B: unsupported cache layout"
            )
        fingerprint = self._identity.fingerprint()
        self._transfer = BlockTransfer(caches, layouts, fingerprint, layer_bytes, self._same_host, num_blocks)
        if self._load_connect is not None:
            own = BlockTransfer(caches, layouts, fingerprint, layer_bytes, self._same_host, num_blocks)
            address = self._link.address
            self._async = AsyncLoader(address, self._load_connect, self._identity, own, self._rank)
        if self._same_host and caches[0].is_cuda:
            # Registering the arena's mapping with CUDA faults it all in: here, not in a restore.
            pinned = self._link.call("pinning the arena", PIN_ARENA_S, self._transfer.prepare)
            if self._async is not None:  # its client maps the arena too
                pinned = self._async.prepare(PIN_ARENA_S) and pinned
            log.info(
                "kvstore connector: the arena's mapping %s", "is pinned" if pinned else "is not pinned yet"
            )
        log.info(
            "kvstore connector: %d layers (%s) on %s, %d B per block",
            len(caches),
            ", ".join(sorted({layout.kind for layout in layouts})),
            caches[0].device,
            layer_bytes,
        )
        if self._shapes is not None:
            # The scheduler's starting prefill curve: the built-in one is 3-20x off by model.
            per_token = probe_per_token_s(self._shapes, caches[0].device)
            self._observed.prefill_per_token_s = per_token
            log.info(
                "kvstore connector: prefill probe: %.3g ms a token in the linear layers", per_token * 1e3
            )

    def step_started(self) -> None:
        # vLLM binds the step's metadata before the forward pass, while start_load_kv runs
        # after it when nothing is to be loaded: the step's clock starts here.
        self._step_started, self._step_load_s = time.perf_counter(), 0.0

    def start_load_kv(self, meta: KvstoreConnectorMetadata) -> None:
        started = time.perf_counter()
        transfer = self._registered()
        loads = []
        for load in meta.loads:
            if load.asynchronous and self._async is not None:
                self._async.start(load)
            else:
                loads.append(load)
        # vLLM waits for an asynchronous load to be reported even when it ran in the step
        self._done_inline.update(load.req_id for load in loads if load.asynchronous)
        if self._layerwise and transfer.layerwise and loads:
            self._stage_layerwise(loads)
            self._step_load_s += time.perf_counter() - started
            return
        for load in loads:
            start = time.perf_counter()
            loaded = self._load(load)
            self._count_load(load, loaded, time.perf_counter() - start)
        self._step_load_s += time.perf_counter() - started

    def get_finished(self, idle: bool = False) -> set[str]:
        """The requests whose asynchronous loads ended since the last call, restored or not:
        the blocks not restored are in this step's ``get_block_ids_with_load_errors``. After a
        step that ran nothing (``idle``: every request waits for its KV) it waits a little for
        one to end (``AsyncLoader.wait_any``) instead of letting vLLM spin."""
        done, self._done_inline = self._done_inline, set()
        if self._async is None:
            return done
        if idle:
            self._async.wait_any(IDLE_WAIT_S)
        for one in self._async.finished():
            self._count_load(one.job, one.loaded, one.seconds)
            done.add(one.job.req_id)
        while not self._async.unreachable.empty():
            self._stats.add_unreachable(self._async.unreachable.get())
        return done

    def _count_load(self, load: TransferJob, loaded: int, seconds: float) -> None:
        """The blocks not restored become load errors; a restore is counted and timed."""
        if loaded < len(load.block_ids):
            self._load_errors.update(load.block_ids[loaded:])
            self._stats.add_failed(len(load.block_ids) - loaded)
        if loaded:
            tier = load.tiers[0] if len(set(load.tiers[:loaded])) == 1 else "mixed"
            nbytes = loaded * self._identity.block_bytes
            self._stats.add_restore(tier, nbytes, seconds)
            if tier != "mixed":  # one source tier: a clean measurement of it
                self._observed.transfers.append((tier, nbytes, seconds))
        log.debug(
            "request %s: loaded %d of %d blocks in %.2f ms%s",
            load.req_id,
            loaded,
            len(load.block_ids),
            seconds * 1e3,
            " (asynchronously)" if load.asynchronous else "",
        )

    # ----------------------------------------------------------------- layer-wise loads

    def _stage_layerwise(self, loads: list[TransferJob]) -> None:
        """Resolve every load now (the blocks vLLM will not get are known before the forward
        starts), then copy them a layer at a time beside the forward pass;
        ``wait_for_layer_load`` holds each attention layer until its layer is in."""
        # A step whose wait_for_save never came: its copy must end before its slots and
        # progress go (the native copy's thread writes them until it ends)
        self._finish_layerwise()
        transfer = self._registered()
        staged: list[tuple[TransferJob, StagedLoad, float]] = []
        for load in loads:
            start = time.perf_counter()
            one = self._stage(load)
            got = len(one.block_ids) if one is not None else 0
            if got < len(load.block_ids):
                self._load_errors.update(load.block_ids[got:])
                self._stats.add_failed(len(load.block_ids) - got)
            if one is not None and got:
                staged.append((load, one, time.perf_counter() - start))
            elif one is not None:
                self._release(load, one, copied=False)
        if not staged:
            return
        try:
            copy = transfer.start_by_layer([one for _, one, _ in staged], self._loader)
        except ValueError as exc:  # a block of another size than this layout's: recompute them all
            log.warning("kvstore connector: cannot restore these blocks: %s", exc)
            for load, one, _ in staged:
                self._load_errors.update(one.block_ids)
                self._stats.add_failed(len(one.block_ids))
                self._release(load, one, copied=False)
            return
        self._loading = _Loading(staged, copy)

    def _stage(self, load: TransferJob) -> StagedLoad | None:
        transfer = self._registered()
        keys = load.rank_keys[self._rank]
        in_place = _in_place_of(load, self._rank)
        staged: StagedLoad | None = self._link.call(
            "load", load.timeout_s, lambda kv: transfer.stage(kv, keys, load.block_ids, in_place)
        )
        return staged

    def _release(self, load: TransferJob, staged: StagedLoad, copied: bool = True) -> bool:
        """Let go of the slots; whether the copy stands (``BlockTransfer.finish``): one whose
        lease cannot be confirmed, the sidecar out, does not; one this side pinned does."""
        transfer = self._registered()
        confirming = bool(staged.confirm_lease) and copied
        stands = self._link.call("release", load.timeout_s, lambda kv: transfer.finish(kv, staged, copied))
        return bool(stands) if confirming else True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Hold the attention layer until its layer of every load is in (an unknown layer — none
        such is registered — waits for them all), polling the copy's progress: a copy that fails
        stops the wait, and ``_finish_layerwise`` turns its blocks into load errors."""
        loading = self._loading
        if loading is None:
            return
        start = time.perf_counter()
        index = self._layer_index.get(layer_name)
        loading.copy.wait_for(loading.copy.num_layers if index is None else index + 1)
        if index is not None:
            loading.awaited.add(index)
        self._step_load_s += time.perf_counter() - start

    def _finish_layerwise(self) -> None:
        """After the forward: every copy done, the slots released, the loads counted. A copy that
        failed, or a layer the forward read without waiting for it, makes its blocks load
        errors: vLLM recomputes them instead of keeping what the forward made of them."""
        loading, self._loading = self._loading, None
        if loading is None:
            return
        try:
            copy_s = loading.copy.wait()
            failed = False
        except Exception:
            log.exception("kvstore connector: a layer-wise load failed; its blocks are recomputed")
            copy_s, failed = 0.0, True
        unawaited = set(range(loading.copy.num_layers)) - loading.awaited
        if unawaited and not failed:
            log.warning(
                "kvstore connector: the forward pass read %d layers without waiting for their load; "
                "their blocks are recomputed (set layerwise_load to false for this engine)",
                len(unawaited),
            )
            failed = True
        total = sum(len(one.block_ids) for _, one, _ in loading.staged)
        for load, one, stage_s in loading.staged:
            n = len(one.block_ids)
            if not self._release(load, one, copied=not failed) and not failed:
                log.warning(
                    "kvstore connector: request %s's pin ended before its copy was confirmed; "
                    "its blocks are recomputed",
                    load.req_id,
                )
                self._load_errors.update(one.block_ids)
                self._stats.add_failed(n)
                continue
            if failed:
                self._load_errors.update(one.block_ids)
                self._stats.add_failed(n)
                continue
            tiers = set(one.tiers)
            tier = one.tiers[0] if len(tiers) == 1 else "mixed"
            nbytes = n * self._identity.block_bytes
            seconds = stage_s + copy_s * n / total  # the copy's share of this load
            self._stats.add_restore(tier, nbytes, seconds)
            if tier != "mixed":
                self._observed.transfers.append((tier, nbytes, seconds))

    def _load(self, load: TransferJob) -> int:
        """Blocks restored (a prefix of ``load``); 0 when the sidecar cannot serve them in time."""
        transfer = self._registered()
        keys = load.rank_keys[self._rank]
        in_place = _in_place_of(load, self._rank)
        loaded = self._link.call(
            "load", load.timeout_s, lambda kv: transfer.fetch(kv, keys, load.block_ids, in_place)
        )
        return loaded or 0

    def wait_for_save(self, meta: KvstoreConnectorMetadata) -> None:
        self._finish_layerwise()
        if len(meta.steps) == 1 and meta.steps[0][1] > 1 and self._step_started:
            # One request prefilling alone: the forward pass is its prefill, cleanly timed.
            before, new = meta.steps[0]
            forward_s = time.perf_counter() - self._step_started - self._step_load_s
            self._observed.prefills.append((before, new, forward_s))
        self._step_started = 0.0
        for save in meta.saves:
            if self._save(save):
                self._stats.add_saved(len(save.block_ids))
                self.kv_events.extend(save.announce)  # stored: vLLM may announce them
            else:  # failed, refused, or the breaker is open: these blocks stay unsaved
                self._stats.add_failed_save(len(save.block_ids))
        for audit in meta.audits:
            self._audit(audit)

    def _audit(self, audit: TransferJob) -> None:
        """Compare blocks just computed with what kvstore holds under their keys; count the
        agreements and mismatches, and tell the scheduler (its kill switch)."""
        transfer = self._registered()
        keys = audit.rank_keys[self._rank]
        found = self._link.call(
            "audit", audit.timeout_s, lambda kv: transfer.compare(kv, keys, audit.block_ids)
        )
        differences = [d for d in found or [] if d is not None]
        if not differences:
            return  # the sidecar is out, or no longer holds them: nothing was compared
        mismatch = sum(d > self._audit_tolerance for d in differences)
        self._stats.add_audit(len(differences) - mismatch, mismatch, differences)
        self._observed.audits.append((audit.req_id, len(differences) - mismatch, mismatch, max(differences)))
        log.info(
            "request %s: audited %d restorable blocks against recomputing them: %d differ beyond %.3g "
            "(largest difference %.3g of the block's magnitude)",
            audit.req_id,
            len(differences),
            mismatch,
            self._audit_tolerance,
            max(differences),
        )

    def _save(self, save: TransferJob) -> bool:
        """True once the blocks are stored (or were already)."""
        transfer = self._registered()
        keys, parent = save.rank_keys[self._rank], save.parents[self._rank]

        def store(kv: Client) -> bool:
            transfer.store(kv, keys, save.block_ids, parent)
            return True

        return bool(self._link.call("save", save.timeout_s, store))

    def _registered(self) -> BlockTransfer:
        if self._transfer is None:
            raise RuntimeError("the kvstore connector moves blocks only after register_kv_caches")
        return self._transfer

    def build_connector_worker_meta(self) -> ObservedWork | None:
        if not self._observed:
            return None
        observed, self._observed = self._observed, ObservedWork()
        return observed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_stats(self) -> KvstoreConnectorStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        self._finish_layerwise()
        self._loader.shutdown(wait=True)
        if self._async is not None:
            self._async.shutdown()
        self._link.close()


@dataclass
class _Loading:
    """This step's layer-wise loads: staged, their copy running beside the forward pass."""

    staged: list[tuple[TransferJob, StagedLoad, float]]  # (job, slots, seconds to stage)
    copy: kv_layout.LayerCopy  # every staged block, a layer at a time
    awaited: set[int] = field(default_factory=set)  # layers the forward waited for


def _in_place_of(load: TransferJob, rank: int) -> InPlace | None:
    """This rank's arena slots for ``load``, when the scheduler's lookup found them all."""
    return load.in_place[rank] if rank < len(load.in_place) else None
