"""The fleet simulation behind ``kvstore bench fleet`` (``benchmarks/fleet_sim.py``): keys chain
like the real ones, the policies behave as the routing library says, a remote tier lets any
replica find what another computed, and the load bound holds at every admission."""

from __future__ import annotations

import random

from benchmarks.fleet_sim import WORKLOADS, FleetSpec, Prompt, keys_moved, simulate, single_replica_hit_rate
from kvstore.cost_model import PrefillModel, TierCost
from kvstore.routing.policies import BoundedRendezvous, load_bound

MB = 1_000_000
PREFILL = PrefillModel(fixed_s=0.015, per_token_s=50e-6)
TIERS = {"dram": TierCost(10_000 * MB, 0.0005), "remote": TierCost(1_000 * MB, 0.003)}


def spec(replicas: int = 4, remote: bool = False) -> FleetSpec:
    return FleetSpec(
        replicas=replicas,
        local_blocks=1500,
        remote_blocks=1500 * replicas if remote else 0,
        tiers=TIERS,
        prefill=PREFILL,
        block_bytes=2 * MB,
        slots=8,  # with a mean of ~6 in flight the load bound leaves a prefix room to stick
    )


def test_prompts_that_share_a_head_share_its_keys_and_tenants_never_do() -> None:
    a = Prompt("t1", (("system", 64), ("turn-a", 40)))
    b = Prompt("t1", (("system", 64), ("turn-b", 40)))
    other = Prompt("t2", (("system", 64), ("turn-a", 40)))
    ka, kb, ko = a.keys(16), b.keys(16), other.keys(16)
    assert len(ka) == 104 // 16 and ka[:4] == kb[:4] and ka[4] != kb[4]
    assert not set(ka) & set(ko)


def test_routing_by_prefix_finds_more_than_round_robin_and_a_remote_tier_more_still() -> None:
    sessions = WORKLOADS["chats"](random.Random(3), 120)
    round_robin = simulate(sessions, spec(), "round-robin")
    rendezvous = simulate(sessions, spec(), "rendezvous")
    remote = simulate(sessions, spec(remote=True), "round-robin")
    assert rendezvous.hit_rate > round_robin.hit_rate + 0.1  # a conversation finds its history
    assert remote.hit_rate > round_robin.hit_rate + 0.1  # any replica finds any history
    assert round_robin.first_choice == round_robin.requests  # it has no other choice
    reference = single_replica_hit_rate(sessions, spec())
    assert max(round_robin.hit_rate, rendezvous.hit_rate, remote.hit_rate) <= reference + 0.01


def test_cost_aware_saves_at_least_what_rendezvous_saves_on_a_shared_system_prompt() -> None:
    sessions = WORKLOADS["tenants"](random.Random(5), 120)
    cost = simulate(sessions, spec(), "cost")
    rendezvous = simulate(sessions, spec(), "rendezvous")
    assert cost.saved_s >= rendezvous.saved_s
    assert cost.requests == rendezvous.requests == sum(len(s) for s in sessions)


def test_a_flood_of_one_prefix_is_spread_within_the_bound_at_every_admission() -> None:
    policy = BoundedRendezvous([f"r{i}" for i in range(8)], slack=1.25)
    rng = random.Random(1)
    loads = [0] * 8
    from kvstore.routing.policies import RouteRequest

    for _ in range(2000):
        if rng.random() < 0.45 and sum(loads):  # a request somewhere finishes
            loads[rng.choice([i for i, n in enumerate(loads) if n])] -= 1
            continue
        bound = load_bound(loads, 1.25)
        choice = policy.choose(RouteRequest(b"one hot system prompt"), loads)
        assert loads[choice.replica] < bound
        loads[choice.replica] += 1


def test_rendezvous_moves_about_one_nth_on_a_join_and_modulo_nearly_everything() -> None:
    rendezvous, modulo = keys_moved(8, keys=20_000)
    assert rendezvous * 8 <= 1.2 and modulo > 0.8


def test_the_bench_measures_both_remote_tiers_against_a_plain_redis_client() -> None:
    from benchmarks.fleet import measure_remotes

    figures, rows = measure_remotes(count=4, rounds=1)
    assert set(figures) == {"redis", "kvstore"}
    assert all(
        f.get_bytes_per_s > 0 and f.put_bytes_per_s > 0 and f.one_block_get_s > 0 for f in figures.values()
    )
    assert [r.metric for r in rows] == [
        "redis tier get",
        "redis tier put",
        "kvstore tier get",
        "kvstore tier put",
    ]
    assert all(r.ratio is not None and r.ratio > 0 for r in rows)
