"""Routing policies: which replica of a fleet serves a prompt, from what each policy knows.

    RoundRobin            nothing: the next replica in turn (the baseline that computes every
                          popular prefix up to N times)
    ConsistentHash        the prompt's prefix key on a ring of virtual nodes: one replica per
                          prefix, whatever its load
    BoundedRendezvous     the prefix key's rendezvous order, skipping replicas at the load bound
                          (consistent hashing with bounded loads, see ``load_bound``): a prefix
                          sticks to its replica until that replica is busy
    CostAware             for each replica under the same bound, the predicted time to first
                          token of this prompt there: restoring what that replica can reach of
                          the prefix (its own tiers, or the fleet's remote tier), priced per
                          tier by the connector's cost model, plus computing the rest, plus a
                          queue penalty per request that would wait (in flight beyond the
                          replica's ``slots``); the lowest wins, ties by the rendezvous order

``choose(request, loads, down)`` returns ``Choice(replica, first)``: the index chosen, and the one
the policy would have chosen with no load at all and every replica up (the first-choice fraction
is how often they agree). ``loads[i]`` is replica i's requests in flight; ``down`` the replicas
that must not be chosen (not answering), never all of them (the caller's check: ``Router.admit``).
The load bound is taken over the replicas up. Policies hold no per-request state and are safe
to share between threads (RoundRobin's turn is taken under a lock).
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import xxhash

from kvstore.cost_model import PrefillModel, TierCost, plan_restore
from kvstore.remote.rendezvous import Rendezvous


@dataclass(frozen=True)
class RouteRequest:
    prefix_key: bytes  # what identifies the prompt's shared head (its first blocks' key)
    prompt_tokens: int = 0
    hits: Sequence[tuple[str, ...]] = field(default_factory=tuple)  # per replica: tier of each hit block


@dataclass(frozen=True)
class Choice:
    replica: int
    first: int  # the policy's choice had every replica been idle


class RoundRobin:
    def __init__(self, replicas: Sequence[str]) -> None:
        self._n = len(replicas)
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def choose(
        self, request: RouteRequest, loads: Sequence[int], down: AbstractSet[int] = frozenset()
    ) -> Choice:
        with self._lock:
            for _ in range(self._n):
                i = next(self._turn) % self._n
                if i not in down:
                    return Choice(i, i)
        raise ValueError("every replica is down")


class ConsistentHash:
    def __init__(self, replicas: Sequence[str], points_per_replica: int = 100) -> None:
        ring = sorted(
            (xxhash.xxh3_64_intdigest(f"{name}#{v}".encode()), i)
            for i, name in enumerate(replicas)
            for v in range(points_per_replica)
        )
        self._points = [p for p, _ in ring]
        self._owners = [i for _, i in ring]

    def choose(
        self, request: RouteRequest, loads: Sequence[int], down: AbstractSet[int] = frozenset()
    ) -> Choice:
        at = bisect.bisect(self._points, xxhash.xxh3_64_intdigest(request.prefix_key))
        n = len(self._points)
        # a down owner's points pass to the next owner on the ring, as if it had left it
        owner = next(o for k in range(n) if (o := self._owners[(at + k) % n]) not in down)
        return Choice(owner, self._owners[at % n])


def load_bound(loads: Sequence[int], slack: float) -> int:
    """The most requests one replica may hold with one more routed: floor(slack * (L + 1) / N),
    the slack times the mean after routing, rounded down so that the slack holds, but never
    below the least-loaded replica's load plus one (where the fleet holds too few requests for
    the slack to allow any, the least loaded takes it). Rounding up instead, as the classic
    bound does, let a replica of four with 6.4 in flight on average hold 9: 1.35x the mean.
    What this promises: ``held_bound``."""
    return max(min(loads) + 1, math.floor(slack * (sum(loads) + 1) / len(loads)))


def held_bound(in_flight: int, replicas: int, slack: float) -> int:
    """The most a replica holds right after a request is routed to it under ``load_bound``, with
    ``in_flight`` requests over ``replicas`` after routing (mean m): max(ceil(m), floor(slack * m)).

    The slack times the mean, except where the mean is so small that no spread of whole requests
    meets it: with 130 in flight over 64 replicas (m = 2.03) some replica holds 3, 1.48x the mean,
    whatever routes them; the least loaded plus one is then at most ceil(m). A replica can exceed
    this later only by the others' requests finishing (routing moves none), so it is promised for
    the replica routed to, at the moment it is."""
    return max(-(-in_flight // replicas), math.floor(slack * in_flight / replicas))


class BoundedRendezvous:
    def __init__(self, replicas: Sequence[str], slack: float = 1.25) -> None:
        if slack < 1.0:
            raise ValueError(f"slack must be at least 1, got {slack}")
        self._ring = Rendezvous(replicas)
        self.slack = slack

    def order(self, request: RouteRequest) -> list[int]:
        return self._ring.owners(request.prefix_key, len(self._ring.nodes))

    def choose(
        self, request: RouteRequest, loads: Sequence[int], down: AbstractSet[int] = frozenset()
    ) -> Choice:
        order = self.order(request)
        live = [i for i in order if i not in down]
        bound = load_bound([loads[i] for i in live], self.slack)
        chosen = next(i for i in live if loads[i] < bound)  # some replica up is always under it
        return Choice(chosen, order[0])


class CostAware:
    def __init__(
        self,
        replicas: Sequence[str],
        tiers: Mapping[str, TierCost],
        prefill: PrefillModel,
        block_bytes: int,
        tokens_per_block: int,
        queue_penalty_s: float,
        slack: float = 1.25,
        slots: int = 1,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._rendezvous = BoundedRendezvous(replicas, slack)
        self._tiers = dict(tiers)
        self._prefill = prefill
        self._block_bytes = block_bytes
        self._tokens_per_block = tokens_per_block
        self.queue_penalty_s = queue_penalty_s
        self._slots = slots  # requests a replica runs at once: only those beyond them wait

    def ttft_s(self, request: RouteRequest, hits: tuple[str, ...]) -> float:
        """Predicted time to first token with ``hits`` reachable, on an idle replica."""
        known = tuple(itertools.takewhile(lambda t: t in self._tiers, hits))
        plan = plan_restore(
            known,
            self._block_bytes,
            self._tokens_per_block,
            request.prompt_tokens,
            self._tiers,
            self._prefill,
        )
        return plan.predicted_ttft_s

    def predicted_s(self, request: RouteRequest, replica: int, load: int) -> float:
        hits = request.hits[replica] if replica < len(request.hits) else ()
        return self.ttft_s(request, hits) + self._penalty(load)

    def choose(
        self, request: RouteRequest, loads: Sequence[int], down: AbstractSet[int] = frozenset()
    ) -> Choice:
        order = self._rendezvous.order(request)
        rank = {replica: position for position, replica in enumerate(order)}
        by_hits: dict[tuple[str, ...], float] = {}  # replicas that hold the same reach the same

        def idle_s(i: int) -> float:
            hits = request.hits[i] if i < len(request.hits) else ()
            if hits not in by_hits:
                by_hits[hits] = self.ttft_s(request, hits)
            return by_hits[hits]

        first = min(order, key=lambda i: (idle_s(i), rank[i]))
        live = [i for i in order if i not in down]
        bound = load_bound([loads[i] for i in live], self._rendezvous.slack)
        under = [i for i in live if loads[i] < bound]
        chosen = min(under, key=lambda i: (idle_s(i) + self._penalty(loads[i]), rank[i]))
        return Choice(chosen, first)

    def _penalty(self, load: int) -> float:
        return self.queue_penalty_s * max(0, load - self._slots + 1)
