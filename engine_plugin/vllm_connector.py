"""kvstore as a vLLM KV connector (``KVConnectorBase_V1``).

Load it with::

    KVTransferConfig(
        kv_connector="KvstoreConnector",
        kv_connector_module_path="engine_plugin.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",   # a failed or missing block is recomputed
        kv_connector_extra_config={"address": "unix:///.../kvstore.sock",
                                   "calibration": "/path/calibration.json",
                                   "policy": "auto",    # or "restore" / "recompute" (benchmarks)
                                   "explore_fraction": 0.05,  # of close calls, the other side
                                   "audit_fraction": 0.0, "audit_tolerance": 0.02,
                                   "async_load": True},   # False: every load inside the step
    )

Audited hits: ``audit_fraction`` of the requests whose plan would restore blocks recompute them
instead, and each worker compares the KV it computed with the blocks kvstore holds under the same
keys (the largest difference over the block's largest magnitude, ``audit_tolerance``: 0.02 by
default, several times bf16's rounding). One mismatch trips the kill switch: no more restores or
saves for this model until the engine restarts, its blocks invalidated on the sidecar, the
reason logged as an error; the counts and differences are on vLLM's metrics
(``kvstore_connector_audited_blocks_total``, ``kvstore_connector_audit_difference``,
``kvstore_connector_restores_disabled``).

One request can override the policy: ``SamplingParams(extra_args={"kv_transfer_params":
{"kvstore_policy": "restore"}})`` (the decision benchmark compares the three in one engine).
The sidecar's address, token and TLS are parsed by ``engine_plugin.sidecar.SidecarSettings``,
as for SGLang: ``address`` defaults to ``$KVSTORE_ADDRESS``; the token comes from
``$KVSTORE_TOKEN`` or a 0600 ``token_file`` (a ``token`` key works too, with a warning: vLLM logs
this config at INFO); ``tls_ca_file`` and, for mutual TLS, ``tls_cert_file`` / ``tls_key_file``
(TCP only; the Unix socket is plain).

vLLM makes one connector per role; this class only parses the configuration (``ConnectorConfig``,
once) and hands every call to its role's half:

- scheduler: ``engine_plugin.vllm_scheduler`` — block keys, lookup and pins, the cost model's
  plan, decision records, the step's metadata (``engine_plugin.vllm_metadata``);
- worker: ``engine_plugin.vllm_worker`` — the KV caches, loads before the forward pass and saves
  after it (``engine_plugin.transfer``: the mapped arena on the same host, the data port
  remote), timing observations.

Block mapping: one kvstore block is one vLLM block of ``block_size`` tokens, holding that
block's K and V for every layer of this tensor-parallel rank, layer after layer in the order
vLLM registered its caches (``engine_plugin.cache_layout``: every layout vLLM 0.32 hands a
connector; a layer's block is copied as its runs of memory, one or one per KV head).

The connector never stalls the engine (``engine_plugin.sidecar``): every sidecar call has a
deadline no longer than what the call saves — a lookup, the predicted prefill of the tokens
vLLM does not hold (floored at 0.25 s, capped at 2 s); a load, the plan's predicted
all-recompute time (floored; the scheduler puts it in the load's metadata); a save, 0.25 s plus
its bytes at 100 MB/s; a side's first call (and its first after a reconnect) gets 1 s more for
connecting and registering. A timeout is not retried; a broken connection (a restarted sidecar)
is, once. Each side (scheduler, worker: separate objects, maybe separate processes) has its own
link and circuit breaker: after a failure it makes no sidecar call for 1 s, doubling to 30 s
while probes fail, and recomputes meanwhile — lookups find nothing, loads fail at once into
vLLM's recompute, saves are skipped. Failed and refused calls are counted by call
(``sidecar_unreachable``).

Measurements (``engine_plugin.vllm_stats``): the worker times every restore and the forward pass
of a step that prefills one request, and hands them to the scheduler with the step's output; the
scheduler folds them into its calibration (bandwidth per tier, prefill curve), re-reads the
calibration file when it changes, and reports each decision with its predicted and measured
time to first token to vLLM's stat loggers (log line and Prometheus ``/metrics``).

Tensor parallel: each rank's blocks are keyed by its own fingerprint (rank and world size are
in it); the scheduler looks up every rank's keys and plans on the shortest hit (the slowest tier
per block), each worker moves only its rank's shard. Pipeline parallel: 1 only. Hybrid models
(no ``SupportsHMA``): ``engine_plugin.vllm_hybrid``. The CUDA layouts
run only where CUDA is present (``gpu``-marked tests); the CPU layout is tested end to end.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine_plugin.calibration import Calibration
from engine_plugin.prefill_probe import shapes_from_vllm
from engine_plugin.sidecar import SidecarLink, SidecarSettings, extra_number
from engine_plugin.vllm_events import KvstoreKVEvents, saved_block_events, worker_events
from engine_plugin.vllm_hybrid import check_kv_cache_groups
from engine_plugin.vllm_identity import identity_from_vllm
from engine_plugin.vllm_metadata import KvstoreConnectorMetadata
from engine_plugin.vllm_scheduler import Policy, SchedulerSide, parse_policy
from engine_plugin.vllm_stats import KvstoreConnectorStats, KvstorePromMetrics
from engine_plugin.vllm_worker import WorkerSide
from kvstore.cost_model import DEFAULT_PREFILL, DEFAULT_TIERS, EXPLORE_FRACTION

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
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["DEFAULT_PREFILL", "DEFAULT_TIERS", "ConnectorConfig", "KvstoreConnector"]

AUDIT_TOLERANCE = 0.02

# Under vLLM's logger tree, so that the connector shows up in the engine's own log at its level.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, parsed once (the keys: the module docstring)."""

    sidecar: SidecarSettings  # address, token, TLS
    calibration_path: str  # "": the built-in defaults
    policy: Policy
    audit_fraction: float = 0.0  # share of would-be restores recomputed and compared instead
    explore_fraction: float = EXPLORE_FRACTION  # of close calls, the other side (cost_model.explore)
    audit_tolerance: float = AUDIT_TOLERANCE  # an audited block differing by more is a mismatch
    layerwise_load: bool = False  # same-host loads copied a layer at a time during the forward
    async_load: bool = True  # loads but same-host copies out of dram run beside the steps

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        return cls(
            SidecarSettings.parse(extra, "kv_connector_extra_config"),
            str(extra.get("calibration") or ""),
            parse_policy(extra.get("policy", "auto")),
            _share(extra, "audit_fraction", 0.0),
            _share(extra, "explore_fraction", EXPLORE_FRACTION),
            _share(extra, "audit_tolerance", AUDIT_TOLERANCE),
            _flag(extra, "layerwise_load", False),
            _flag(extra, "async_load", True),
        )

    def calibration(self) -> Calibration:
        if self.calibration_path:
            return Calibration.load(self.calibration_path)
        return Calibration(dict(DEFAULT_TIERS), DEFAULT_PREFILL)


def _share(extra: Mapping[str, Any], name: str, default: float) -> float:
    return extra_number(
        extra, name, default, "kv_connector_extra_config", "a number in [0, 1]", lambda x: 0.0 <= x <= 1.0
    )


def _flag(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config {name!r} is true or false, got {value!r}")
    return value


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KvstoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config or {})
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the kvstore connector supports pipeline_parallel_size=1")
        check_kv_cache_groups(kv_cache_config, vllm_config.model_config.model)  # no SupportsHMA
        block_size = vllm_config.cache_config.block_size
        world = vllm_config.parallel_config.tensor_parallel_size
        stats = KvstoreConnectorStats()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Each tensor-parallel rank holds its own KV heads: its blocks are keyed by its own
        # fingerprint. The scheduler looks up every rank's; a worker moves only its rank's.
        if role == KVConnectorRole.SCHEDULER:
            identities = [identity_from_vllm(vllm_config, tp_rank=r) for r in range(world)]
            identity = identities[0]
            link = SidecarLink(
                config.sidecar.address, config.sidecar.connect, identities, stats.add_unreachable
            )
            self._scheduler = SchedulerSide(
                link,
                stats,
                identities,
                block_size,
                config.calibration(),
                config.policy,
                config.audit_fraction,
                explore_fraction=config.explore_fraction,
                async_load=config.async_load,
                same_host=config.sidecar.address.same_host,
            )
        else:
            rank = _tp_rank()
            identity = identity_from_vllm(vllm_config, tp_rank=rank)
            link = SidecarLink(
                config.sidecar.address, config.sidecar.connect, [identity], stats.add_unreachable
            )
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._worker = WorkerSide(
                link,
                stats,
                identity,
                rank,
                config.sidecar.address.same_host,  # blocks move through the sidecar's mapped arena
                num_blocks,
                config.audit_tolerance,
                config.layerwise_load,
                shapes_from_vllm(vllm_config),
                config.sidecar.connect if config.async_load else None,  # the loads' own client
            )
        same_host = config.sidecar.address.same_host
        self._kv_events = saved_block_events(vllm_config, self._scheduler, block_size, same_host)
        # The whole fingerprint and what it digests: an operator invalidates by it
        # (`kvstore invalidate --fingerprint`) and can see why two engines do not share blocks.
        log.info(
            "kvstore connector (%s) for %s: fingerprint %s, %d B per block; computed from %s",
            role.name,
            identity.model_id,
            identity.fingerprint().hex(),
            identity.block_bytes,
            json.dumps(dataclasses.asdict(identity), sort_keys=True),
        )

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # ----------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._kv_events is not None:
            self._kv_events.track(request)
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)
        if self._kv_events is not None:
            self._kv_events.collect(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's KV events of the blocks saved to kvstore (engine_plugin.vllm_events)."""
        return self._kv_events.take() if self._kv_events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._kv_events is not None:
            self._kv_events.forget(request.request_id)
        return self.scheduler_side.request_finished(request)

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(saves done: none, every save ends inside its step; asynchronous loads done)."""
        idle = self.has_connector_metadata() and not self._metadata().steps  # nothing scheduled
        return None, self.worker_side.get_finished(idle)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._metadata())

    def _metadata(self) -> KvstoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstoreConnectorMetadata)
        return meta

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    # ----------------------------------------------------------------- both sides

    def get_kv_connector_kv_cache_events(self) -> KvstoreKVEvents | None:
        if self._worker is None:
            return None
        events, self._worker.kv_events = self._worker.kv_events, []
        return worker_events(events)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        assert side is not None
        return side.get_stats()

    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        assert side is not None
        side.shutdown()
        if self._kv_events is not None:
            self._kv_events.close()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load runs between the layers: a full CUDA graph would replay past it
        return extra_config.get("layerwise_load") is True

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
