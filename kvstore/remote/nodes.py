"""The ``kvstore`` remote tier: other kvstore servers, in the shared role, under a sidecar.

Placement: each block goes to the node that wins it by rendezvous hashing over the node list
(``kvstore.remote.rendezvous``), block by block. A chain's blocks therefore spread over the
nodes; a batch is split by owner and the nodes are asked in parallel, so a prefix costs one round
trip per node it touches, concurrently, and no node becomes the hot spot of a popular prefix
(which placing whole chains by their first block would make it). Adding or removing a node
moves only the blocks it wins or held.

Tenancy: a sidecar's namespace is ``t/<tenant>`` or ``s/<scope>`` (``kvstore.server.auth``).
Its blocks reach a shared node only under that tenant's own bearer token there (``tokens``:
sidecar namespace -> token; a ``s/<scope>`` namespace is sent with its scope, under a token of
a tenant the node grants it to), so the node's own authentication keeps tenants apart: one
tenant's sidecar holds no token that can read another's blocks. A namespace without a token is
never sent (counted as ``unmapped``): blocks are not pooled by accident.

Reads (``get_many``): a node returns the present prefix of the keys it was asked, so after a
node's first miss its later keys read as misses too (the contract allows it: callers restore
prefixes). Each value sent is ``tiers.remote.frame`` output, opaque to the node: its header
carries the block's birth time, so a sidecar reading it back keeps the birth (retention counts
from it, never from the copy) and a copy past its tenant's retention is a miss, deleted from the
node and counted (``expired``). The node's own tiers checksum the value and its own retention, if
set, counts from when the value reached it (a little later than the birth). A value written
without a header (by the node's own clients, or before the header was added) is served as a
block of unknown age: a miss, deleted, where a retention applies (its age cannot be known).

Lookups (``heads``): a node answers a head request with the first bytes of each value (its
header, a sealed copy's key id), so a lookup that checks births or key ids moves about 270
bytes a key, not the block.

Failure: each node has its own backoff (``tiers.remote.Backoff``); a node that fails a call
(unreachable, timed out, refused) is skipped until it passes, its keys reading as misses and
writes to it dropped, all counted. Every call is bounded by ``timeout_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.client import Client, connect
from kvstore.errors import KvStoreError
from kvstore.keys import BlockKey
from kvstore.remote.rendezvous import Rendezvous
from kvstore.store.model import Scope, parse_tier_key
from kvstore.tls import ClientTls
from kvstore.wire import MAX_HEAD_BYTES
from tiers import BytesLike, TierKey
from tiers.remote import (
    HEAD_SLACK,
    Backoff,
    RemoteBlock,
    RemoteConfig,
    RemoteTier,
    RemoteUsage,
    frame,
    open_values,
    served_heads,
)

log = logging.getLogger(__name__)

R = TypeVar("R")
_TENANT, _SCOPE = "t/", "s/"


@dataclass(frozen=True)
class _Group:
    """The keys of one batch that go to one node under one (namespace, fingerprint)."""

    node: int
    scope: Scope
    positions: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)


class KvStoreNodesTier(RemoteTier):
    name = "kvstore"

    def __init__(self, config: RemoteConfig) -> None:
        if not config.nodes:
            raise ValueError("the kvstore remote tier needs at least one node (host:port)")
        self.config = config
        self._tls = ClientTls(ca_file=config.tls_ca_file) if config.tls_ca_file else None
        self._ring = Rendezvous(config.nodes)
        self._backoff = [
            Backoff(config.backoff_s, config.max_backoff_s, config.timeout_s) for _ in config.nodes
        ]
        self._clients: dict[tuple[int, str], Client] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=max(2, len(config.nodes)), thread_name_prefix="kvstore-remote"
        )
        self._counts = {
            "gets": 0,
            "hits": 0,
            "puts": 0,
            "failures": 0,
            "checksum_failures": 0,
            "expired": 0,
            "unmapped": 0,
        }

    # ----------------------------------------------------------------- the contract

    def contains(self, keys: Sequence[TierKey]) -> list[bool]:
        out = [False] * len(keys)

        def ask(client: Client, group: _Group) -> None:
            present = client.exists(group.scope.fingerprint, group.keys, scope=_scope_of(group.scope))
            for position, here in zip(group.positions, present, strict=True):
                out[position] = here

        self._fan_out(self._groups(keys), ask)
        return out

    def get_many(
        self,
        keys: Sequence[TierKey],
        fingerprint: bytes,
        not_before_s: float = 0.0,
        born: list[float] | None = None,
    ) -> list[BytesLike | None]:
        values: list[BytesLike | None] = [None] * len(keys)
        groups = [g for g in self._groups(keys) if g.scope.fingerprint == fingerprint]

        def fetch(client: Client, group: _Group) -> None:
            blocks = client.get(group.scope.fingerprint, group.keys, scope=_scope_of(group.scope))
            for position, value in zip(group.positions, blocks, strict=False):
                values[position] = value

        self._fan_out(groups, fetch)
        # checked under the node-side identity of each key (see _bound), deleted under the key
        bound = [_bound(k) for k in keys]
        opened = open_values(bound, values, fingerprint, not_before_s, born, plain_ok=True)
        original = dict(zip(bound, keys, strict=True))
        opened.corrupt[:] = [original[k] for k in opened.corrupt]
        opened.expired[:] = [original[k] for k in opened.expired]
        if opened.corrupt:
            log.warning(
                "kvstore remote tier: %d blocks failed their header check; deleted", len(opened.corrupt)
            )
            self._count("checksum_failures", len(opened.corrupt))
        if opened.expired:
            self._count("expired", len(opened.expired))
        if opened.corrupt or opened.expired:
            self.delete_many(opened.corrupt + opened.expired)
        self._count("gets", len(keys))
        self._count("hits", sum(b is not None for b in opened.payloads))
        return opened.payloads

    def heads(
        self, keys: Sequence[TierKey], fingerprint: bytes, not_before_s: float = 0.0, n: int = 0
    ) -> list[bytes | None]:
        """Each node's head request (``Client.heads``): the header and ``n`` bytes of each
        copy, about ``2 + HEAD_SLACK + n`` bytes a key, not the value; a copy a get would refuse
        by its header is deleted and counted as there. With no cutoff and no bytes asked, the
        existence check answers (the contract's default)."""
        asked = 2 + HEAD_SLACK + n
        if (not_before_s <= 0.0 and n == 0) or asked > MAX_HEAD_BYTES:
            return super().heads(keys, fingerprint, not_before_s, n)
        values: list[BytesLike | None] = [None] * len(keys)

        def fetch(client: Client, group: _Group) -> None:
            got = client.heads(group.scope.fingerprint, group.keys, asked, scope=_scope_of(group.scope))
            for position, value in zip(group.positions, got, strict=False):
                values[position] = value

        self._fan_out([g for g in self._groups(keys) if g.scope.fingerprint == fingerprint], fetch)
        return served_heads(
            "kvstore",
            keys,
            values,
            fingerprint,
            not_before_s,
            n,
            self._count,
            self.delete_many,
            plain_ok=True,
        )

    def put_many(self, blocks: Sequence[RemoteBlock]) -> int:
        now = time.time()
        blocks = [b for b in blocks if b.expires_s > now]  # past its retention already: not sent
        stored = [0]
        lock = threading.Lock()

        def store(client: Client, group: _Group) -> None:
            sent = [frame(dataclasses.replace(blocks[p], key=_bound(blocks[p].key))) for p in group.positions]
            n = client.put(group.scope.fingerprint, group.keys, sent, scope=_scope_of(group.scope))
            with lock:
                stored[0] += n

        self._fan_out(self._groups([b.key for b in blocks]), store)
        self._count("puts", stored[0])
        return stored[0]

    def claim(self, block: RemoteBlock) -> bool | None:
        """A node keeps a key's first copy: a put that stores nothing found the key taken."""
        return self._put_claim(block)

    def carries(self, namespace: str) -> bool:
        return namespace in self.config.tokens

    def delete_many(self, keys: Sequence[TierKey]) -> int:
        deleted = [0]
        lock = threading.Lock()

        def delete(client: Client, group: _Group) -> None:
            n = client.delete(group.scope.fingerprint, group.keys, scope=_scope_of(group.scope))
            with lock:
                deleted[0] += n

        self._fan_out(self._groups(keys), delete)
        return deleted[0]

    def delete_matching(self, prefix: bytes, spare: bytes = b"") -> int:
        """``prefix`` is a tier key's namespace part, with or without the fingerprint after it.
        A node's own invalidation spares the fleet's marks itself, whatever ``spare`` says."""
        n = prefix[0] if prefix else 0
        namespace = prefix[1 : 1 + n].decode(errors="replace")
        fingerprint = prefix[1 + n :]
        if namespace.startswith(_SCOPE):
            # The Invalidate RPC acts on a tenant's own namespace; a shared scope's blocks go
            # with the scope's keys (delete_many) or their retention, not by prefix.
            log.warning(
                "kvstore remote tier: invalidating shared scope %s by prefix is not supported", namespace
            )
            return 0
        if namespace not in self.config.tokens:
            return 0  # never sent there, so nothing to remove
        removed = [0]
        lock = threading.Lock()

        def invalidate(client: Client, _group: _Group) -> None:
            got = client.invalidate(fingerprint) if fingerprint else client.invalidate(everything=True)
            with lock:
                removed[0] += got

        scope = Scope(namespace, fingerprint or bytes(32))  # type: ignore[arg-type]
        self._fan_out([_Group(i, scope) for i in range(len(self.config.nodes))], invalidate)
        return removed[0]

    def usage(self) -> RemoteUsage:
        with self._lock:
            counts = {k: v for k, v in self._counts.items() if k != "unmapped"}
        down = sum(b.down() for b in self._backoff)
        return RemoteUsage(self.name, nodes=len(self.config.nodes), nodes_down=down, **counts)

    @property
    def unmapped(self) -> int:
        """Keys never sent because their namespace has no token on the shared store."""
        with self._lock:
            return self._counts["unmapped"]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    # ----------------------------------------------------------------- plumbing

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self._counts[name] += n

    def _groups(self, keys: Sequence[TierKey]) -> list[_Group]:
        groups: dict[tuple[int, Scope], _Group] = {}
        unmapped = 0
        for position, raw in enumerate(keys):
            parsed = parse_tier_key(raw)
            if parsed is None:
                raise ValueError(f"not a store tier key: {bytes(raw[:16]).hex()}...")
            scope, key = parsed
            if scope.namespace not in self.config.tokens:
                unmapped += 1
                continue
            node = self._ring.owner(raw)
            group = groups.setdefault((node, scope), _Group(node, scope))
            group.positions.append(position)
            group.keys.append(key)
        if unmapped:
            self._count("unmapped", unmapped)
        return list(groups.values())

    def _fan_out(self, groups: Sequence[_Group], call: Callable[[Client, _Group], None]) -> None:
        """``call`` on each group's node, the nodes in parallel; a node that fails is counted
        and backed off, and its groups' results stay as they were (misses)."""
        grouped: dict[int, list[_Group]] = defaultdict(list)
        for group in groups:
            grouped[group.node].append(group)
        # asked once per node: after a failure, ready() lets one call at a time try it
        by_node = {node: mine for node, mine in grouped.items() if self._backoff[node].ready()}

        def run(node: int, mine: list[_Group]) -> None:
            try:
                for group in mine:
                    call(self._client(node, group.scope.namespace), group)
            except KvStoreError as exc:
                log.warning(
                    "kvstore remote tier: node %s failed: %s; backing off", self.config.nodes[node], exc
                )
                self._count("failures", 1)
                self._backoff[node].failed()
                self._drop(node)
                return
            self._backoff[node].succeeded()

        if len(by_node) == 1:
            ((node, mine),) = by_node.items()
            run(node, mine)  # one node: no hand-off to the pool
            return
        for future in [self._pool.submit(run, node, mine) for node, mine in by_node.items()]:
            future.result()

    def _client(self, node: int, namespace: str) -> Client:
        with self._lock:
            client = self._clients.get((node, namespace))
            if client is None:
                token = self.config.tokens[namespace]
                client = connect(
                    self.config.nodes[node], token=token, timeout_s=self.config.timeout_s, tls=self._tls
                )
                self._clients[(node, namespace)] = client
            return client

    def _drop(self, node: int) -> None:
        """Close a failed node's clients: the next try after the backoff connects afresh."""
        with self._lock:
            dropped = [self._clients.pop(k) for k in list(self._clients) if k[0] == node]
        for client in dropped:
            client.close()


def _bound(raw: TierKey) -> TierKey:
    """What a value's checksum binds on a node: the tier key less its namespace. Sidecars name
    one tenant differently (``t/local`` here, ``t/tenant-a`` there, one token for both) and the
    node keeps tenants apart itself; fingerprint and block key are the same everywhere."""
    return TierKey(bytes(raw[1 + raw[0] :]))


def _scope_of(scope: Scope) -> str:
    """The ``scope`` argument of a call for this namespace: its name for a shared scope, else ""
    (a tenant's own namespace follows from its token)."""
    return scope.namespace[len(_SCOPE) :] if scope.namespace.startswith(_SCOPE) else ""
