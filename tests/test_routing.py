"""Routing policies and the router (``kvstore/routing``): the policies on simulated loads and
hits, the router over two real sidecars whose answers steer the cost-aware policy."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator

import pytest

from kvstore.client import connect
from kvstore.cost_model import PrefillModel, TierCost
from kvstore.errors import Unavailable
from kvstore.routing import (
    BoundedRendezvous,
    ConsistentHash,
    CostAware,
    RoundRobin,
    Router,
    RouteRequest,
    SidecarProbe,
)
from kvstore.routing.policies import held_bound, load_bound
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from tests.service_fixtures import MODEL, settings_for

REPLICAS = [f"replica-{i}" for i in range(4)]
MB = 1_000_000
TIERS = {
    "dram": TierCost(5_000 * MB, 0.0002),
    "nvme": TierCost(1_000 * MB, 0.001),
    "remote": TierCost(500 * MB, 0.002),
}
PREFILL = PrefillModel(fixed_s=0.005, per_token_s=0.0004)
BLOCK_BYTES, TPB = 2 * MB, 16


def request(prefix: int, hits: list[tuple[str, ...]] | None = None, tokens: int = 2048) -> RouteRequest:
    return RouteRequest(prefix.to_bytes(32, "big"), tokens, tuple(hits or ()))


def cost_aware(queue_penalty_s: float = 0.05) -> CostAware:
    return CostAware(REPLICAS, TIERS, PREFILL, BLOCK_BYTES, TPB, queue_penalty_s=queue_penalty_s)


def test_no_policy_chooses_a_replica_that_is_down() -> None:
    down = frozenset({1, 2})
    # replica 1 holds the prompt, and is down all the same
    held: list[tuple[str, ...]] = [("dram",) * 64 if i == 1 else () for i in range(4)]
    for policy in (RoundRobin(REPLICAS), ConsistentHash(REPLICAS), BoundedRendezvous(REPLICAS), cost_aware()):
        chosen = Counter(policy.choose(request(p, held), [0, 0, 0, 0], down).replica for p in range(200))
        assert set(chosen) == {0, 3}, type(policy).__name__  # the load spreads over those up
    router = Router(REPLICAS, BoundedRendezvous(REPLICAS), lambda: None, TPB)
    with pytest.raises(Unavailable):
        router.admit(request(1), frozenset(range(4)))


def test_round_robin_takes_turns() -> None:
    policy = RoundRobin(REPLICAS)
    assert [policy.choose(request(1), [0] * 4).replica for _ in range(6)] == [0, 1, 2, 3, 0, 1]


def test_consistent_hashing_keeps_a_prefix_on_one_replica_and_spreads_prefixes() -> None:
    policy = ConsistentHash(REPLICAS)
    assert len({policy.choose(request(7), [9, 0, 0, 0]).replica for _ in range(5)}) == 1  # load ignored
    spread = Counter(policy.choose(request(p), [0] * 4).replica for p in range(4000))
    assert len(spread) == 4 and max(spread.values()) / min(spread.values()) < 1.6


def test_the_load_bound_is_slack_times_the_mean_after_routing_rounded_down() -> None:
    assert load_bound([0, 0, 0, 0], 1.25) == 1  # too few for the slack: the least loaded takes it
    assert load_bound([3, 3, 2, 0], 1.25) == 2  # floor(1.25 * 9 / 4)
    assert load_bound([8, 8, 8, 7], 1.25) == 10  # floor(1.25 * 32 / 4)
    assert load_bound([5, 5, 5, 5], 1.0) == 6  # no slack: the least loaded, plus one
    with pytest.raises(ValueError, match="slack"):
        BoundedRendezvous(REPLICAS, slack=0.9)


def test_bounded_rendezvous_sticks_to_a_prefix_until_its_replica_is_busy() -> None:
    policy = BoundedRendezvous(REPLICAS, slack=1.25)
    idle = policy.choose(request(42), [0] * 4)
    assert idle.replica == idle.first
    # a flood of one prefix, none finishing: every replica stays within the bound
    loads = [0] * 4
    for _ in range(40):
        choice = policy.choose(request(42), loads)
        assert loads[choice.replica] < load_bound(loads, 1.25)
        loads[choice.replica] += 1
    assert max(loads) <= 1.25 * sum(loads) / 4  # max/mean within the slack
    assert min(loads) > 0


def test_cost_aware_goes_where_the_prefix_is_cheapest_to_restore() -> None:
    policy = cost_aware()
    # replica 2 holds 100 blocks in dram, replica 1 the same in nvme, the others nothing
    hits = [(), ("nvme",) * 100, ("dram",) * 100, ()]
    assert policy.choose(request(5, hits), [0] * 4).replica == 2
    # replica 2 is busy: its queue costs more than reading nvme on replica 1
    assert policy.choose(request(5, hits), [0, 0, 4, 0]).replica == 1
    # blocks only the fleet's remote tier holds are reachable from every replica alike
    remote: list[tuple[str, ...]] = [("remote",) * 100] * 4
    choice = policy.choose(request(5, remote), [0] * 4)
    assert choice.replica == choice.first  # ties go by the rendezvous order


def test_cost_aware_prefers_recompute_on_an_idle_replica_to_a_long_queue() -> None:
    policy = cost_aware(queue_penalty_s=1.0)
    hits = [("dram",) * 8, (), (), ()]  # a small prefix: 128 tokens saved
    assert policy.choose(request(9, hits, tokens=512), [2, 0, 0, 0]).replica != 0


def test_cost_aware_spreads_a_flood_within_the_bound() -> None:
    policy = cost_aware(queue_penalty_s=0.0)  # the bound alone must spread it
    hits = [("dram",) * 100, (), (), ()]
    loads = [0] * 4
    for _ in range(40):
        choice = policy.choose(request(3, hits), loads)
        assert loads[choice.replica] < load_bound(loads, 1.25)
        loads[choice.replica] += 1
    assert max(loads) <= 1.25 * sum(loads) / 4


def _churn(
    policy: RoundRobin | BoundedRendezvous | CostAware, replicas: int, seed: int
) -> tuple[float, float]:
    """A seeded stream of arrivals (hot and cold prefixes) and departures around ~2 or ~6 in flight
    a replica; every routed replica's load checked against ``held_bound`` right after routing.
    Returns the largest routed load over its bound and the mean of max/mean where m >= 1 and whole
    requests allow the slack (ceil(m) <= 1.25 m)."""
    rng = random.Random(seed)
    loads = [0] * replicas
    worst, ratios = 0.0, list[float]()
    for step in range(6000):
        target = (2 if (step // 1500) % 2 else 6) * replicas  # the fleet fills and drains by turns
        in_flight = sum(loads)
        if in_flight and rng.random() < in_flight / (in_flight + target):  # a request finishes
            loads[rng.choices(range(replicas), weights=loads)[0]] -= 1  # any one in flight, alike
            continue
        prefix = rng.randrange(5) if rng.random() < 0.6 else rng.randrange(10**6)  # 60% hot prefixes
        hits = tuple(("dram",) * 50 if i == prefix % replicas else () for i in range(replicas))
        chosen = policy.choose(request(prefix, list(hits)), loads).replica
        loads[chosen] += 1
        in_flight = sum(loads)
        worst = max(worst, loads[chosen] / held_bound(in_flight, replicas, 1.25))
        mean = in_flight / replicas
        if mean >= 1 and -(-in_flight // replicas) <= 1.25 * mean:
            ratios.append(max(loads) / mean)
    return worst, sum(ratios) / len(ratios)


@pytest.mark.parametrize("replicas", [4, 64])
def test_bounded_policies_hold_the_load_bound_at_4_and_64_replicas(replicas: int) -> None:
    names = [f"replica-{i}" for i in range(replicas)]
    cost = CostAware(names, TIERS, PREFILL, BLOCK_BYTES, TPB, queue_penalty_s=0.0)  # the bound alone
    for policy in (BoundedRendezvous(names, slack=1.25), cost):
        worst, max_over_mean = _churn(policy, replicas, seed=replicas)
        assert worst <= 1.0, type(policy).__name__  # every routed replica within max(ceil(m), 1.25 m)
        # Fleet-wide, where whole requests allow the slack: requests finishing elsewhere (routing
        # moves none) leave a replica above it between routings; at 64 replicas, by 1.22-1.26 on
        # average over seeds (round robin: 1.78-1.88).
        assert max_over_mean <= (1.25 if replicas == 4 else 1.3), type(policy).__name__
    # the bound is no formality: taking turns, blind to load, breaks it on the same stream
    assert _churn(RoundRobin(names), replicas, seed=replicas)[0] > 1.0
    # and the slack alone cannot be held at small means: 130 in flight over 64, someone holds 3
    assert held_bound(130, 64, 1.25) == 3 and held_bound(32, 4, 1.25) == 10


class Sidecar:
    def __init__(self) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
        self.server: RunningServer = start_server(
            load_settings(env={}, overrides=settings_for(self.data_dir))
        )

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_sidecars() -> Iterator[list[Sidecar]]:
    made = [Sidecar(), Sidecar()]
    yield made
    for s in made:
        s.close()


def test_the_router_sends_a_prompt_to_the_replica_whose_sidecar_holds_it(two_sidecars: list[Sidecar]) -> None:
    fp = MODEL.fingerprint()
    tokens = list(range(1, 16 * 40 + 1))  # 40 blocks
    names = ["a", "b"]
    probe = SidecarProbe([s.server.unix_address for s in two_sidecars], timeout_s=1.0)
    costs = {"dram": TierCost(5_000 * MB, 0.0002)}
    policy = CostAware(names, costs, PREFILL, MODEL.block_bytes, MODEL.tokens_per_block, queue_penalty_s=0.01)
    router = Router(names, policy, fp, MODEL.tokens_per_block, probe=probe)
    try:
        request, keys = router.request_for(tokens)
        holder = 1 - BoundedRendezvous(names).order(request)[0]  # not the rendezvous favourite
        with connect(two_sidecars[holder].server.unix_address) as kv:
            kv.register(MODEL)
            kv.write(fp, keys, [os.urandom(MODEL.block_bytes) for _ in keys])
        with router.route(tokens) as routed:
            assert routed.replica == holder and routed.cached_tokens == 40 * 16
            assert router.stats().in_flight[holder] == 1
        stats = router.stats()
        assert stats.routed == 1 and stats.first_choice == 1 and stats.in_flight == (0, 0)
        # a prompt nobody holds goes by the rendezvous order, and counts no cached tokens
        other = list(range(5000, 5000 + 16 * 40))
        with router.route(other) as routed:
            assert routed.cached_tokens == 0
            assert routed.replica == BoundedRendezvous(names).order(router.request_for(other)[0])[0]
    finally:
        probe.close()


def test_a_sidecar_that_cannot_answer_counts_as_holding_nothing() -> None:
    probe = SidecarProbe(["unix:///nonexistent/kvstore.sock"], timeout_s=0.2)
    try:
        assert probe.hits(MODEL.fingerprint(), [bytes(32)]) == [()]
    finally:
        probe.close()
