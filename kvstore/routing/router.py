"""The router's core: a prompt in, a replica out, with the fleet's load and cache in view.

    router = Router(["r0", "r1"], BoundedRendezvous(["r0", "r1"]), fingerprint, tokens_per_block)
    with router.route(token_ids, cache_salt) as routed:   # counts it in flight on routed.replica
        ...forward the request to routed.replica...

The prefix key of a prompt is the block key (``kvstore.keys.block_keys``, the connector's own)
of its last full block within the first ``prefix_tokens`` tokens: prompts that share that head
(a system prompt, a document) share it; a prompt shorter than one block is keyed by its tokens.

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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvstore.client import Client, connect
from kvstore.errors import KvStoreError
from kvstore.keys import Fingerprint, block_keys
from kvstore.routing.policies import Choice, RouteRequest


class Policy(Protocol):
    def choose(self, request: RouteRequest, loads: Sequence[int]) -> Choice: ...


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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self._clients:
            client.close()


class Router:
    def __init__(
        self,
        replicas: Sequence[str],
        policy: Policy,
        fingerprint: Fingerprint,
        tokens_per_block: int,
        probe: SidecarProbe | None = None,
        prefix_tokens: int = 256,
    ) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = tuple(replicas)
        self.policy = policy
        self._fingerprint = fingerprint
        self._tokens_per_block = tokens_per_block
        self._probe = probe
        self._prefix_tokens = prefix_tokens
        self._lock = threading.Lock()
        self._loads = [0] * len(replicas)
        self._routed = self._first = self._cached = 0

    def request_for(self, token_ids: Sequence[int], cache_salt: str = "") -> tuple[RouteRequest, list[bytes]]:
        keys = block_keys(
            self._fingerprint, list(token_ids), self._tokens_per_block, cache_salt=cache_salt or None
        )
        head = min(len(keys), max(1, self._prefix_tokens // self._tokens_per_block))
        if head:
            prefix_key = bytes(keys[head - 1])
        else:
            raw = b"".join(t.to_bytes(4, "little") for t in token_ids) + cache_salt.encode()
            prefix_key = xxhash.xxh3_128_digest(raw)
        hits = (
            self._probe.hits(self._fingerprint, keys, cache_salt) if self._probe is not None and keys else ()
        )
        return RouteRequest(prefix_key, len(token_ids), tuple(hits)), [bytes(k) for k in keys]

    @contextlib.contextmanager
    def route(self, token_ids: Sequence[int], cache_salt: str = "") -> Iterator[Routed]:
        request, _ = self.request_for(token_ids, cache_salt)
        with self._lock:
            choice = self.policy.choose(request, self._loads)
            self._loads[choice.replica] += 1
            hits = request.hits[choice.replica] if choice.replica < len(request.hits) else ()
            cached = len(hits) * self._tokens_per_block
            self._routed += 1
            self._first += choice.replica == choice.first
            self._cached += cached
        try:
            yield Routed(
                choice.replica, self.replicas[choice.replica], choice.replica == choice.first, cached
            )
        finally:
            with self._lock:
                self._loads[choice.replica] -= 1

    def stats(self) -> RouterStats:
        with self._lock:
            return RouterStats(self._routed, self._first, tuple(self._loads), self._cached)
