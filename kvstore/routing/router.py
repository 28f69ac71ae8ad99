"""The router's core: a prompt in, a replica out, with the fleet's load and cache in view.

    router = Router(["r0", "r1"], BoundedRendezvous(["r0", "r1"]), fingerprint, tokens_per_block)
    with router.route(token_ids, cache_salt) as routed:   # counts it in flight on routed.replica
        ...forward the request to routed.replica...

or, where the probe must not block (an event loop): ``request_for`` in a worker thread, then
``admit`` and, when the response is done, ``finish``.

The prefix key of a prompt is the chained block key (``kvstore.keys.block_keys``) of its last
full block within the first ``prefix_tokens`` tokens: prompts that share that head (a system
prompt, a document) share it; a prompt shorter than one block is keyed by its tokens.

``probe`` (a ``SidecarProbe``), when given, asks every replica's sidecar in parallel which
leading blocks of the prompt it can serve and from which tier (its lookup reports blocks of the
fleet's remote tier as ``remote``), bounded by ``timeout_s``: a sidecar that does not answer in
time counts as holding nothing. Only ``CostAware`` uses the answer.

Figures (``stats()``): requests routed, how many went to the policy's first choice, requests in
flight per replica, and the cached tokens the chosen replica reported. Thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvstore.client import Client, connect
from kvstore.errors import KvStoreError, Unavailable
from kvstore.keys import Fingerprint, block_keys
from kvstore.routing.policies import Choice, RouteRequest

_ROUTING_ROOT = Fingerprint(b"kvstore-routing-prefix-key-root!")  # 32 bytes; any fixed value


class Policy(Protocol):
    def choose(self, request: RouteRequest, loads: Sequence[int], down: AbstractSet[int] = ...) -> Choice: ...


@dataclass(frozen=True)
class Routed:
    replica: int
    name: str
    first_choice: bool
    cached_tokens: int  # what the chosen replica's sidecar reported it can restore


@dataclass(frozen=True)
class RouterStats:
    routed: int
    first_choice: int
    in_flight: tuple[int, ...]
    cached_tokens: int


class SidecarProbe:
    """Each replica's sidecar (``unix://...`` or ``host:port``), asked in parallel."""

    def __init__(self, sidecars: Sequence[str], token: str | None = None, timeout_s: float = 0.05) -> None:
        self._clients: list[Client] = [connect(a, token=token, timeout_s=timeout_s) for a in sidecars]
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(sidecars)), thread_name_prefix="kvstore-probe")

    def hits(
        self, fingerprint: Fingerprint, keys: Sequence[bytes], cache_salt: str = ""
    ) -> list[tuple[str, ...]]:
        def ask(client: Client) -> tuple[str, ...]:
            try:
                return client.lookup_tiers(fingerprint, keys).tiers
            except KvStoreError:
                return ()

        futures = [self._pool.submit(ask, c) for c in self._clients]
        out: list[tuple[str, ...]] = []
        for future in futures:
            try:
                out.append(future.result(timeout=self._timeout_s * 2))
            except FutureTimeout:
                out.append(())
        return out

    def fingerprint(self, model_id: str = "") -> Fingerprint | None:
        """The fingerprint an engine registered with its sidecar (tensor-parallel rank 0, of
        ``model_id`` when given; None while no sidecar knows exactly one)."""
        for client in self._clients:
            try:
                known = client.stats()["fingerprints"]
            except KvStoreError:
                continue
            found = {
                f["fingerprint"]
                for f in known
                if f["tp_rank"] == 0 and (not model_id or f["model_id"] == model_id)
            }
            if len(found) == 1:
                return Fingerprint(bytes.fromhex(found.pop()))
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self._clients:
            client.close()


class Router:
    def __init__(
        self,
        replicas: Sequence[str],
        policy: Policy,
        fingerprint: Fingerprint | Callable[[], Fingerprint | None],
        tokens_per_block: int,
        probe: SidecarProbe | None = None,
        prefix_tokens: int = 256,
    ) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self.replicas = tuple(replicas)
        self.policy = policy
        # the engines' model fingerprint, or how to learn it (their sidecars know it once an
        # engine registered): until then prompts are routed without asking the sidecars
        self._fingerprint = fingerprint if callable(fingerprint) else (lambda: fingerprint)
        self._tokens_per_block = tokens_per_block
        self._probe = probe
        self._prefix_tokens = prefix_tokens
        self._lock = threading.Lock()
        self._loads = [0] * len(replicas)
        self._routed = self._first = self._cached = 0

    def request_for(self, token_ids: Sequence[int], cache_salt: str = "") -> tuple[RouteRequest, list[bytes]]:
        """The prompt's route request, and its block keys under the engines' fingerprint (none
        while it is unknown). The prefix key is chained from a fixed root, so that a prefix keeps
        its replica whether or not the fingerprint is known yet."""
        salt = cache_salt or None
        head_tokens = max(
            self._tokens_per_block, self._prefix_tokens // self._tokens_per_block * self._tokens_per_block
        )
        head = block_keys(
            _ROUTING_ROOT, list(token_ids[:head_tokens]), self._tokens_per_block, cache_salt=salt
        )
        if head:
            prefix_key = bytes(head[-1])
        else:  # shorter than one block
            raw = b"".join(t.to_bytes(4, "little") for t in token_ids) + cache_salt.encode()
            prefix_key = xxhash.xxh3_128_digest(raw)
        fingerprint = self._fingerprint()
        keys = (
            block_keys(fingerprint, list(token_ids), self._tokens_per_block, cache_salt=salt)
            if fingerprint
            else []
        )
        hits = self._probe.hits(fingerprint, keys) if self._probe is not None and fingerprint and keys else ()
        return RouteRequest(prefix_key, len(token_ids), tuple(hits)), [bytes(k) for k in keys]

    @contextlib.contextmanager
    def route(self, token_ids: Sequence[int], cache_salt: str = "") -> Iterator[Routed]:
        routed = self.admit(self.request_for(token_ids, cache_salt)[0])
        try:
            yield routed
        finally:
            self.finish(routed)

    def admit(self, request: RouteRequest, down: AbstractSet[int] = frozenset()) -> Routed:
        """Choose a replica for ``request``, none of ``down`` (replicas not answering, or already
        tried), and count it in flight there until ``finish``. Raises ``Unavailable`` when every
        replica is in ``down``."""
        if len(set(down) & set(range(len(self.replicas)))) == len(self.replicas):
            raise Unavailable("no replica is up")
        with self._lock:
            choice = self.policy.choose(request, self._loads, down)
            self._loads[choice.replica] += 1
            hits = request.hits[choice.replica] if choice.replica < len(request.hits) else ()
            cached = len(hits) * self._tokens_per_block
            self._routed += 1
            self._first += choice.replica == choice.first
            self._cached += cached
        return Routed(choice.replica, self.replicas[choice.replica], choice.replica == choice.first, cached)

    def finish(self, routed: Routed) -> None:
        with self._lock:
            if self._loads[routed.replica] <= 0:
                raise RuntimeError(f"replica {routed.name} has no request in flight to finish")
            self._loads[routed.replica] -= 1

    def stats(self) -> RouterStats:
        with self._lock:
            return RouterStats(self._routed, self._first, tuple(self._loads), self._cached)
