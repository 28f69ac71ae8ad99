"""The fleet simulated: replicas with their own KV caches, an optional shared remote tier, the
routing policies of ``kvstore.routing`` choosing among them, on the brief's workloads.

A prompt is a chain of blocks (``tokens_per_block`` tokens each); block keys chain like
``kvstore.keys.block_keys`` (a key names its whole prefix), so prompts that share a head share its
keys. Sessions start as a Poisson process, at a rate that keeps ``load`` of the fleet's slots
busy; a session's next turn follows its previous answer after a think time (exponential, mean
``think_s``). Each replica serves ``slots`` requests at once, in arrival order. When a request starts, its replica
restores what the connector's plan restores (``kvstore.cost_model.plan_restore`` over the hits:
the replica's own cache first, then the remote tier's continuation) and computes the rest; its
blocks enter the replica's cache (LRU, ``local_blocks``) and the remote tier (LRU,
``remote_blocks``) when it finishes. Time to first token is restore + prefill; the time after it
(decode) is a fixed ``decode_s``.

Figures per run: the token hit rate (prompt tokens found in a cache the replica can reach, its
own or the remote tier, whether or not the plan restores them), the prefill seconds saved against
computing every token, the mean over arrivals of max/mean requests in flight right after each
is routed (counted while at least one request per replica is in flight, where the load bound is
meaningful) beside the least whole requests allow there (ceil(mean)/mean), the largest in flight
of the replica each request is routed to over its bound (``kvstore.routing.policies.held_bound``),
and how often the policy's first choice was taken.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from kvstore.cost_model import PrefillModel, TierCost, plan_restore
from kvstore.routing.policies import (
    BoundedRendezvous,
    ConsistentHash,
    CostAware,
    RoundRobin,
    RouteRequest,
    held_bound,
)

Key = int


@dataclass(frozen=True)
class Prompt:
    tenant: str
    segments: tuple[tuple[str, int], ...]  # (what, tokens): a system prompt, a document, a turn

    def keys(self, tokens_per_block: int) -> list[Key]:
        """Chained block keys of the prompt's full blocks."""
        keys: list[Key] = []
        prev = xxhash.xxh3_64_intdigest(self.tenant.encode())
        done = 0
        pending = 0
        for what, tokens in self.segments:
            for _ in range(tokens):
                pending += 1
                if pending == tokens_per_block:
                    prev = xxhash.xxh3_64_intdigest(f"{prev}|{what}|{done}".encode())
                    keys.append(prev)
                    done += 1
                    pending = 0
        return keys

    @property
    def tokens(self) -> int:
        return sum(t for _, t in self.segments)


# ----------------------------------------------------------------------------- workloads
# A workload is a list of sessions, each a list of prompts sent one after another: turn k + 1
# goes out a think time after turn k's answer (a user reading it, an agent's tool running).


def agent(
    rng: random.Random, sessions: int, system_tokens: int = 4096, turn_tokens: int = 500
) -> list[list[Prompt]]:
    """One agent endpoint: a shared system prompt and tool schemas, then each session's turns."""
    return _conversations(rng, sessions, ("system", system_tokens), (2, 6), turn_tokens, 100, "s")


def chats(rng: random.Random, sessions: int, turn_tokens: int = 300) -> list[list[Prompt]]:
    """Multi-turn chats: each turn sends the conversation's whole history, after a short preamble."""
    return _conversations(rng, sessions, ("preamble", 128), (3, 8), turn_tokens, 150, "c")


def _conversations(
    rng: random.Random,
    sessions: int,
    head: tuple[str, int],
    turns: tuple[int, int],
    turn_tokens: int,
    jitter: int,
    tag: str,
) -> list[list[Prompt]]:
    """Sessions whose every turn sends ``head`` and the whole history so far: ``turns`` (a range)
    turns each, of ``turn_tokens`` +- ``jitter`` new tokens."""
    out = []
    for s in range(sessions):
        history: list[tuple[str, int]] = [head]
        prompts = []
        for t in range(rng.randint(*turns)):
            history.append((f"{tag}{s}-turn{t}", turn_tokens + rng.randint(-jitter, jitter)))
            prompts.append(Prompt("tenant", tuple(history)))
        out.append(prompts)
    return out


def rag(
    rng: random.Random, sessions: int, documents: int = 200, doc_tokens: int = 2048
) -> list[list[Prompt]]:
    """Retrieval-augmented questions over Zipf-popular documents (s = 1.1), one per session."""
    weights = [1 / (i + 1) ** 1.1 for i in range(documents)]
    docs = rng.choices(range(documents), weights=weights, k=sessions)
    return [
        [
            Prompt(
                "tenant", (("instructions", 256), (f"doc-{d}", doc_tokens), (f"q-{rng.getrandbits(40)}", 64))
            )
        ]
        for d in docs
    ]


def tenants(rng: random.Random, sessions: int, count: int = 4) -> list[list[Prompt]]:
    """Several tenants, each with its own system prompt: their blocks never mix."""
    out = []
    for i in range(count):
        for session in agent(rng, sessions // count + 1, system_tokens=2048):
            out.append([Prompt(f"tenant-{i}", p.segments) for p in session])
    rng.shuffle(out)
    return out[:sessions]


WORKLOADS: dict[str, Callable[[random.Random, int], list[list[Prompt]]]] = {
    "agent": agent,
    "chats": chats,
    "rag": rag,
    "tenants": tenants,
}


# ----------------------------------------------------------------------------- the fleet


class LruBlocks:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def prefix(self, keys: Sequence[Key], start: int = 0) -> int:
        """How many of ``keys[start:]`` are held, from ``start`` on."""
        n = 0
        for key in itertools.islice(keys, start, None):
            if key not in self._keys:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


@dataclass(frozen=True)
class FleetSpec:
    replicas: int
    local_blocks: int
    remote_blocks: int  # 0: no remote tier
    tiers: dict[str, TierCost]  # "dram" for a replica's own cache, "remote" for the shared tier
    prefill: PrefillModel
    block_bytes: int
    tokens_per_block: int = 16
    slots: int = 4
    decode_s: float = 0.5
    think_s: float = 2.0  # mean pause between a session's turns
    load: float = 0.8
    slack: float = 1.25


@dataclass
class RunFigures:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    saved_s: float = 0.0
    requests: int = 0
    first_choice: int = 0
    imbalance: list[float] = field(default_factory=list)
    least_imbalance: list[float] = field(default_factory=list)  # ceil(mean)/mean at the same arrivals
    over_bound: float = 0.0  # the largest of the routed replica's in flight over held_bound
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (session, turn), in arrival order

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def max_over_mean(self) -> float:
        return sum(self.imbalance) / len(self.imbalance) if self.imbalance else 1.0

    @property
    def least_max_over_mean(self) -> float:
        """What any routing would show at best: the mean of ceil(mean)/mean over the same arrivals."""
        return sum(self.least_imbalance) / len(self.least_imbalance) if self.least_imbalance else 1.0


def make_policy(name: str, spec: FleetSpec) -> RoundRobin | ConsistentHash | BoundedRendezvous | CostAware:
    names = [f"replica-{i}" for i in range(spec.replicas)]
    if name == "round-robin":
        return RoundRobin(names)
    if name == "hash":
        return ConsistentHash(names)
    if name == "rendezvous":
        return BoundedRendezvous(names, spec.slack)
    mean_service_s = spec.decode_s + spec.prefill.seconds(0, 2000)
    return CostAware(
        names,
        spec.tiers,
        spec.prefill,
        spec.block_bytes,
        spec.tokens_per_block,
        mean_service_s / spec.slots,
        spec.slack,
        slots=spec.slots,
    )


def simulate(
    sessions: Sequence[Sequence[Prompt]], spec: FleetSpec, policy_name: str, seed: int = 0
) -> RunFigures:
    rng = random.Random(seed)
    policy = make_policy(policy_name, spec)
    tpb = spec.tokens_per_block
    local = [LruBlocks(spec.local_blocks) for _ in range(spec.replicas)]
    remote = LruBlocks(spec.remote_blocks) if spec.remote_blocks else None
    prompts = [p for session in sessions for p in session]
    mean_service_s = spec.decode_s + sum(spec.prefill.seconds(0, p.tokens) for p in prompts) / len(prompts)
    # sessions start as a Poisson process: enough of them for ``load`` of the fleet's slots
    busy_s = sum(len(s) for s in sessions) / len(sessions) * mean_service_s
    session_rate = spec.load * spec.replicas * spec.slots / busy_s
    loads = [0] * spec.replicas  # in flight: queued or running
    running = [0] * spec.replicas
    queues: list[deque[tuple[int, int, list[Key]]]] = [deque() for _ in range(spec.replicas)]
    # (time, order, kind, a, b): kind 0 = a turn finishes on replica a (session b),
    # kind 1 = turn a of session b arrives, kind 2 = a turn's prefill is done on replica a
    events: list[tuple[float, int, int, int, int]] = []
    order = itertools.count()
    figures = RunFigures()
    finishing: dict[int, tuple[list[Key], int, int]] = {}
    start_at = 0.0
    for b in range(len(sessions)):
        start_at += rng.expovariate(session_rate)
        heapq.heappush(events, (start_at, next(order), 1, 0, b))

    def hits_of(keys: list[Key], r: int) -> tuple[str, ...]:
        own = local[r].prefix(keys)
        more = remote.prefix(keys, own) if remote is not None else 0
        return ("dram",) * own + ("remote",) * more

    def start(r: int, now: float) -> None:
        turn, b, keys = queues[r].popleft()
        prompt = sessions[b][turn]
        running[r] += 1
        hits = hits_of(keys, r)
        plan = plan_restore(hits, spec.block_bytes, tpb, prompt.tokens, spec.tiers, spec.prefill)
        figures.hit_tokens += min(len(hits) * tpb, prompt.tokens)  # found, whether restored or not
        figures.saved_s += plan.all_recompute_s - plan.predicted_ttft_s
        ident = next(order)
        finishing[ident] = (keys, turn, b)
        # the prompt's blocks are there for others once its prefill is done (the connector saves
        # each step's blocks as they are computed), not once its decode ends
        heapq.heappush(events, (now + plan.predicted_ttft_s, ident, 2, r, b))
        heapq.heappush(events, (now + plan.predicted_ttft_s + spec.decode_s, ident, 0, r, b))

    while events:
        now, ident, kind, a, b = heapq.heappop(events)
        if kind == 1:
            prompt = sessions[b][a]
            keys = prompt.keys(tpb)
            head = keys[min(len(keys), 256 // tpb) - 1] if keys else 0
            hits = [hits_of(keys, r) for r in range(spec.replicas)] if policy_name == "cost" else []
            choice = policy.choose(RouteRequest(head.to_bytes(8, "big"), prompt.tokens, hits), loads)
            loads[choice.replica] += 1
            in_flight = sum(loads)
            bound = held_bound(in_flight, spec.replicas, spec.slack)
            figures.over_bound = max(figures.over_bound, loads[choice.replica] / bound)
            if in_flight >= spec.replicas:
                mean = in_flight / spec.replicas
                figures.imbalance.append(max(loads) / mean)
                figures.least_imbalance.append(-(-in_flight // spec.replicas) / mean)
            figures.first_choice += choice.replica == choice.first
            figures.requests += 1
            figures.arrivals.append((b, a))
            figures.prompt_tokens += prompt.tokens
            queues[choice.replica].append((a, b, keys))
            if running[choice.replica] < spec.slots:
                start(choice.replica, now)
            continue
        if kind == 2:
            keys = finishing[ident][0]
            local[a].touch(keys)
            if remote is not None:
                remote.touch(keys)
            continue
        keys, turn, b = finishing.pop(ident)
        running[a] -= 1
        loads[a] -= 1
        if queues[a]:
            start(a, now)
        if turn + 1 < len(sessions[b]):
            heapq.heappush(events, (now + rng.expovariate(1 / spec.think_s), next(order), 1, turn + 1, b))
    return figures


def single_replica_hit_rate(
    sessions: Sequence[Sequence[Prompt]], spec: FleetSpec, order: Sequence[tuple[int, int]] = ()
) -> float:
    """The reference: one replica with the whole fleet's cache serving the trace, its prompts in
    ``order`` ((session, turn) pairs: a run's arrivals, so that the sessions interleave as they
    did in the fleet), else session by session (every history fresh: an upper bound)."""
    cache = LruBlocks(spec.local_blocks * spec.replicas)
    hit = total = 0
    pairs = order or [(b, t) for b, session in enumerate(sessions) for t in range(len(session))]
    for prompt in (sessions[b][t] for b, t in pairs):
        keys = prompt.keys(spec.tokens_per_block)
        hit += min(cache.prefix(keys) * spec.tokens_per_block, prompt.tokens)
        total += prompt.tokens
        cache.touch(keys)
    return hit / max(1, total)


def keys_moved(nodes: int, keys: int = 100_000) -> tuple[float, float]:
    """Share of keys that change owner when a node joins ``nodes``: rendezvous, and modulo hashing."""
    from kvstore.remote.rendezvous import Rendezvous

    before = Rendezvous([f"node-{i}" for i in range(nodes)])
    after = Rendezvous([f"node-{i}" for i in range(nodes + 1)])
    moved_r = moved_m = 0
    for k in range(keys):
        raw = k.to_bytes(8, "big")
        moved_r += before.nodes[before.owner(raw)] != after.nodes[after.owner(raw)]
        h = xxhash.xxh3_64_intdigest(raw)
        moved_m += h % nodes != h % (nodes + 1)
    return moved_r / keys, moved_m / keys
