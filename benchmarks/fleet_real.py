"""The fleet with real sidecars: four ``kvstore serve`` processes (and, with a remote tier, a
shared kvstore server under them), a short agent trace routed by each policy through the real
``kvstore.routing.Router`` and ``SidecarProbe``, each request played as the connector would:
restore the present prefix from the chosen replica's sidecar (``read_into``: its own tiers, or
read through from the remote tier), store what was missing (``write``). No engine runs: the
"computed" blocks are random bytes, and the figure is the token hit rate the sidecars delivered.

Blocks are Llama-3.1-8B's (2 MiB per 16 tokens); the trace is small enough for this machine
(a 512-token system prompt, sessions of three 128-token turns).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.fleet_sim import Prompt, agent
from benchmarks.server_process import ServerProcess
from benchmarks.service_setup import TOKEN, bench_server
from benchmarks.traces import Request
from kvstore.client import Client, connect
from kvstore.keys import ModelIdentity
from kvstore.routing import BoundedRendezvous, ConsistentHash, CostAware, RoundRobin, Router, SidecarProbe
from kvstore.routing.router import Policy

REPLICAS = 4
MODEL = ModelIdentity(
    "meta-llama/Llama-3.1-8B", "00" * 32, num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16
)


@dataclass(frozen=True)
class ReplayFigures:
    policy: str
    remote: bool
    requests: int
    hit_rate: float
    replicas_used: int
    seconds: float
    request_s: tuple[float, ...] = ()  # each request's restore and store, in order
    blocks: int = 0  # blocks the requests asked for


def _policy(name: str, names: Sequence[str], model: ModelIdentity = MODEL) -> Policy:
    from benchmarks.fleet import GPU_PREFILL, LOCAL_RESTORE

    if name == "round-robin":
        return RoundRobin(names)
    if name == "hash":
        return ConsistentHash(names)
    if name == "rendezvous":
        return BoundedRendezvous(names)
    tiers = {"dram": LOCAL_RESTORE, "nvme": LOCAL_RESTORE, "remote": LOCAL_RESTORE}
    return CostAware(
        names, tiers, GPU_PREFILL, model.block_bytes, model.tokens_per_block, queue_penalty_s=0.05
    )


def _tokens(prompt: Prompt) -> list[int]:
    """Token ids for a simulated prompt: each segment's own deterministic run of ids."""
    out: list[int] = []
    for what, count in prompt.segments:
        rng = random.Random(f"{prompt.tenant}/{what}")
        out.extend(rng.randrange(3, 32000) for _ in range(count))
    return out


def replay(
    policy_name: str,
    remote: bool,
    sessions: int,
    *,
    trace: Sequence[Request] = (),
    model: ModelIdentity = MODEL,
    speedup: float = 0.0,
) -> ReplayFigures:
    """The agent trace of ``sessions`` sessions, or ``trace`` (``benchmarks.traces``: each request
    sent at its arrival time divided by ``speedup``; 0: back to back), blocks of ``model``."""
    shared = bench_server(arena_bytes=1 << 30) if remote else None
    settings = {"dram.prefault": "false", "nvme.capacity_bytes": "2GiB"}
    if shared is not None:
        settings |= {
            "remote.backend": "kvstore",
            "remote.nodes": shared.tcp,
            "remote.tokens": f"t/local={TOKEN}",
        }
    sidecars: list[ServerProcess] = []
    probe: SidecarProbe | None = None
    clients: list[Client] = []
    try:
        sidecars = [bench_server(arena_bytes=512 << 20, settings=settings) for _ in range(REPLICAS)]
        names = [f"replica-{i}" for i in range(REPLICAS)]
        probe = SidecarProbe([s.unix for s in sidecars], timeout_s=1.0)
        clients = [connect(s.unix) for s in sidecars]
        fingerprint = clients[0].register(model)
        for kv in clients[1:]:
            kv.register(model)
        router = Router(
            names, _policy(policy_name, names, model), fingerprint, model.tokens_per_block, probe=probe
        )
        order = [(r.arrival_s, list(r.tokens)) for r in trace] or _agent_order(sessions)
        hit = total = blocks = 0
        used: set[int] = set()
        request_s: list[float] = []
        started = time.perf_counter()
        for arrival_s, tokens in order:
            if speedup > 0:
                time.sleep(max(0.0, started + arrival_s / speedup - time.perf_counter()))
            request, keys = router.request_for(tokens)
            routed = router.admit(request)
            try:
                kv = clients[routed.replica]
                used.add(routed.replica)
                began = time.perf_counter()
                outs = [memoryview(bytearray(model.block_bytes)) for _ in keys]
                n = kv.read_into(fingerprint, keys, outs)
                if n < len(keys):
                    missing = keys[n:]
                    kv.write(
                        fingerprint,
                        missing,
                        [os.urandom(model.block_bytes) for _ in missing],
                        parent=keys[n - 1] if n else None,
                    )
                request_s.append(time.perf_counter() - began)
                blocks += len(keys)
                hit += n * model.tokens_per_block
                total += len(tokens)
            finally:
                router.finish(routed)
            if shared is not None:
                _drain(kv)
        return ReplayFigures(
            policy_name,
            remote,
            len(order),
            hit / max(1, total),
            len(used),
            time.perf_counter() - started,
            tuple(request_s),
            blocks,
        )
    finally:
        for kv in clients:
            kv.close()
        if probe is not None:
            probe.close()
        for side in sidecars:
            side.stop()
        if shared is not None:
            shared.stop()


def _agent_order(sessions: int) -> list[tuple[float, list[int]]]:
    """The short agent trace, sessions interleaved: turn t of every session before turn t + 1 of any."""
    trace = agent(random.Random(7), sessions, system_tokens=512, turn_tokens=128)
    return [(0.0, _tokens(s[t])) for t in range(max(len(s) for s in trace)) for s in trace if t < len(s)]


def _drain(kv: Client, timeout_s: float = 10.0) -> None:
    """Wait until the sidecar sent what it queued for the remote tier (the next request of
    the trace may land on another replica)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counters = kv.stats()["counters"]
        if counters.get("remote_handled_blocks", 0) >= counters.get("remote_queued_blocks", 0):
            return
        time.sleep(0.02)
