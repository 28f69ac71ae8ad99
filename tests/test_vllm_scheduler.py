"""The connector's scheduler side, step by step, without an engine: a real ``TieredStore`` behind
a thin in-process client, fake vLLM requests and scheduler outputs, a calibration the test picks.

Each test walks vLLM's order of calls — get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, update_connector_output, request_finished — and checks what the plan
loads, what the metadata carries and how many leases the store holds after each step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest

pytest.importorskip("vllm", reason="the scheduler side builds vLLM's connector metadata")

from engine_plugin.breaker import CircuitBreaker
from engine_plugin.calibration import Calibration
from engine_plugin.sidecar import SidecarLink
from engine_plugin.vllm_scheduler import Policy, SchedulerSide
from engine_plugin.vllm_stats import KvstoreConnectorStats, ObservedWork
from kvstore.address import UnixAddress
from kvstore.client import Client, Lookup
from kvstore.cost_model import PrefillModel, TierCost
from kvstore.errors import Unavailable
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.store import Scope, TieredStore
from tests.service_fixtures import MODEL
from tiers.dram import DramConfig, DramTier
from tiers.hbm import HbmConfig, HbmTier

BLOCK_SIZE = MODEL.tokens_per_block  # 16 tokens
FP = MODEL.fingerprint()
SCOPE = Scope("default", FP)
PROMPT = list(range(3, 3 + 8 * BLOCK_SIZE + 5))  # 8 full blocks and 5 tokens: 8 usable blocks
PAGE = 1 << 16

FAST = TierCost(50e9, 0.0)
SLOW = TierCost(1e3, 0.0)  # 8 s a block: recomputing always wins
PREFILL = PrefillModel(fixed_s=0.002, per_token_s=0.0004)  # 53 ms for the prompt


class StoreClient:
    """The calls the scheduler side and its link make of a ``kvstore.client.Client``, answered
    by an in-process store; ``down`` makes every call fail as a sidecar that is not there."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.down = False
        self.lookups = 0

    @contextlib.contextmanager
    def deadline(self, timeout_s: float) -> Iterator[None]:
        yield

    def register(self, identity: object) -> None:
        self._check()

    def lookup_tiers(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float = 0.0, slots: bool = False
    ) -> Lookup:
        self._check()
        self.lookups += 1
        scope = Scope(SCOPE.namespace, Fingerprint(fingerprint))
        found = self.store.lookup(scope, [BlockKey(k) for k in keys], pin_ttl_s or None, slots=slots)
        places = tuple(None if s is None else (s.offset, s.size_bytes) for s in found.slots)
        arena = self.store.arena.arena.name if places and self.store.arena else ""
        return Lookup(
            found.hit_blocks, found.tiers, found.lease.lease_id if found.lease else 0, arena, places
        )

    def release(self, lease_id: int, wait: bool = True) -> None:  # as Client.release
        self._check()
        self.store.release(lease_id)

    def close(self) -> None:
        pass

    def _check(self) -> None:
        if self.down:
            raise Unavailable("connection refused")


class Harness:
    """One scheduler side on a two-tier store (``hbm`` on the CPU above ``dram``)."""

    def __init__(
        self,
        tiers: dict[str, TierCost],
        policy: Policy = "auto",
        audit_fraction: float = 0.0,
        async_load: bool = False,
    ) -> None:
        self.store = TieredStore(
            [
                HbmTier(HbmConfig(capacity_bytes=32 * PAGE, page_bytes=PAGE, device="cpu")),
                DramTier(DramConfig(capacity_bytes=32 * PAGE, page_bytes=PAGE, prefault=False)),
            ]
        )
        self.client = StoreClient(self.store)
        self.stats = KvstoreConnectorStats()
        link = SidecarLink(
            UnixAddress("/fake.sock"),
            lambda: cast(Client, self.client),  # a stand-in answering the calls the link makes
            [MODEL],
            self.stats.add_unreachable,
            CircuitBreaker(),
        )
        calibration = Calibration(tiers, PREFILL)
        try:
            self.side = SchedulerSide(
                link,
                self.stats,
                [MODEL],
                BLOCK_SIZE,
                calibration,
                policy,
                audit_fraction,
                async_load=async_load,
                same_host=True,
            )
        except BaseException:
            self.store.close()  # its arena is not left in /dev/shm by a test of a refusal
            raise
        self.side.explore_fraction = 0.0  # the plan's own choices; exploring is tested on its own

    def put(self, blocks: int, tier: str = "hbm", fast_head: int = 0) -> list[BlockKey]:
        """Store the prompt's first ``blocks`` blocks in ``tier``, but the first ``fast_head``
        in hbm (the tail goes first and down to dram, then the head is stored above it)."""
        keys = block_keys(FP, PROMPT, BLOCK_SIZE)[:blocks]
        tail = keys[fast_head:]
        self.store.put(
            SCOPE,
            tail,
            [bytes(MODEL.block_bytes)] * len(tail),
            parent=keys[fast_head - 1] if fast_head else None,
        )
        if tier == "dram":
            self.store.demote("hbm")
        self.store.put(SCOPE, keys[:fast_head], [bytes(MODEL.block_bytes)] * fast_head)
        return keys

    def leases(self) -> int:
        return self.store.stats().leases

    def ask(self, request: SimpleNamespace, local_tokens: int = 0) -> int:
        tokens, asynchronous = self.side.get_num_new_matched_tokens(request, local_tokens)
        assert asynchronous is False
        return tokens

    def alloc(self, request: SimpleNamespace, external_tokens: int) -> None:
        blocks = SimpleNamespace(get_block_ids=lambda: (list(range(9)),))
        self.side.update_state_after_alloc(request, blocks, external_tokens)

    def schedule(self, request: SimpleNamespace, computed: int, scheduled: int) -> Any:
        """The step that first schedules ``request``: its metadata."""
        new = SimpleNamespace(
            req_id=request.request_id, block_ids=(list(range(9)),), num_computed_tokens=computed
        )
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
        output = SimpleNamespace(
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={request.request_id: scheduled},
        )
        return self.side.build_connector_meta(output)

    def step_done(
        self,
        observed: ObservedWork | None = None,
        received: set[str] | None = None,
        invalid: Sequence[int] = (),
    ) -> None:
        """``received``: the asynchronous loads the workers report done; ``invalid``: the blocks
        they could not restore."""
        output = SimpleNamespace(
            kv_connector_worker_meta=observed, finished_recving=received, invalid_block_ids=set(invalid)
        )
        self.side.update_connector_output(output)

    def idle_step(self) -> Any:
        """A step that schedules nothing (the only request waits for its load): its metadata."""
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
        output = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})
        return self.side.build_connector_meta(output)

    def finish(self, request: SimpleNamespace) -> None:
        assert self.side.request_finished(request) == (False, None)

    def decisions(self) -> list[dict[str, Any]]:
        stats = self.side.get_stats()
        return stats.decisions if isinstance(stats, KvstoreConnectorStats) else []

    def close(self) -> None:
        self.store.close()


def request(req_id: str = "r1", policy: str | None = None) -> SimpleNamespace:
    params = {"kvstore_policy": policy} if policy else None
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=PROMPT,
        lora_request=None,
        cache_salt=None,
        kv_transfer_params=params,
    )


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness({"hbm": FAST, "dram": SLOW})
    yield h
    h.close()


def test_a_hit_is_restored_when_restoring_is_cheaper(harness: Harness) -> None:
    keys = harness.put(8)  # every usable block, in the fast tier
    r = request()
    assert harness.ask(r) == 8 * BLOCK_SIZE
    assert harness.leases() == 1  # pinned between the plan and the load
    harness.alloc(r, 8 * BLOCK_SIZE)
    meta = harness.schedule(r, computed=8 * BLOCK_SIZE, scheduled=5)
    [load] = meta.loads
    assert load.rank_keys == [keys] and load.block_ids == list(range(8))
    assert load.tiers == ("hbm",) * 8
    assert meta.saves == []  # kvstore holds every full block already
    assert harness.leases() == 1  # the step has not run yet
    harness.step_done()  # the worker has copied: the pin goes, the prefill is measured
    assert harness.leases() == 0
    [decision] = harness.decisions()
    assert decision["decision"] == "restore" and decision["restored_tokens"] == 8 * BLOCK_SIZE
    assert decision["hit_tokens"] == 8 * BLOCK_SIZE and decision["actual_ttft_s"] > 0
    harness.finish(r)
    assert harness.decisions() == []  # recorded once


def test_recompute_when_the_cost_model_says_so(harness: Harness) -> None:
    harness.put(8, tier="dram")  # 8 s a block: the prompt's 53 ms of prefill wins
    r = request()
    assert harness.ask(r) == 0
    assert harness.leases() == 0  # the plan loads nothing: the pin went at once
    harness.alloc(r, 0)
    meta = harness.schedule(r, computed=0, scheduled=len(PROMPT))
    assert meta.loads == [] and meta.saves == []  # the hits are stored: nothing to save
    harness.step_done()
    [decision] = harness.decisions()
    assert decision["decision"] == "recompute" and decision["restored_tokens"] == 0
    assert decision["hit_tokens"] == 8 * BLOCK_SIZE


def test_close_calls_now_and_then_take_the_other_side_so_both_stay_measured() -> None:
    # restoring the 8 dram blocks predicted at ~50 ms against ~53 ms of prefill: a close call
    close = Harness({"hbm": FAST, "dram": TierCost(8 * MODEL.block_bytes / 0.05, 0.0)})
    far = Harness({"hbm": FAST, "dram": SLOW})  # 8 s a block: restoring is never worth a look
    try:
        for h in (close, far):
            h.side.explore_fraction = 0.5
            h.put(8, tier="dram")
        taken: dict[str, set[int]] = {"close": set(), "far": set()}
        for i in range(30):
            for name, h in (("close", close), ("far", far)):
                r = request(f"r{i}")
                taken[name].add(h.ask(r))
                h.finish(r)
        assert taken["close"] == {0, 8 * BLOCK_SIZE}  # the plan's side, and now and then the other
        assert taken["far"] == {0}
        assert close.leases() == far.leases() == 0
    finally:
        close.close()
        far.close()


def test_a_partial_restore_loads_the_fast_head_and_recomputes_the_slow_tail(harness: Harness) -> None:
    keys = harness.put(8, tier="dram", fast_head=3)
    r = request()
    assert harness.ask(r) == 3 * BLOCK_SIZE
    harness.alloc(r, 3 * BLOCK_SIZE)
    [load] = harness.schedule(r, computed=3 * BLOCK_SIZE, scheduled=len(PROMPT) - 3 * BLOCK_SIZE).loads
    assert load.rank_keys == [keys[:3]] and load.block_ids == [0, 1, 2] and load.tiers == ("hbm",) * 3
    harness.step_done()
    assert harness.leases() == 0
    [decision] = harness.decisions()
    assert decision["decision"] == "partial" and decision["restored_tokens"] == 3 * BLOCK_SIZE


@pytest.mark.parametrize(
    ("tier", "policy", "tokens", "decision"),
    [("hbm", "recompute", 0, "recompute"), ("dram", "restore", 8 * BLOCK_SIZE, "restore")],
)
def test_a_request_overrides_the_policy(
    harness: Harness, tier: str, policy: str, tokens: int, decision: str
) -> None:
    harness.put(8, tier=tier)  # the plan would do the opposite of what the request asks
    r = request(policy=policy)
    assert harness.ask(r) == tokens
    assert harness.leases() == (1 if tokens else 0)
    harness.finish(r)
    assert harness.leases() == 0
    [record] = harness.decisions()
    assert record["decision"] == decision and record["actual_ttft_s"] is None  # never prefilled


def test_an_unknown_request_policy_falls_back_to_the_connectors(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.put(8)
    assert harness.ask(request(policy="sometimes")) == 8 * BLOCK_SIZE  # auto: restoring wins
    assert "policy is 'auto', 'restore' or 'recompute', got 'sometimes'; using auto" in caplog.text


def test_what_vllm_holds_is_neither_looked_up_nor_restored_nor_saved(harness: Harness) -> None:
    keys = harness.put(8)
    r = request()
    assert harness.ask(r, local_tokens=3 * BLOCK_SIZE) == 5 * BLOCK_SIZE  # only the 5 after vLLM's
    harness.alloc(r, 5 * BLOCK_SIZE)
    meta = harness.schedule(r, computed=8 * BLOCK_SIZE, scheduled=5)
    [load] = meta.loads
    assert load.rank_keys == [keys[3:8]] and load.block_ids == [3, 4, 5, 6, 7]
    assert meta.saves == []
    harness.step_done()
    [decision] = harness.decisions()
    assert decision["local_tokens"] == 3 * BLOCK_SIZE
    assert decision["hit_tokens"] == decision["restored_tokens"] == 5 * BLOCK_SIZE
    # vLLM holds every usable block: there is nothing to ask kvstore.
    lookups = harness.client.lookups
    assert harness.ask(request("r2"), local_tokens=8 * BLOCK_SIZE) == 0
    assert harness.client.lookups == lookups
    # A local hit that is not whole blocks would not line up with kvstore's: nothing either.
    assert harness.ask(request("r3"), local_tokens=BLOCK_SIZE + 1) == 0
    assert harness.client.lookups == lookups


def test_blocks_computed_after_a_hit_are_saved_once(harness: Harness) -> None:
    keys = block_keys(FP, PROMPT, BLOCK_SIZE)
    harness.put(2)  # kvstore holds the first two blocks
    r = request()
    assert harness.ask(r) == 2 * BLOCK_SIZE
    harness.alloc(r, 2 * BLOCK_SIZE)
    meta = harness.schedule(r, computed=2 * BLOCK_SIZE, scheduled=len(PROMPT) - 2 * BLOCK_SIZE)
    [save] = meta.saves
    assert save.rank_keys == [keys[2:8]] and save.block_ids == [2, 3, 4, 5, 6, 7]
    assert save.parents == [keys[1]]  # the chain continues after the restored blocks


def test_pins_are_released_on_every_path(harness: Harness) -> None:
    harness.put(8)
    # vLLM allocates none of the planned tokens: the pin goes.
    harness.ask(request("allocated-none"))
    harness.alloc(request("allocated-none"), 0)
    assert harness.leases() == 0
    # The request finishes before its load is sent.
    harness.ask(request("finished-early"))
    assert harness.leases() == 1
    harness.finish(request("finished-early"))
    assert harness.leases() == 0
    # The request finishes while its load is in flight.
    harness.ask(request("in-flight"))
    harness.alloc(request("in-flight"), 8 * BLOCK_SIZE)
    harness.schedule(request("in-flight"), computed=8 * BLOCK_SIZE, scheduled=5)
    harness.finish(request("in-flight"))
    assert harness.leases() == 0
    # Asked again (it could not be scheduled): the old pin goes, the new one stays.
    harness.ask(request("asked-twice"))
    harness.ask(request("asked-twice"))
    assert harness.leases() == 1
    harness.finish(request("asked-twice"))
    assert harness.leases() == 0
    assert harness.stats.unreachable == {}


def test_a_sidecar_that_is_down_gives_no_external_tokens(harness: Harness) -> None:
    harness.put(8)
    harness.client.down = True
    r = request()
    assert harness.ask(r) == 0  # the call failed twice (one reconnect): the breaker opens
    assert harness.ask(request("r2")) == 0  # refused by the open breaker, no call made
    assert harness.stats.unreachable == {"lookup": 2}
    assert harness.leases() == 0
    harness.finish(r)
    [decision] = harness.decisions()
    assert decision["decision"] == "recompute" and decision["hit_tokens"] == 0


def test_an_audit_recomputes_the_hit_and_sends_its_blocks_for_comparison_as_they_are_computed() -> None:
    h = Harness({"hbm": FAST, "dram": SLOW}, audit_fraction=1.0)
    try:
        keys = h.put(8)
        r = request()
        assert h.ask(r) == 0  # the plan would restore 8 blocks: audited, so recomputed
        assert h.leases() == 0  # nothing to load: the pin went at once
        h.alloc(r, 0)
        first = h.schedule(r, computed=0, scheduled=3 * BLOCK_SIZE + 7)  # a chunk: 3 blocks done
        assert first.loads == [] and first.saves == []  # held already: nothing to save either
        [audit] = first.audits
        assert audit.rank_keys == [keys[:3]] and audit.block_ids == [0, 1, 2]
        h.step_done(ObservedWork(audits=[("r1", 3, 0, 0.0)]))  # they agree
        cached = SimpleNamespace(
            req_ids=["r1"],
            new_block_ids=[None],
            num_computed_tokens=[3 * BLOCK_SIZE + 7],
            resumed_req_ids=set(),
        )
        output = SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"r1": len(PROMPT)}
        )
        [rest] = h.side.build_connector_meta(output).audits  # the next chunk: the other 5, once
        assert rest.rank_keys == [keys[3:8]] and rest.block_ids == [3, 4, 5, 6, 7]
        assert h.side.build_connector_meta(output).audits == []
        h.step_done()
        assert h.decisions() == []  # an audit is not a measured decision
        assert not h.side.restores_off
    finally:
        h.close()


def test_a_mismatch_stops_lookups_restores_and_saves_and_invalidates() -> None:
    h = Harness({"hbm": FAST, "dram": SLOW}, audit_fraction=1.0)
    invalidated: list[bytes] = []

    def invalidate(fp: bytes) -> int:
        invalidated.append(fp)
        return 8

    h.client.invalidate = invalidate  # type: ignore[attr-defined]
    try:
        h.put(8)
        r = request()
        assert h.ask(r) == 0
        h.alloc(r, 0)
        h.schedule(r, computed=0, scheduled=len(PROMPT))
        h.step_done(ObservedWork(audits=[("r1", 6, 2, 0.8)]))
        assert "found 2 stored blocks that differ" in h.side.restores_off
        assert invalidated == [FP]
        stats = h.side.get_stats()
        assert stats is not None and stats.data["restores_off"]
        h.finish(r)
        lookups = h.client.lookups
        again = request("r2")
        assert h.ask(again) == 0 and h.client.lookups == lookups  # not even asked
        h.alloc(again, 0)
        meta = h.schedule(again, computed=0, scheduled=len(PROMPT))
        assert meta.loads == [] and meta.saves == [] and meta.audits == []
    finally:
        h.close()


def test_audit_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="audit_fraction"):
        Harness({"hbm": FAST}, audit_fraction=1.5)


@pytest.mark.parametrize(
    ("stored", "policy", "local", "says"),
    [
        ({}, None, 0, "recompute all 133 tokens (a full miss: none of the 8 blocks is in kvstore; predicted"),
        ({"blocks": 8}, None, 0, "restore 128 tokens from hbm, compute 5 (predicted "),
        (
            {"blocks": 8, "tier": "dram"},
            None,
            0,
            "recompute all 133 tokens (restoring the 128 hit tokens from dram predicted ",
        ),
        (
            {"blocks": 8, "tier": "dram", "fast_head": 3},
            None,
            0,
            "restore 48 of 128 hit tokens from hbm, compute 85",
        ),
        ({"blocks": 8}, "recompute", 0, "recompute all 133 tokens (the policy is recompute; predicted"),
        (
            {"blocks": 8},
            None,
            4 * BLOCK_SIZE,
            "vLLM's own cache holds 64 tokens; restore 64 tokens from hbm, compute 5 (predicted ",
        ),
        (
            {},
            None,
            8 * BLOCK_SIZE,
            "vLLM's own cache holds 128 tokens; recompute the other 5 (nothing to restore: vLLM's own",
        ),
        (
            {},
            None,
            7 * BLOCK_SIZE,
            "recompute the other 21 (a full miss: the one block after vLLM's own is not in kvstore; ",
        ),
    ],
    ids=[
        "full-miss",
        "restore",
        "slower-restore",
        "partial",
        "policy",
        "after-vllms-own",
        "vllm-holds-all",
        "one-block-miss",
    ],
)
def test_each_decision_is_one_log_line_that_says_what_happened(
    harness: Harness,
    caplog: pytest.LogCaptureFixture,
    stored: dict[str, Any],
    policy: str | None,
    local: int,
    says: str,
) -> None:
    if stored:
        harness.put(**stored)
    r = request(policy=policy)
    caplog.set_level("INFO", logger="vllm.engine_plugin.vllm_decisions")
    restored = harness.ask(r, local_tokens=local)
    harness.alloc(r, restored)
    harness.schedule(r, computed=local + restored, scheduled=len(PROMPT) - local - restored)
    harness.step_done()
    harness.finish(r)
    lines = [rec.getMessage() for rec in caplog.records if rec.name.endswith("vllm_decisions")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("request r1: ") and says in lines[0], lines[0]
    assert "measured " in lines[0] and "recompute 0 tokens" not in lines[0]


def test_a_sidecar_that_does_not_answer_is_the_logged_reason(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.put(8)
    harness.client.down = True
    caplog.set_level("INFO", logger="vllm.engine_plugin.vllm_decisions")
    r = request()
    assert harness.ask(r) == 0
    harness.finish(r)
    [line] = [rec.getMessage() for rec in caplog.records if rec.name.endswith("vllm_decisions")]
    assert "recompute all 133 tokens (the sidecar gave no answer to the lookup" in line
    assert "not measured" in line  # it finished before its prefill ran


def test_the_engines_first_timed_prefill_is_not_learned_but_the_next_one_scales_the_curve(
    harness: Harness,
) -> None:
    start = harness.side.calibration.snapshot().prefill
    harness.step_done(ObservedWork(prefills=[(0, 1000, 2.0)]))  # the warm-up: 20x the truth
    assert harness.side.calibration.snapshot().prefill == start
    truth_s = start.seconds(0, 1000) / 4  # the engine is 4x faster than the starting curve
    harness.step_done(ObservedWork(prefills=[(0, 1000, truth_s)]))
    learned = harness.side.calibration.snapshot().prefill
    assert learned.seconds(0, 1000) == pytest.approx(truth_s)
    assert learned.seconds(0, 300) == pytest.approx(start.seconds(0, 300) / 4)  # its shape kept


def test_a_restore_not_out_of_dram_runs_beside_the_steps_and_holds_its_pins_until_done() -> None:
    h = Harness({"hbm": FAST, "dram": SLOW}, async_load=True)
    try:
        keys = h.put(8)  # in hbm: not a same-host copy out of the dram arena
        r = request()
        assert h.side.get_num_new_matched_tokens(r, 0) == (8 * BLOCK_SIZE, True)
        h.alloc(r, 8 * BLOCK_SIZE)  # vLLM parks it in WAITING_FOR_REMOTE_KVS, unscheduled
        [load] = h.idle_step().loads  # sent by itself, in the next step's metadata
        assert load.asynchronous and load.rank_keys == [keys] and load.block_ids == list(range(8))
        h.step_done()
        assert h.leases() == 1  # still loading: the pin holds past the step
        assert h.idle_step().loads == []  # sent once
        h.step_done(received={"r1"})
        assert h.leases() == 0
        h.alloc(r, 0)  # vLLM schedules it with the loaded tokens computed
        meta = h.schedule(r, computed=8 * BLOCK_SIZE, scheduled=5)
        assert meta.loads == [] and meta.saves == []
        h.step_done()
        [decision] = h.decisions()
        assert decision["decision"] == "restore" and decision["restored_tokens"] == 8 * BLOCK_SIZE
    finally:
        h.close()


def test_an_asynchronous_load_that_restored_nothing_is_recomputed_not_tried_again() -> None:
    h = Harness({"hbm": FAST, "dram": SLOW}, async_load=True)
    try:
        keys = h.put(8)
        r = request()
        assert h.side.get_num_new_matched_tokens(r, 0) == (8 * BLOCK_SIZE, True)
        h.alloc(r, 8 * BLOCK_SIZE)
        h.idle_step()
        h.step_done(received={"r1"}, invalid=range(8))
        assert h.leases() == 0
        lookups = h.client.lookups
        # vLLM freed its blocks and asks again: recompute, no second lookup or load
        assert h.side.get_num_new_matched_tokens(r, 0) == (0, False)
        assert h.client.lookups == lookups
        h.alloc(r, 0)
        meta = h.schedule(r, computed=0, scheduled=len(PROMPT))
        assert meta.loads == []
        [save] = meta.saves  # saved again as computed (a no-op for blocks kvstore still holds)
        assert save.rank_keys == [keys]
    finally:
        h.close()


def test_a_copy_out_of_dram_on_this_host_stays_in_the_step() -> None:
    h = Harness({"hbm": FAST, "dram": FAST}, async_load=True)
    try:
        h.put(8, tier="dram")
        r = request()
        assert h.side.get_num_new_matched_tokens(r, 0) == (8 * BLOCK_SIZE, False)  # a memcpy
        h.alloc(r, 8 * BLOCK_SIZE)
        assert h.idle_step().loads == []  # loaded only in the step that schedules it
        [load] = h.schedule(r, computed=8 * BLOCK_SIZE, scheduled=5).loads
        assert not load.asynchronous
    finally:
        h.close()
