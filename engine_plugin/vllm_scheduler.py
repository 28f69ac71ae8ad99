"""The connector's scheduler side: lookup, plan, pins, decision records, the step's metadata.

One ``SchedulerSide`` per engine, in vLLM's scheduler process. vLLM calls it from its scheduler
thread only (no locks), in this order for each request:

    get_num_new_matched_tokens(request, local_tokens)  look up, plan: tokens the worker loads
    update_state_after_alloc(request, blocks, tokens)  the engine's blocks for it
    build_connector_meta(scheduler_output)             every step: loads, saves, the step's shape
    update_connector_output(output)                    every step: the workers' measurements
    request_finished(request)                          once, at the end

Keys: a request's blocks are keyed per tensor-parallel rank (each rank's fingerprint; the
prompt's token ids, ``cache_salt`` and LoRA adapter chain them). Only the blocks after those
vLLM's own prefix cache holds (``local_tokens``, whole blocks) are looked up, planned, restored
and counted; what vLLM held is counted apart (``local_tokens`` of the decision record).

A tracked request's load (``_Load``, the hit blocks the plan restores) goes through

    (none) --get_num_new_matched_tokens, the plan loads k > 0 blocks--> pinned
    pinned --build_connector_meta schedules the request--> sent (the load is in that step's metadata)
    sent   --update_connector_output (that step ran: the worker has copied)--> (none)
    pinned --update_state_after_alloc with 0 external tokens (vLLM took none)--> (none)
    pinned or sent --request_finished, or get_num_new_matched_tokens again--> (none)

An asynchronous load (``engine_plugin.async_loads``: every restore but a same-host copy out of
dram, unless ``async_load`` is off) tells vLLM so (``get_num_new_matched_tokens`` returns
``(tokens, True)``); vLLM allocates its blocks (``update_state_after_alloc``) and parks the
request in WAITING_FOR_REMOTE_KVS, unscheduled, so the next ``build_connector_meta`` sends the
load by itself and the pins go when the workers report it finished (``finished_recving`` of
``update_connector_output``), not after the step. A load none of whose blocks arrived has vLLM
free the request's blocks and ask about it again: that request is recomputed, not restored again.

Pins: the lookup pins every hit block of every rank under a lease (``vllm_lookup.PIN_TTL_S``), so eviction
cannot take a planned block before the worker copies it. The leases live on the ``_Load`` and
are released on every arrow into ``(none)`` above; a plan that loads nothing releases them at
once. Over the Unix socket the lookup also says where each hit lies in the arena: a rank whose
loaded blocks are all there gets their slots in the load (``TransferJob.in_place``), copies
them without a resolve and checks this lease held, before the step's output releases it. A
lease the sidecar no longer knows is no error, and one that cannot be released (the sidecar is
out) expires on its own.

A tracked request's decision record (``engine_plugin.vllm_decisions``): opened by the plan;
marked prefilled by the ``build_connector_meta`` that schedules the prompt's last token; closed
— logged and added to the stats with its measured time to first token — by the next
``update_connector_output``, or by ``request_finished`` (unmeasured when its prefill never ran).
A request asked about again (vLLM could not schedule it) starts over: its old record is dropped,
not counted.

Saves: each step, the prompt's full blocks computed by the end of the step that kvstore does not
hold yet (neither vLLM's own nor hits) go into the metadata once, for the worker to save.

Audits (``audit_fraction``, a share of the requests whose plan restores something): the plan's
restore is not made; the request is recomputed, and as its restorable blocks are computed they go
into the metadata once, for the workers to compare with what kvstore holds (no decision is
recorded for it). A worker that finds a block differing beyond its tolerance reports it, and the
kill switch trips: no lookups, restores or saves for this model until the engine restarts, its
blocks invalidated on the sidecar, the reason logged (``restores_off``).

The plan (``kvstore.cost_model.plan_restore``) uses the calibration's current costs
(re-read when its file changes; updated from the workers' ``ObservedWork``), unless the
policy — the connector's, or a request's ``kv_transfer_params["kvstore_policy"]`` — forces
``restore`` or ``recompute``. Tensor parallel: a block is usable only when every rank holds its
shard, so the plan takes the shortest hit over the ranks and, per block, the slowest tier.
Under ``auto``, ``explore_fraction`` of the plans whose other side is predicted close take it
instead (``kvstore.cost_model.explore``): a wrong calibration cannot leave one side unmeasured.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from engine_plugin.calibration import Calibration
from engine_plugin.sidecar import (
    LOOKUP_CAP_S,
    SidecarLink,
    load_deadline_s,
    lookup_deadline_s,
    save_deadline_s,
)
from engine_plugin.transfer import InPlace
from engine_plugin.vllm_decisions import DecisionRecord
from engine_plugin.vllm_lookup import NO_HIT, UNANSWERED, RankHit, in_place_slots, lookup_ranks
from engine_plugin.vllm_metadata import KvstoreConnectorMetadata, TransferJob
from engine_plugin.vllm_stats import KvstoreConnectorStats, ObservedWork
from kvstore.client import Client
from kvstore.cost_model import DEFAULT_TIERS, EXPLORE_FRACTION, Plan, PrefillModel, explore, plan_restore
from kvstore.keys import BlockKey, ModelIdentity, block_keys

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree, so that warnings show up in the engine's own log at its level.
log = logging.getLogger(f"vllm.{__name__}")

Policy = Literal["auto", "restore", "recompute"]


def parse_policy(value: object) -> Policy:
    policy = str(value)
    if policy not in ("auto", "restore", "recompute"):
        raise ValueError(f"policy is 'auto', 'restore' or 'recompute', got {policy!r}")
    return cast(Policy, policy)


@dataclass
class _Load:
    """The hit blocks a plan restores, pinned until the worker has copied them."""

    first_block: int  # the request's first block after vLLM's own
    tiers: tuple[str, ...]  # one per block to load
    timeout_s: float
    lease_ids: tuple[int, ...]
    in_place: list[InPlace | None]  # per rank, for the worker (``TransferJob.in_place``)
    asynchronous: bool = False  # beside the steps: the workers' finished_recving releases the pins
    sent: bool = False  # in a step's metadata: that step's output releases the pins


@dataclass
class _Audit:
    """Hit blocks the plan would restore, recomputed instead and compared as they are computed."""

    next_block: int  # the first not yet sent to the workers
    end_block: int
    timeout_s: float


@dataclass
class _Request:
    req_id: str
    rank_keys: list[list[BlockKey]]
    block_ids: list[int]
    saved_blocks: int  # blocks before this one are in kvstore (vLLM's own, hits, or saved)
    load: _Load | None = None
    decision: DecisionRecord | None = None
    audit: _Audit | None = None
    load_failed: bool = False  # an asynchronous load came back with blocks vLLM must recompute


class SchedulerSide:
    """See the module docstring. ``link`` reports its failed calls into ``stats``."""

    def __init__(
        self,
        link: SidecarLink,
        stats: KvstoreConnectorStats,
        identities: Sequence[ModelIdentity],
        block_size: int,
        calibration: Calibration,
        policy: Policy,
        audit_fraction: float = 0.0,
        rng: random.Random | None = None,
        async_load: bool = False,
        same_host: bool = True,
        explore_fraction: float = EXPLORE_FRACTION,
    ) -> None:
        if not 0.0 <= audit_fraction <= 1.0:
            raise ValueError(f"audit_fraction is a share of restores, in [0, 1]: got {audit_fraction}")
        if not 0.0 <= explore_fraction <= 0.5:
            raise ValueError(
                f"explore_fraction is a share of close calls, in [0, 0.5]: got {explore_fraction}"
            )
        self.explore_fraction = explore_fraction  # of close calls, the other side taken (cost_model.explore)
        self.calibration = calibration
        self.policy = policy
        self.audit_fraction = audit_fraction
        self._rng = rng or random.Random()
        self._async_load = async_load  # loads but same-host copies out of dram run beside the steps
        self._same_host = same_host
        self._allocated: list[str] = []  # asynchronous loads whose blocks vLLM has allocated
        self.restores_off = ""  # why, once an audit found stored KV that differs: no restores, no saves
        self._link = link
        self._stats = stats
        self._block_size = block_size
        self._block_bytes = identities[0].block_bytes
        self._fingerprints = [identity.fingerprint() for identity in identities]
        self._requests: dict[str, _Request] = {}
        self._calibration_changed = True  # report the start figures
        # vLLM's BlockStored events of a save job's blocks (req_id, first, last, rank 0's keys),
        # where vLLM publishes KV events (engine_plugin.vllm_events; set by the connector)
        self.announce: Callable[[str, int, int, Sequence[BlockKey]], list[Any]] | None = None
        self._warmed_up = False  # the engine's first timed prefill is not learned from

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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        rank_keys = self._request_keys(request)
        previous = self._requests.get(request.request_id)
        if previous is not None:  # asked again (it could not be scheduled): the old pin goes
            self._unpin(previous)
            if previous.load_failed:
                # Its asynchronous load restored nothing and vLLM freed its blocks: recompute,
                # measured against the plan that chose the restore; its blocks are saved again
                # as they are computed (a no-op for those kvstore still holds).
                previous.load_failed = False
                previous.saved_blocks = num_computed_tokens // self._block_size
                return 0, False
        tracked = _Request(request.request_id, rank_keys, [], saved_blocks=0)
        self._requests[request.request_id] = tracked
        # vLLM presents its local hit in whole blocks; anything else would not line up with ours.
        if not rank_keys[0] or num_computed_tokens % self._block_size or self.restores_off:
            return 0, False
        local = num_computed_tokens
        local_blocks = local // self._block_size
        prompt = len(request.prompt_token_ids or [])
        self._calibration_changed |= self.calibration.reload_if_changed()
        snap = self.calibration.snapshot()
        hit = self._lookup(rank_keys, local_blocks, prompt, snap.prefill)
        tiers = {t: snap.tiers.get(t, DEFAULT_TIERS.get(t, DEFAULT_TIERS["nvme"])) for t in set(hit.tiers)}
        policy = self._policy_of(request)
        forced = {"auto": None, "restore": hit.hit_blocks, "recompute": 0}[policy]

        def plan_for(forced: int | None) -> Plan:
            return plan_restore(
                hit.tiers,
                self._block_bytes,
                self._block_size,
                prompt,
                tiers,
                snap.prefill,
                forced,
                local_tokens=local,
            )

        plan = plan_for(forced)
        why = f"the policy is {policy}" if policy != "auto" else ""
        may_explore = why == "" and plan.usable_blocks > 0 and self.explore_fraction > 0
        explored = explore(plan, self._rng.random(), self.explore_fraction) if may_explore else None
        if explored is not None:  # near the crossover: the other side, measured now and then
            plan = plan_for(explored)
            why = "the other side of a close call, taken now and then so that both stay measured"
        further = max(0, len(rank_keys[0]) - local_blocks)
        if hit is UNANSWERED:
            why = "the sidecar gave no answer to the lookup: down, slow, or its breaker open"
        tracked.decision = DecisionRecord(
            request.request_id, plan, hit.hit_blocks, further, prompt, time.perf_counter(), hit.tiers, why
        )
        tracked.saved_blocks = local_blocks + hit.hit_blocks
        load_blocks = plan.restore_blocks
        if load_blocks and self.audit_fraction and self._rng.random() < self.audit_fraction:
            # recompute what the plan would restore, and have the workers compare the two
            timeout_s = load_deadline_s(plan.all_recompute_s)
            tracked.audit = _Audit(local_blocks, local_blocks + load_blocks, timeout_s)
            tracked.decision = None  # not the plan's outcome: no decision is measured
            self._link.release(hit.lease_ids)
            return 0, False
        if load_blocks:
            timeout_s = load_deadline_s(plan.all_recompute_s)
            in_place = in_place_slots(hit.lookups, load_blocks)
            load_tiers = hit.tiers[:load_blocks]
            # Out of the arena on this host a restore is a memcpy: it stays inside the step.
            memcpy = self._same_host and all(tier == "dram" for tier in load_tiers)
            asynchronous = self._async_load and not memcpy
            tracked.load = _Load(local_blocks, load_tiers, timeout_s, hit.lease_ids, in_place, asynchronous)
            return load_blocks * self._block_size, asynchronous
        self._link.release(hit.lease_ids)
        return 0, False

    def _lookup(
        self, rank_keys: list[list[BlockKey]], local_blocks: int, prompt_tokens: int, prefill: PrefillModel
    ) -> RankHit:
        """The pinned hit after vLLM's own blocks; none when the sidecar cannot say in time."""
        # Only blocks a restore could use (the prompt's last token is always computed) are worth
        # a sidecar call; when vLLM holds all of them there is nothing to ask.
        if (prompt_tokens - 1) // self._block_size <= local_blocks:
            return NO_HIT
        local = local_blocks * self._block_size
        further = [keys[local_blocks:] for keys in rank_keys]
        found = self._link.call(
            "lookup",
            lookup_deadline_s(prefill.seconds(local, prompt_tokens - local)),
            lambda kv: lookup_ranks(kv, self._fingerprints, further),
        )
        return UNANSWERED if found is None else found

    def _policy_of(self, request: Request) -> Policy:
        policy = self.policy
        params = getattr(request, "kv_transfer_params", None) or {}
        if "kvstore_policy" in params:  # one request's override (benchmarks, experiments)
            try:
                policy = parse_policy(params["kvstore_policy"])
            except ValueError as exc:
                log.warning("request %s: %s; using %s", request.request_id, exc, policy)
        return policy

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens == 0:
            self._unpin(tracked)
        elif tracked.load is not None and tracked.load.asynchronous and not tracked.load.sent:
            self._allocated.append(request.request_id)  # waiting, unscheduled: sent by itself

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvstoreConnectorMetadata:
        meta = KvstoreConnectorMetadata()
        allocated, self._allocated = self._allocated, []
        for req_id in allocated:
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.load is not None and not tracked.load.sent:
                meta.loads.append(self._load_job(tracked, tracked.load))
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            load = tracked.load
            if load is not None and not load.sent and not load.asynchronous:
                meta.loads.append(self._load_job(tracked, load))
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._add_step(meta, tracked, new.num_computed_tokens, scheduled)
            self._add_save(meta, tracked, new.num_computed_tokens + scheduled)
            self._add_audit(meta, tracked, new.num_computed_tokens + scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
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
            self._add_save(meta, tracked, cached.num_computed_tokens[i] + scheduled)
            self._add_audit(meta, tracked, cached.num_computed_tokens[i] + scheduled)
        return meta

    def _load_job(self, tracked: _Request, load: _Load) -> TransferJob:
        load.sent = True
        last = load.first_block + len(load.tiers)
        return TransferJob(
            tracked.req_id,
            [keys[load.first_block : last] for keys in tracked.rank_keys],
            tracked.block_ids[load.first_block : last],
            load.timeout_s,
            tiers=load.tiers,
            in_place=[] if load.asynchronous else load.in_place,  # the loader resolves its own
            asynchronous=load.asynchronous,
        )

    def _add_step(
        self, meta: KvstoreConnectorMetadata, tracked: _Request, before: int, scheduled: int
    ) -> None:
        meta.steps.append((before, scheduled))
        if tracked.decision is not None:
            tracked.decision.note_step(before + scheduled)

    def _add_save(self, meta: KvstoreConnectorMetadata, tracked: _Request, done_tokens: int) -> None:
        """Save the prompt's full blocks computed by the end of this step that are not stored yet.
        Those vLLM held itself were saved when it computed them (or restored from kvstore)."""
        first = tracked.saved_blocks
        last = min(done_tokens // self._block_size, len(tracked.rank_keys[0]), len(tracked.block_ids))
        if last > first and not self.restores_off:
            parents = [keys[first - 1] if first else None for keys in tracked.rank_keys]
            rank_keys = [keys[first:last] for keys in tracked.rank_keys]
            timeout_s = save_deadline_s((last - first) * self._block_bytes)
            job = TransferJob(tracked.req_id, rank_keys, tracked.block_ids[first:last], timeout_s, parents)
            if self.announce is not None:
                job.announce = self.announce(tracked.req_id, first, last, rank_keys[0])
            meta.saves.append(job)
            tracked.saved_blocks = last

    def _add_audit(self, meta: KvstoreConnectorMetadata, tracked: _Request, done_tokens: int) -> None:
        """Send the audited blocks computed by the end of this step, once, for comparison."""
        audit = tracked.audit
        if audit is None:
            return
        last = min(done_tokens // self._block_size, audit.end_block, len(tracked.block_ids))
        if last > audit.next_block:
            first, audit.next_block = audit.next_block, last
            rank_keys = [keys[first:last] for keys in tracked.rank_keys]
            meta.audits.append(
                TransferJob(tracked.req_id, rank_keys, tracked.block_ids[first:last], audit.timeout_s)
            )
        if audit.next_block >= audit.end_block:
            tracked.audit = None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        observed = connector_output.kv_connector_worker_meta
        if isinstance(observed, ObservedWork):
            if observed.prefill_per_token_s:
                self.calibration.start_from_probe(observed.prefill_per_token_s)
            for tier, nbytes, seconds in observed.transfers:
                self.calibration.observe_transfer(tier, nbytes, seconds)
            for prefix, new, seconds in observed.prefills:
                if self._warmed_up:
                    self.calibration.observe_prefill(prefix, new, seconds)
                # An engine's first forward pass warms it up: 1.8-3.4 s for a 1000-token prompt
                # of the tiny test model on vLLM CPU, with or without this connector, which then
                # takes 0.11 s. Not a figure of prefill speed.
                self._warmed_up = True
            self._calibration_changed = True
            for req_id, _agree, mismatch, largest in observed.audits:
                if mismatch and not self.restores_off:
                    self._stop_restoring(req_id, mismatch, largest)
        for tracked in self._requests.values():
            if tracked.load is not None and tracked.load.sent:
                self._load_done(tracked, tracked.load, connector_output)
            if tracked.decision is not None and tracked.decision.prefilled:
                self._close_decision(tracked)

    def _load_done(self, tracked: _Request, load: _Load, output: KVConnectorOutput) -> None:
        """A sent load's pins go once it ran: after its step, or once the workers report an
        asynchronous one finished (whether vLLM must recompute some of its blocks, too)."""
        if load.asynchronous:
            if tracked.req_id not in (output.finished_recving or ()):
                return  # still loading: its pins hold
            loaded = tracked.block_ids[load.first_block : load.first_block + len(load.tiers)]
            tracked.load_failed = not output.invalid_block_ids.isdisjoint(loaded)
        self._unpin(tracked)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None:
            self._unpin(tracked)
            self._close_decision(tracked)
        return False, None

    def _stop_restoring(self, req_id: str, mismatch: int, largest: float) -> None:
        """The kill switch: stored KV differs from recomputing it, so what kvstore holds of this
        model cannot be trusted. No more restores or saves (until the engine restarts), and its
        blocks are invalidated on the sidecar."""
        self.restores_off = (
            f"the audit of request {req_id} found {mismatch} stored blocks that differ from "
            f"recomputing them (largest difference {largest:.3g} of the block's magnitude)"
        )
        self._stats.set_restores_off()

        def invalidate(kv: Client) -> int:
            return sum(kv.invalidate(fp) for fp in self._fingerprints)

        removed = self._link.call("invalidate", LOOKUP_CAP_S, invalidate)
        log.error(
            "kvstore connector: %s; restoring and saving stop for this model until the engine "
            "restarts, and its %s blocks were invalidated on the sidecar",
            self.restores_off,
            "?" if removed is None else removed,
        )

    def _unpin(self, tracked: _Request) -> None:
        load, tracked.load = tracked.load, None
        if load is not None:
            self._link.release(load.lease_ids)

    def _close_decision(self, tracked: _Request) -> None:
        """Record the decision (once per request)."""
        decision, tracked.decision = tracked.decision, None
        if decision is not None:
            decision.close(self._stats, self._block_size)

    def get_stats(self) -> KvstoreConnectorStats | None:
        """The figures since the last call, with the cost model's inputs when they changed."""
        if self._calibration_changed:
            snap = self.calibration.snapshot()
            self._stats.set_calibration(
                {name: (cost.bandwidth_bytes_per_s, cost.latency_s) for name, cost in snap.tiers.items()},
                (snap.prefill.fixed_s, snap.prefill.per_token_s, snap.prefill.per_token_context_s),
            )
            self._calibration_changed = False
        return self._stats.take()

    def shutdown(self) -> None:
        self._link.close()
