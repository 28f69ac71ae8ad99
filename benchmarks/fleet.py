"""``kvstore bench fleet``: a fleet on this machine: its remote tiers measured for real, its routing
policies simulated for 4 and 64 replicas on the brief's workloads.

Measured (real processes on 127.0.0.1): a three-master Redis Cluster and two kvstore servers in
the shared role; blocks of a named real model (Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x
K and V x 2 bytes = 128 KiB per token, 16-token blocks of 2 MiB) written and read through the
``redis`` and ``kvstore`` remote tiers, against a plain redis-py cluster client pipelining the
same blocks under the same keys layout; each tier's put and get sealed (what a sidecar with
encryption on sends) against plain, rounds alternating (``benchmarks.sealed_costs``). And the
share of keys that move when a node joins:
rendezvous hashing against modulo hashing.

Replayed on real sidecars (``benchmarks/fleet_real.py``): four ``kvstore serve`` processes, with
and without a shared kvstore server under them, a short agent trace routed by the real router,
each request restored and stored through the chosen sidecar as the connector would.

Simulated (``benchmarks/fleet_sim.py``): 4 and 64 replicas, each with its own cache, with no
remote tier or with the kvstore or Redis remote tier priced at the restore bandwidth measured
above, under round robin, consistent hashing, bounded-load rendezvous and the cost-aware policy.
Prefill times come from a calibration curve: ``--calibration FILE`` (``kvstore bench
calibrate``), else a curve for Llama-3.1-8B on one datacenter GPU (15 ms + 50 us per token, an
assumption stated in the output, not a measurement here). A replica's own cache restores at
10 GB/s (a host-to-device copy; also an assumption on this GPU-less machine).

Targets, each a ratio within this run: fleet token hit rate with cost-aware routing and a remote
tier >= 0.9x one replica holding the whole fleet's cache and serving the same trace (its prompts
in the order they reached the fleet under cost-aware routing); each request routed to a replica
holding at most max(ceil(m), floor(1.25 m)) right after (m: the mean in flight then; the slack
where whole requests can meet it: ``kvstore.routing.policies.held_bound``); keys moved on a join
<= 1.2/N; the redis tier's get >= 0.8x the plain client's;
cost-aware routing's saved prefill seconds >= bounded rendezvous's on every workload.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.common import Result, plot_title, print_results, write_json
from benchmarks.fleet_sim import (
    WORKLOADS,
    FleetSpec,
    RunFigures,
    keys_moved,
    simulate,
    single_replica_hit_rate,
)
from benchmarks.redis_cluster import RedisClusterProcess, RedisUnavailable
from benchmarks.sealed_costs import remote_tier_rows
from benchmarks.service_setup import TOKEN, bench_server
from kvstore.cost_model import PrefillModel, TierCost

BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # Llama-3.1-8B, bf16 KV
TOKENS_PER_BLOCK = 16
BLOCK_BYTES = BYTES_PER_TOKEN * TOKENS_PER_BLOCK  # 2 MiB
GPU_PREFILL = PrefillModel(fixed_s=0.015, per_token_s=50e-6, per_token_context_s=1e-9)
LOCAL_RESTORE = TierCost(10e9, 0.0005)
POLICIES = ("round-robin", "hash", "rendezvous", "cost")
SLACK = 1.25


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RemoteFigures:
    get_bytes_per_s: float
    put_bytes_per_s: float
    one_block_get_s: float

    def cost(self) -> TierCost:
        latency = max(0.0, self.one_block_get_s - BLOCK_BYTES / self.get_bytes_per_s)
        return TierCost(self.get_bytes_per_s, latency)


def _rate(run: Callable[[], object], nbytes: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def measure_remotes(count: int, rounds: int) -> tuple[dict[str, RemoteFigures], list[Result]]:
    """The redis and kvstore remote tiers and a plain redis-py cluster client, same blocks."""
    from redis.cluster import RedisCluster

    from kvstore.remote.nodes import KvStoreNodesTier
    from kvstore.store import Scope, tier_key
    from kvstore.store.model import shared_key_name
    from tiers.redis_cluster import RedisClusterTier
    from tiers.remote import RemoteBlock, RemoteConfig

    rng = np.random.default_rng(0)
    fp = bytes(range(32))
    scope = Scope("t/local", fp)  # type: ignore[arg-type]
    keys = [tier_key(scope, i.to_bytes(32, "big")) for i in range(count)]  # type: ignore[arg-type]
    payloads = [rng.bytes(BLOCK_BYTES) for _ in range(count)]
    blocks = [RemoteBlock(k, fp, p) for k, p in zip(keys, payloads, strict=True)]
    total = count * BLOCK_BYTES
    figures: dict[str, RemoteFigures] = {}
    with RedisClusterProcess(masters=3) as cluster:
        host, _, port = cluster.nodes[0].rpartition(":")
        plain = RedisCluster(host=host, port=int(port))
        names = [b"plain:" + shared_key_name(k) for k in keys]

        def plain_put() -> None:
            pipe = plain.pipeline(transaction=False)
            for name, payload in zip(names, payloads, strict=True):
                pipe.set(name, payload)
            pipe.execute()

        def plain_get() -> None:
            pipe = plain.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            assert all(v is not None for v in pipe.execute())

        _progress("remote tiers: plain redis-py cluster client …")
        plain_put_rate = _rate(plain_put, total, rounds)
        plain_get_rate = _rate(plain_get, total, rounds)
        plain.close()
        tier = RedisClusterTier(RemoteConfig(nodes=cluster.nodes, timeout_s=10.0), key_name=shared_key_name)
        try:
            _progress("remote tiers: the redis tier …")
            put_rate = _rate(lambda: tier.put_many(blocks), total, rounds)
            get_rate = _rate(lambda: tier.get_many(keys, fp), total, rounds)
            one = _rate(lambda: tier.get_many(keys[:1], fp), BLOCK_BYTES, rounds)
            figures["redis"] = RemoteFigures(get_rate, put_rate, BLOCK_BYTES / one)
        finally:
            tier.close()
    nodes = [bench_server(arena_bytes=max(256 << 20, 2 * total)) for _ in range(2)]
    try:
        config = RemoteConfig(nodes=tuple(n.tcp for n in nodes), tokens={"t/local": TOKEN}, timeout_s=10.0)
        ours = KvStoreNodesTier(config)
        try:
            _progress("remote tiers: the kvstore tier (two shared servers) …")
            put_rate_k = _rate(lambda: ours.put_many(blocks), total, 1)  # a second put stores nothing
            get_rate_k = _rate(lambda: ours.get_many(keys, fp), total, rounds)
            one_k = _rate(lambda: ours.get_many(keys[:1], fp), BLOCK_BYTES, rounds)
            figures["kvstore"] = RemoteFigures(get_rate_k, put_rate_k, BLOCK_BYTES / one_k)
        finally:
            ours.close()
    finally:
        for node in nodes:
            node.stop()
    note = f"{count} blocks of {BLOCK_BYTES >> 20} MiB (Llama-3.1-8B, 16 tokens), pipelined, 3 masters"
    r = figures["redis"]
    k = figures["kvstore"]
    rows = [
        Result(
            "redis tier get",
            r.get_bytes_per_s / 1e9,
            "GB/s",
            "plain redis-py cluster client",
            plain_get_rate / 1e9,
            ">= 0.8",
            note,
        ),
        Result(
            "redis tier put",
            r.put_bytes_per_s / 1e9,
            "GB/s",
            "plain redis-py cluster client",
            plain_put_rate / 1e9,
            None,
            note,
        ),
        Result(
            "kvstore tier get",
            k.get_bytes_per_s / 1e9,
            "GB/s",
            "plain redis-py cluster client",
            plain_get_rate / 1e9,
            None,
            "two shared kvstore servers, data port",
        ),
        Result(
            "kvstore tier put",
            k.put_bytes_per_s / 1e9,
            "GB/s",
            "plain redis-py cluster client",
            plain_put_rate / 1e9,
            None,
            "two shared kvstore servers, data port",
        ),
    ]
    return figures, rows


def run_fleet(quick: bool, json_path: str | None, calibration: str = "", plot: str | None = None) -> int:
    prefill, prefill_note = GPU_PREFILL, "prefill: an assumed Llama-3.1-8B GPU curve (15 ms + 50 us/token)"
    if calibration:
        from engine_plugin.calibration import Calibration

        prefill, prefill_note = (
            Calibration.load(calibration).snapshot().prefill,
            f"prefill from {calibration}",
        )
    rows: list[Result] = []
    try:
        remotes, remote_rows = measure_remotes(count=32 if quick else 128, rounds=3 if quick else 5)
        rows += remote_rows
        _progress("remote tiers: sealed copies against plain …")
        rows += remote_tier_rows(count=8 if quick else 32, rounds=3 if quick else 7)
    except RedisUnavailable as exc:
        print(f"kvstore bench fleet: {exc}", file=sys.stderr)
        return 2
    from benchmarks.fleet_real import REPLICAS, replay

    for remote_on in (False, True):
        for policy in ("round-robin", "rendezvous", "cost"):
            _progress(
                f"real sidecars: {REPLICAS} processes, remote {'kvstore' if remote_on else 'none'}, {policy} …"
            )
            played = replay(policy, remote_on, sessions=6 if quick else 16)
            rows.append(
                Result(
                    f"real sidecars, agent trace, {policy}, remote {'kvstore' if remote_on else 'none'}",
                    played.hit_rate,
                    "",
                    note=f"{played.requests} requests over {REPLICAS} sidecar processes, {played.replicas_used} used; "
                    "token hit rate delivered by read_into",
                )
            )
    for n in (4, 64):
        rendezvous, modulo = keys_moved(n)
        rows.append(
            Result(
                f"keys moved when node {n + 1} joins {n}",
                rendezvous * n,
                "x 1/N",
                "modulo hashing",
                modulo * n,
                "<= 1.2",
                "100,000 keys; value = share moved x N",
            )
        )
    grid: list[dict[str, object]] = []
    # sessions per replica count: enough that the caches warm up within the trace (RAG's
    # sessions are single questions, so it gets four times as many)
    sizes = {4: 150 if quick else 400, 64: 700 if quick else 2400}
    for n, sessions_count in sizes.items():
        for workload, make in WORKLOADS.items():
            sessions = make(random.Random(1), sessions_count * (4 if workload == "rag" else 1))
            by: dict[tuple[str, str], RunFigures] = {}
            references: dict[str, float] = {}
            for remote in ("none", "kvstore", "redis"):
                tiers = {"dram": LOCAL_RESTORE}
                if remote != "none":
                    tiers["remote"] = remotes[remote].cost()
                spec = FleetSpec(
                    replicas=n,
                    local_blocks=2000,
                    remote_blocks=0 if remote == "none" else 2000 * n,
                    tiers=tiers,
                    prefill=prefill,
                    block_bytes=BLOCK_BYTES,
                    tokens_per_block=TOKENS_PER_BLOCK,
                    slots=8,
                    slack=SLACK,
                )
                for policy in POLICIES:
                    _progress(f"simulating {n} replicas, {workload}, remote {remote}, {policy} …")
                    by[(remote, policy)] = simulate(sessions, spec, policy)
                # the same trace on one replica, its prompts in the order they reached the fleet
                reference = single_replica_hit_rate(sessions, spec, by[(remote, "cost")].arrivals)
                references[remote] = reference
                for policy in POLICIES:
                    f = by[(remote, policy)]
                    grid.append(
                        {
                            "replicas": n,
                            "workload": workload,
                            "remote": remote,
                            "policy": policy,
                            "requests": f.requests,
                            "token_hit_rate": f.hit_rate,
                            "saved_prefill_s": f.saved_s,
                            "max_over_mean_in_flight": f.max_over_mean,
                            "least_max_over_mean_in_flight": f.least_max_over_mean,
                            "routed_over_bound": f.over_bound,
                            "first_choice": f.first_choice / max(1, f.requests),
                            "single_replica_hit_rate": reference,
                        }
                    )
            best = by[("kvstore", "cost")]
            rendezvous_f = by[("kvstore", "rendezvous")]
            rows.append(
                Result(
                    f"fleet hit rate, {n} replicas, {workload}",
                    best.hit_rate,
                    "",
                    "one replica, the fleet's cache",
                    references["kvstore"],
                    ">= 0.9",
                    "cost-aware routing, kvstore remote tier; the one replica serves the prompts in "
                    "their order of arrival (session by session, every history fresh: "
                    f"{single_replica_hit_rate(sessions, spec):.2f})",
                )
            )
            rows.append(
                Result(
                    f"saved prefill, {n} replicas, {workload}",
                    best.saved_s,
                    "s",
                    "bounded rendezvous",
                    rendezvous_f.saved_s,
                    ">= 1.0",
                    "cost-aware vs bounded-load rendezvous, kvstore remote tier",
                )
            )
            round_robin = by[("kvstore", "round-robin")]
            rows.append(
                Result(
                    f"load bound, {n} replicas, {workload}",
                    best.over_bound,
                    "",
                    f"the bound, max(ceil(m), floor({SLACK} m))",
                    1.0,
                    "<= 1.0",
                    "cost-aware: the routed replica's in flight right after routing over the bound (m: "
                    "the mean then), the largest over arrivals; max/mean in flight, mean over arrivals "
                    f"with m >= 1: {best.max_over_mean:.2f} (whole requests allow "
                    f"{best.least_max_over_mean:.2f} at best; slack {SLACK}); round robin "
                    f"{round_robin.over_bound:.2f} over the bound, max/mean {round_robin.max_over_mean:.2f}",
                )
            )
    print_results("kvstore bench fleet" + (" --quick" if quick else ""), rows)
    _print_grid(grid)
    print(prefill_note + "; a replica's own cache restores at 10 GB/s (assumed: no GPU here)")
    if json_path:
        write_json(json_path, rows, {"simulation": grid, "prefill": prefill_note})
    if plot:
        _plot(grid, plot, prefill_note)
    return 0


def _plot(
    grid: list[dict[str, object]], path: str, prefill: str, machine: dict[str, object] | None = None
) -> None:
    """Token hit rate per policy, one panel per (replicas, workload), bars by remote tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(int(str(r["replicas"])), str(r["workload"])) for r in grid})
    fig, axes = plt.subplots(
        2, len(panels) // 2, figsize=(4 * len(panels) // 2, 7.5), squeeze=False, sharey=True
    )
    for ax, (n, workload) in zip(axes.flat, panels, strict=False):
        for offset, remote in enumerate(("none", "kvstore", "redis")):
            values = [
                float(str(r["token_hit_rate"]))
                for policy in POLICIES
                for r in grid
                if (r["replicas"], r["workload"], r["remote"], r["policy"]) == (n, workload, remote, policy)
            ]
            ax.bar(
                [i + offset * 0.27 for i in range(len(POLICIES))],
                values,
                width=0.27,
                label=f"remote: {remote}",
            )
        ax.set_xticks([i + 0.27 for i in range(len(POLICIES))], POLICIES, fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"{n} replicas, {workload}", fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=3)
    fig.supylabel("token hit rate")
    fig.suptitle(
        plot_title(
            "fleet token hit rate by routing policy and remote tier (simulated replicas)",
            "Llama-3.1-8B blocks (2 MiB, 16 tokens)",
            f"{prefill}; remote restore priced at the bandwidth measured here",
            machine,
        ),
        fontsize=10,
        x=0.01,
        ha="left",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _print_grid(grid: list[dict[str, object]]) -> None:
    print("\nsimulation: hit rate / saved prefill s / max:mean in flight / first choice")
    for row in grid:
        print(
            f"  {row['replicas']:>2} {row['workload']:<8} remote={row['remote']:<8} {row['policy']:<12}"
            f" {row['token_hit_rate']:.2f} / {row['saved_prefill_s']:8.1f} / {row['max_over_mean_in_flight']:.2f}"
            f" / {row['first_choice']:.2f}   (one replica: {row['single_replica_hit_rate']:.2f})"
        )
