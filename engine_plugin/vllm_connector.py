"""kvstore as a vLLM KV connector (``KVConnectorBase_V1``).

Load it with::

    KVTransferConfig(
        kv_connector="KvstoreConnector",
        kv_connector_module_path="engine_plugin.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",   # a failed or missing block is recomputed
        kv_connector_extra_config={"address": "unix:///.../kvstore.sock", "token": None,
                                   "calibration": "/path/calibration.json",
                                   "policy": "auto"},   # or "restore" / "recompute" (benchmarks)
    )

One request can override the policy: ``SamplingParams(extra_args={"kv_transfer_params":
{"kvstore_policy": "restore"}})`` (the decision benchmark compares the three in one engine).

Block mapping: one kvstore block is one vLLM block of ``block_size`` tokens, holding that
block's K and V for every layer of this tensor-parallel rank, layer after layer in the order
vLLM registered its caches (``engine_plugin.kv_layout``: the CPU layout ``[num_blocks,
kv_heads, block_size, 2 * head_dim]`` and the CUDA layouts, block-major or ``[2, num_blocks,
...]``; a layer's block is copied as one or two contiguous slices).

Scheduler side, per new request: compute block keys (fingerprint, token ids, ``cache_salt``,
LoRA adapter); look up the blocks after those vLLM's own prefix cache already holds (none when
it holds every block a restore could use: no sidecar call at all) and pin them under a lease;
let the cost model decide how many of them to load (possibly none: the pin goes at once). The
pin holds until the step that loads them has run (or the request ends, or the lease's 30 s
expire), so eviction cannot take a planned block. Per step: tell the worker which blocks to
load and which newly computed full blocks to save. Decisions, their predictions and the
hit/restored token counts cover only the blocks after vLLM's own; what vLLM held is counted
apart (``local_tokens``).

Worker side: load by copying straight out of the mapped arena (same host) or off the data port
(remote) into the allocated blocks before the forward pass; save after it. Every failure —
sidecar down or hung, block missing, corrupt — becomes a load error vLLM recomputes, never wrong
output; a save that fails is skipped and counted.

The connector never stalls the engine (``engine_plugin.sidecar``): every sidecar call has a
deadline no longer than what the call saves — a lookup, the predicted prefill of the tokens
vLLM does not hold (floored at 0.25 s, capped at 2 s); a load, the plan's predicted
all-recompute time (floored; the scheduler puts it in the load's metadata); a save, 0.25 s plus
its bytes at 100 MB/s; a side's first call (and its first after a reconnect) gets 1 s more for
connecting and registering. A timeout is not retried; a broken connection (a restarted sidecar)
is, once. Each side (scheduler, worker: separate objects, maybe separate processes) has its own
circuit breaker: after a failure it makes no sidecar call for 1 s, doubling to 30 s while
probes fail, and recomputes meanwhile — lookups find nothing, loads fail at once into vLLM's
recompute, saves are skipped. Failed and refused calls are counted by call
(``sidecar_unreachable``).

Measurements (``engine_plugin.vllm_stats``): the worker times every restore and the forward pass
of a step that prefills one request, and hands them to the scheduler with the step's output; the
scheduler folds them into its calibration (bandwidth per tier, prefill curve), re-reads the
calibration file when it changes, and reports each decision with its predicted and measured
time to first token to vLLM's stat loggers (log line and Prometheus ``/metrics``).

Tensor parallel: each rank's blocks are keyed by its own fingerprint (rank and world size are
in it); the scheduler looks up every rank's keys and plans on the shortest hit (the slowest tier
per block), each worker moves only its rank's shard. Pipeline parallel: 1 only. The CUDA layouts
run only where CUDA is present (``gpu``-marked tests); the CPU layout is tested end to end.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_plugin import kv_layout
from engine_plugin.calibration import Calibration
from engine_plugin.cost_model import Plan, PrefillModel, TierCost, plan_restore
from engine_plugin.sidecar import SidecarLink, load_deadline_s, lookup_deadline_s, save_deadline_s
from engine_plugin.vllm_identity import identity_from_vllm
from engine_plugin.vllm_stats import KvstoreConnectorStats, KvstorePromMetrics, ObservedWork
from kvstore.client import Client, connect
from kvstore.errors import KvStoreError
from kvstore.keys import BlockKey, block_keys
from kvstore.tls import ClientTls

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as exc:  # pragma: no cover - only without vllm installed
    raise ImportError("engine_plugin.vllm_connector needs vllm (pip install 'kvstore[vllm]')") from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree, so that decisions show up in the engine's own log at its level.
log = logging.getLogger(f"vllm.{__name__}")

# Used until a calibration file says otherwise: restoring from dram beats recomputing.
DEFAULT_TIERS = {
    "hbm": TierCost(50e9, 0.0001),
    "dram": TierCost(5e9, 0.0005),
    "nvme": TierCost(1e9, 0.001),
}
PIN_TTL_S = 30.0  # a pin outlives a stalled engine by this much at most
DEFAULT_PREFILL = PrefillModel(fixed_s=0.002, per_token_s=0.0004, per_token_context_s=0.0)


@dataclass(frozen=True)
class _RankHit:
    hit_blocks: int  # the shortest hit over the ranks: a block is usable only with every shard
    tiers: tuple[str, ...]  # per block, the slowest tier any rank holds it in
    lease_ids: list[int]


_TIER_ORDER = {"hbm": 0, "dram": 1, "nvme": 2}


def _lookup_ranks(
    kv: Client, fingerprints: Sequence[bytes], rank_keys: Sequence[Sequence[BlockKey]]
) -> _RankHit:
    # A failure after some ranks answered leaves their pins to expire (PIN_TTL_S): releasing
    # them would wait on the same sidecar that just failed.
    lookups = [
        kv.lookup_tiers(fp, keys, pin_ttl_s=PIN_TTL_S)
        for fp, keys in zip(fingerprints, rank_keys, strict=True)
    ]
    hit = min(lookup.hit_blocks for lookup in lookups)
    tiers = tuple(
        max((lookup.tiers[i] for lookup in lookups), key=lambda t: _TIER_ORDER.get(t, len(_TIER_ORDER)))
        for i in range(hit)
    )
    return _RankHit(hit, tiers, [lookup.lease_id for lookup in lookups if lookup.lease_id])


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _policy(value: object) -> str:
    policy = str(value)
    if policy not in ("auto", "restore", "recompute"):
        raise ValueError(f"policy is 'auto', 'restore' or 'recompute', got {policy!r}")
    return policy


@dataclass
class _Transfer:
    req_id: str
    rank_keys: list[list[BlockKey]]  # per tensor-parallel rank: each rank stores its own shard
    block_ids: list[int]
    timeout_s: float  # the worker's deadline for it (the sidecar module says how it is chosen)
    parents: list[BlockKey | None] = field(default_factory=list)  # per rank
    tiers: tuple[str, ...] = ()  # loads: where the scheduler saw each block (slowest over ranks)


@dataclass
class KvstoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)
    # (tokens computed before this step, tokens computed in it) of every scheduled request
    steps: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Tracked:
    rank_keys: list[list[BlockKey]]
    local_blocks: int = 0  # leading blocks vLLM's own prefix cache holds: never looked up
    hit_blocks: int = 0  # blocks after those found in kvstore
    hit_tiers: tuple[str, ...] = ()  # of the hit blocks (index 0: block local_blocks)
    load_blocks: int = 0  # of the hit blocks, how many to load
    load_timeout_s: float = 0.0
    saved_blocks: int = 0
    block_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    req_id: str = ""
    lease_ids: list[int] = field(default_factory=list)  # the hit blocks, pinned until loaded
    load_sent: bool = False
    plan: Plan | None = None
    planned_at: float = 0.0  # perf_counter at the decision; the prefill's end closes the record
    prefill_done: bool = False


class KvstoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._address = str(extra.get("address") or "")
        if not self._address:
            raise ValueError("kv_connector_extra_config needs 'address' (unix:///path or host:port)")
        self._token = extra.get("token")
        # A TLS sidecar or shared store: "tls_ca_file" (its CA), and for mutual TLS
        # "tls_cert_file" / "tls_key_file".
        tls_ca, tls_cert = str(extra.get("tls_ca_file") or ""), str(extra.get("tls_cert_file") or "")
        self._tls = (
            ClientTls(tls_ca, tls_cert, str(extra.get("tls_key_file") or ""))
            if (tls_ca or tls_cert) and not self._address.startswith("unix:")
            else None
        )
        self._block_size = vllm_config.cache_config.block_size
        world = vllm_config.parallel_config.tensor_parallel_size
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the kvstore connector supports pipeline_parallel_size=1")
        # Each tensor-parallel rank holds its own KV heads: its blocks are keyed by its own
        # fingerprint. The scheduler looks up every rank's; a worker moves only its rank's.
        self._rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self._identities = [identity_from_vllm(vllm_config, tp_rank=r) for r in range(world)]
        self.identity = self._identities[self._rank]
        self.fingerprint = self.identity.fingerprint()
        self._fingerprints = [identity.fingerprint() for identity in self._identities]
        self.policy = _policy(extra.get("policy", "auto"))
        path = extra.get("calibration")
        self.calibration = (
            Calibration.load(path) if path else Calibration(dict(DEFAULT_TIERS), DEFAULT_PREFILL)
        )
        self._link = SidecarLink(
            self._address,
            lambda: connect(self._address, token=self._token, tls=self._tls),
            self._identities if role == KVConnectorRole.SCHEDULER else [self.identity],
            lambda call: self._stats.add_unreachable(call),  # the stats object is replaced per report
        )
        self._tracked: dict[str, _Tracked] = {}
        self._kv_caches: list[torch.Tensor] = []
        self._layouts: list[kv_layout.LayerLayout] = []
        self._load_errors: set[int] = set()
        self._stats = KvstoreConnectorStats()
        self._calibration_changed = role == KVConnectorRole.SCHEDULER  # report the start figures
        self._observed = ObservedWork()
        self._step_started = 0.0  # worker: when this step's metadata arrived (before its forward)
        self._step_load_s = 0.0  # worker: time this step spent restoring
        # The whole fingerprint and what it digests: an operator invalidates by it
        # (`kvstore invalidate --fingerprint`) and can see why two engines do not share blocks.
        log.info(
            "kvstore connector (%s) for %s: fingerprint %s, %d B per block; computed from %s",
            role.name,
            self.identity.model_id,
            self.fingerprint.hex(),
            self.identity.block_bytes,
            json.dumps(dataclasses.asdict(self.identity), sort_keys=True),
        )

    # ----------------------------------------------------------------- scheduler side

    def _request_keys(self, request: Request) -> list[list[BlockKey]]:
        """The request's block keys under each rank's fingerprint."""
        extra: list[bytes] = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            extra.append(f"lora:{lora.lora_name}:{lora.lora_int_id}".encode())
        tokens = list(request.prompt_token_ids or [])
        salt = getattr(request, "cache_salt", None)
        return [
            block_keys(fp, tokens, self._block_size, cache_salt=salt, extra_keys=extra)
            for fp in self._fingerprints
        ]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rank_keys = self._request_keys(request)
        previous = self._tracked.get(request.request_id)
        if previous is not None:  # asked again (it could not be scheduled): the old pin goes
            self._unpin(previous)
        tracked = _Tracked(rank_keys)
        self._tracked[request.request_id] = tracked
        # vLLM presents its local hit in whole blocks; anything else would not line up with ours.
        if not rank_keys[0] or num_computed_tokens % self._block_size:
            return 0, False
        local = num_computed_tokens
        prompt = tracked.prompt_tokens = len(request.prompt_token_ids or [])
        tracked.local_blocks = local // self._block_size
        self._calibration_changed |= self.calibration.reload_if_changed()
        snap = self.calibration.snapshot()
        hit = _RankHit(0, (), [])
        # Only blocks a restore could use (the prompt's last token is always computed) are worth
        # a sidecar call; when vLLM holds all of them there is nothing to ask.
        if (prompt - 1) // self._block_size > tracked.local_blocks:
            further = [keys[tracked.local_blocks :] for keys in rank_keys]
            # Pinned until the worker has loaded them (or the plan loads nothing), so that
            # eviction cannot take a block between this decision and the restore.
            found = self._link.call(
                "lookup",
                lookup_deadline_s(snap.prefill.seconds(local, prompt - local)),
                lambda kv: _lookup_ranks(kv, self._fingerprints, further),
            )
            if found is not None:
                hit = found
        tracked.hit_blocks = hit.hit_blocks
        tracked.hit_tiers = hit.tiers
        tracked.lease_ids = hit.lease_ids
        tiers = {t: snap.tiers.get(t, DEFAULT_TIERS.get(t, DEFAULT_TIERS["nvme"])) for t in set(hit.tiers)}
        policy = self.policy
        params = getattr(request, "kv_transfer_params", None) or {}
        if "kvstore_policy" in params:  # one request's override (benchmarks, experiments)
            try:
                policy = _policy(params["kvstore_policy"])
            except ValueError as exc:
                log.warning("request %s: %s; using %s", request.request_id, exc, policy)
        forced = {"auto": None, "restore": hit.hit_blocks, "recompute": 0}[policy]
        plan = plan_restore(
            hit.tiers,
            self.identity.block_bytes,
            self._block_size,
            prompt,
            tiers,
            snap.prefill,
            forced,
            local_tokens=local,
        )
        tracked.load_blocks = plan.restore_blocks
        tracked.load_timeout_s = load_deadline_s(plan.all_recompute_s)
        tracked.plan, tracked.planned_at = plan, time.perf_counter()
        tracked.req_id = request.request_id
        if not tracked.load_blocks:
            self._unpin(tracked)
        return tracked.load_blocks * self._block_size, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens == 0:
            tracked.load_blocks = 0
            self._unpin(tracked)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvstoreConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            if tracked.load_blocks:
                first, last = tracked.local_blocks, tracked.local_blocks + tracked.load_blocks
                meta.loads.append(
                    _Transfer(
                        new.req_id,
                        [keys[first:last] for keys in tracked.rank_keys],
                        tracked.block_ids[first:last],
                        tracked.load_timeout_s,
                        tiers=tracked.hit_tiers[: tracked.load_blocks],
                    )
                )
                tracked.load_blocks = 0
                tracked.load_sent = True  # its step's output means the load is done: unpin then
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._add_step(meta, tracked, new.num_computed_tokens, scheduled)
            self._add_save(meta, new.req_id, tracked, new.num_computed_tokens + scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._add_step(meta, tracked, cached.num_computed_tokens[i], scheduled)
            self._add_save(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled)
        return meta

    def _add_step(
        self, meta: KvstoreConnectorMetadata, tracked: _Tracked, before: int, scheduled: int
    ) -> None:
        meta.steps.append((before, scheduled))
        if tracked.plan is not None and before + scheduled >= tracked.prompt_tokens:
            tracked.prefill_done = True  # the step's output (first token) closes the record

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        observed = connector_output.kv_connector_worker_meta
        if isinstance(observed, ObservedWork):
            for tier, nbytes, seconds in observed.transfers:
                self.calibration.observe_transfer(tier, nbytes, seconds)
            for prefix, new, seconds in observed.prefills:
                self.calibration.observe_prefill(prefix, new, seconds)
            self._calibration_changed = True
        for tracked in self._tracked.values():
            if tracked.load_sent:
                self._unpin(tracked)
            if tracked.prefill_done:
                self._close_decision(tracked)

    def _unpin(self, tracked: _Tracked) -> None:
        lease_ids, tracked.lease_ids = tracked.lease_ids, []
        self._link.release([lease_id for lease_id in lease_ids if lease_id])

    def _close_decision(self, tracked: _Tracked) -> None:
        """Record the decision with its measured time to first token (once per request)."""
        plan, tracked.plan = tracked.plan, None
        if plan is None:
            return
        actual = time.perf_counter() - tracked.planned_at if tracked.prefill_done else None
        log.info(
            "request %s: vLLM holds %d tokens; %d of %d further blocks hit, %s %d tokens: ttft "
            "predicted %.1f ms, measured %s (all-recompute predicted %.1f ms, all-restore %.1f ms)",
            tracked.req_id,
            plan.local_tokens,
            tracked.hit_blocks,
            max(0, len(tracked.rank_keys[0]) - tracked.local_blocks),
            plan.decision,
            plan.restore_tokens,
            plan.predicted_ttft_s * 1e3,
            "-" if actual is None else f"{actual * 1e3:.1f} ms",
            plan.all_recompute_s * 1e3,
            plan.all_restore_s * 1e3,
        )
        self._stats.add_decision(
            {
                "decision": plan.decision,
                "local_tokens": plan.local_tokens,
                "hit_tokens": tracked.hit_blocks * self._block_size,
                "restored_tokens": plan.restore_tokens,
                "predicted_ttft_s": plan.predicted_ttft_s,
                "actual_ttft_s": actual,
            }
        )

    def _add_save(
        self, meta: KvstoreConnectorMetadata, req_id: str, tracked: _Tracked, done_tokens: int
    ) -> None:
        """Save the prompt's full blocks computed by the end of this step that are not stored yet.
        Those vLLM held itself were saved when it computed them (or restored from kvstore)."""
        first = max(tracked.saved_blocks, tracked.local_blocks + tracked.hit_blocks)
        last = min(done_tokens // self._block_size, len(tracked.rank_keys[0]), len(tracked.block_ids))
        if last > first:
            parents = [keys[first - 1] if first else None for keys in tracked.rank_keys]
            rank_keys = [keys[first:last] for keys in tracked.rank_keys]
            timeout_s = save_deadline_s((last - first) * self.identity.block_bytes)
            meta.saves.append(_Transfer(req_id, rank_keys, tracked.block_ids[first:last], timeout_s, parents))
        tracked.saved_blocks = max(tracked.saved_blocks, last)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:
            self._unpin(tracked)
            self._close_decision(tracked)
        return False, None

    # ----------------------------------------------------------------- stats (both sides)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._calibration_changed:
            snap = self.calibration.snapshot()
            self._stats.set_calibration(
                {name: (cost.bandwidth_bytes_per_s, cost.latency_s) for name, cost in snap.tiers.items()},
                (snap.prefill.fixed_s, snap.prefill.per_token_s, snap.prefill.per_token_context_s),
            )
            self._calibration_changed = False
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvstoreConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvstoreConnectorStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvstorePromMetrics:
        return KvstorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches.values())
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None) or self._kv_caches[0].shape[0]
        self._layouts = [kv_layout.describe(cache, num_blocks) for cache in self._kv_caches]
        layer_bytes = sum(layout.block_bytes for layout in self._layouts)
        if layer_bytes != self.identity.block_bytes:
            raise ValueError(
                f"registered KV caches hold {layer_bytes} B per block, the fingerprint's layout "
                f"{self.identity.block_bytes} B: unsupported cache layout"
            )
        log.info(
            "kvstore connector: %d layers (%s) on %s, %d B per block",
            len(self._kv_caches),
            ", ".join(sorted({layout.kind for layout in self._layouts})),
            self._kv_caches[0].device,
            layer_bytes,
        )

    def _block_views(self, block_id: int) -> list[torch.Tensor]:
        return kv_layout.block_views(self._kv_caches, self._layouts, block_id)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds the step's metadata before the forward pass, while start_load_kv runs
        # after it when nothing is to be loaded: the step's clock starts here.
        super().bind_connector_metadata(connector_metadata)
        self._step_started, self._step_load_s = time.perf_counter(), 0.0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstoreConnectorMetadata)
        for load in meta.loads:
            start = time.perf_counter()
            loaded = self._load(load)
            seconds = time.perf_counter() - start
            if loaded < len(load.block_ids):
                self._load_errors.update(load.block_ids[loaded:])
                self._stats.add_failed(len(load.block_ids) - loaded)
            if loaded:
                tier = load.tiers[0] if len(set(load.tiers[:loaded])) == 1 else "mixed"
                nbytes = loaded * self.identity.block_bytes
                self._stats.add_restore(tier, nbytes, seconds)
                if tier != "mixed":  # one source tier: a clean measurement of it
                    self._observed.transfers.append((tier, nbytes, seconds))
            log.debug(
                "request %s: loaded %d of %d blocks in %.2f ms",
                load.req_id,
                loaded,
                len(load.block_ids),
                seconds * 1e3,
            )
        self._step_load_s += time.perf_counter() - started

    def _load(self, load: _Transfer) -> int:
        """Blocks restored (a prefix of ``load``); 0 when the sidecar cannot serve them in time."""
        return self._link.call("load", load.timeout_s, lambda kv: self._load_from(kv, load)) or 0

    def _load_from(self, kv: Client, load: _Transfer) -> int:
        if self._address.startswith("unix:"):
            resolved = kv.resolve(self.fingerprint, load.rank_keys[self._rank])
            try:
                for view, block_id in zip(resolved.views, load.block_ids, strict=False):
                    kv_layout.scatter(torch.frombuffer(view, dtype=torch.uint8), self._block_views(block_id))
                kv_layout.synchronize(self._kv_caches)  # device copies done before the slots go
            finally:
                if resolved.lease_id:
                    self._release_after_load(kv, resolved.lease_id)
            return len(resolved.views)
        blocks = kv.get(self.fingerprint, load.rank_keys[self._rank])
        for data, block_id in zip(blocks, load.block_ids, strict=False):
            kv_layout.scatter(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), self._block_views(block_id)
            )
        kv_layout.synchronize(self._kv_caches)
        return len(blocks)

    @staticmethod
    def _release_after_load(kv: Client, lease_id: int) -> None:
        """The blocks are copied: a release that fails or runs past the load's deadline must not
        turn the load into a failure. The pin expires on its own."""
        try:
            kv.release(lease_id)
        except KvStoreError as exc:
            log.debug("releasing lease %d after a load: %s", lease_id, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstoreConnectorMetadata)
        if len(meta.steps) == 1 and meta.steps[0][1] > 1 and self._step_started:
            # One request prefilling alone: the forward pass is its prefill, cleanly timed.
            before, new = meta.steps[0]
            forward_s = time.perf_counter() - self._step_started - self._step_load_s
            self._observed.prefills.append((before, new, forward_s))
        self._step_started = 0.0
        for save in meta.saves:
            if self._link.call("save", save.timeout_s, functools.partial(self._save, save=save)):
                self._stats.add_saved(len(save.block_ids))
            else:  # failed, refused, or the breaker is open: these blocks stay unsaved
                self._stats.add_failed_save(len(save.block_ids))

    def _save(self, kv: Client, save: _Transfer) -> bool:
        """True once the blocks are stored (or were already)."""
        if self._address.startswith("unix:"):
            self._save_in_place(kv, save)
            return True
        blocks = [torch.empty(self.identity.block_bytes, dtype=torch.uint8) for _ in save.block_ids]
        for target, block_id in zip(blocks, save.block_ids, strict=True):
            kv_layout.gather(self._block_views(block_id), target)
        kv_layout.synchronize(self._kv_caches)
        keys, parent = save.rank_keys[self._rank], save.parents[self._rank]
        kv.put(self.fingerprint, keys, [b.numpy().data for b in blocks], parent=parent)
        return True

    def _save_in_place(self, kv: Client, save: _Transfer) -> None:
        """Same host: gather each block's layers straight into its reserved arena slot."""
        keys = save.rank_keys[self._rank]
        sizes = [self.identity.block_bytes] * len(keys)
        pending = kv.reserve(self.fingerprint, keys, sizes, parent=save.parents[self._rank])
        try:
            for view, block_id in zip(pending.views, save.block_ids, strict=True):
                if view is None:
                    continue  # already stored, or another writer has it
                kv_layout.gather(self._block_views(block_id), torch.frombuffer(view, dtype=torch.uint8))
            kv_layout.synchronize(self._kv_caches)  # device copies done before the commit
        except BaseException:
            kv.abort(pending.reservation_id)
            raise
        kv.commit(pending.reservation_id)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not (self._observed.transfers or self._observed.prefills):
            return None
        observed, self._observed = self._observed, ObservedWork()
        return observed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._link.close()
