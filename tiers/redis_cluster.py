"""The ``redis`` remote tier: blocks in a Redis Cluster (or Valkey) the user already runs.

Keys are ``key_prefix`` + ``key_name(tier key)``: the store passes a name that begins with the
tenant namespace in plain text (``kvs:t/tenant-a:<fingerprint and key bytes>``), so a Redis ACL
user limited to ``~kvs:t/tenant-a:*`` confines a tenant's sidecar to its own blocks; without a
``key_name`` the tier key's bytes are used as they are. Values are ``tiers.remote.frame`` output: header, then
payload. A batch is one redis-py cluster pipeline: the client groups its commands by the node
owning each key's slot and sends every node its share before reading any reply, so a batch
costs one round trip per node, the nodes in parallel. Every put of a block under a retention
sets its key's expiry to when that retention ends (``SET PXAT``, Redis 6.2 or later: the birth
time plus the retention, not the put's time plus it; the cluster's clock must agree with the
sidecars', as the retention's wall clock already asks); ``ttl_s`` > 0 caps every key's life.

Failure (see ``tiers.remote``): a cluster that cannot be reached or answers an error makes the
batch read as misses (or writes dropped), counted, and the whole cluster is skipped for the
backoff; the client connects lazily and is rebuilt after a failure, so a sidecar starts, and
serves from its local tiers, while the cluster is down. Each socket operation is bounded by
``timeout_s``.

``delete_matching`` scans every primary (SCAN MATCH, the prefix's glob characters escaped) and
deletes in pipelined batches, but for the spared fingerprint's keys (the fleet's invalidation
marks): invalidation is rare and may take a while on a big cluster.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis.exceptions import NoPermissionError, RedisClusterException, RedisError

from tiers.base import BytesLike, TierKey
from tiers.remote import (
    HEAD_SLACK,
    Backoff,
    RemoteBlock,
    RemoteConfig,
    RemoteTier,
    RemoteUsage,
    frame,
    served,
    served_heads,
)

log = logging.getLogger(__name__)

_FAILURES = (RedisError, RedisClusterException, OSError)  # what redis-py raises for a failed call
_GLOB_SPECIAL = frozenset(b"*?[]\\")
_DELETE_BATCH = 512


class RedisClusterTier(RemoteTier):
    name = "redis"

    def __init__(
        self, config: RemoteConfig, password: str = "", key_name: Callable[[bytes], bytes] | None = None
    ) -> None:
        """``password``: read from ``config.password_file`` by the caller; ``key_name``: a tier
        key (or a prefix of one) -> its name in the cluster (default: the key's bytes)."""
        if not config.nodes:
            raise ValueError("the redis tier needs at least one node (host:port)")
        self.config = config
        self._password = password
        self._key_name = key_name
        self._prefix = config.key_prefix.encode()
        self._lock = threading.Lock()
        self._client: Any = None  # redis.cluster.RedisCluster, built on first use
        self._users: dict[int, int] = {}  # id(client) -> calls using it now
        self._retired: dict[int, Any] = {}  # dropped after a failure, closed by their last call
        # a batch reads its masters one after another, each read bounded by timeout_s
        self._backoff = Backoff(config.backoff_s, config.max_backoff_s, config.timeout_s * len(config.nodes))
        self._counts = {"gets": 0, "hits": 0, "puts": 0, "failures": 0, "checksum_failures": 0, "expired": 0}
        self._carried: dict[str, bool] = {}  # namespace -> whether the ACL user may touch its keys
        self._closed = False

    # ----------------------------------------------------------------- the contract

    def contains(self, keys: Sequence[TierKey]) -> list[bool]:
        replies = self._pipelined([("EXISTS", self._key(k)) for k in keys])
        return [False] * len(keys) if replies is None else [bool(r) for r in replies]

    def get_many(
        self,
        keys: Sequence[TierKey],
        fingerprint: bytes,
        not_before_s: float = 0.0,
        born: list[float] | None = None,
    ) -> list[BytesLike | None]:
        self._count("gets", len(keys))
        replies = self._pipelined([("GET", self._key(k)) for k in keys])
        values = None if replies is None else [v if isinstance(v, bytes) else None for v in replies]
        return served("redis", keys, values, fingerprint, not_before_s, born, self._count, self.delete_many)

    def heads(
        self, keys: Sequence[TierKey], fingerprint: bytes, not_before_s: float = 0.0, n: int = 0
    ) -> list[bytes | None]:
        """One pipelined ``GETRANGE`` of each value's header and ``n`` bytes: a lookup costs
        about an ``EXISTS``, and promises no copy a get would refuse by its header (deleted and
        counted, as a get would)."""
        end = 2 + HEAD_SLACK + n - 1
        replies = self._pipelined([("GETRANGE", self._key(k), end) for k in keys])
        values = None if replies is None else [v if isinstance(v, bytes) else None for v in replies]
        return served_heads(
            "redis", keys, values, fingerprint, not_before_s, n, self._count, self.delete_many
        )

    def put_many(self, blocks: Sequence[RemoteBlock]) -> int:
        now = time.time()
        cap_s = now + self.config.ttl_s if self.config.ttl_s > 0 else math.inf
        commands = []
        for b in blocks:
            # the key's deadline: its block's (birth + retention), capped by ttl_s; absolute, so
            # the time the put takes to reach the cluster does not lengthen it
            deadline_s = math.inf if b.lasting else min(b.expires_s, cap_s)
            if deadline_s <= now:
                continue  # past its retention already: not stored
            at = {} if deadline_s == math.inf else {"pxat": math.ceil(deadline_s * 1000)}
            commands.append(("SET", self._key(b.key), frame(b), at))
        replies = self._pipelined(commands)
        stored = 0 if replies is None else sum(r is True for r in replies)
        self._count("puts", stored)
        return stored

    def claim(self, block: RemoteBlock) -> bool | None:
        """``SET NX``: atomic across sidecars; no expiry (the ledger's entries must outlive
        the sidecars that are down)."""
        failures = self.usage().failures
        replies = self._pipelined([("SET", self._key(block.key), frame(block), {"nx": True})])
        return None if replies is None or self.usage().failures != failures else replies == [True]

    def carries(self, namespace: str) -> bool:
        """Every namespace without an ACL user; with one (``remote.username``), those its
        patterns allow: one ``EXISTS`` on the namespace's keys asked once (a refusal would
        otherwise count as a failure and back the whole cluster off); False meanwhile while
        the cluster does not answer."""
        if not self.config.username:
            return True
        known = self._carried.get(namespace)
        if known is not None:
            return known
        ns = namespace.encode()
        with self._using() as client:
            if client is None:
                return False
            try:
                client.exists(self._key(bytes([len(ns)]) + ns) + b"carries?")
            except NoPermissionError:
                known = False
            except _FAILURES:
                return False  # asked again next time
            else:
                known = True
        self._carried[namespace] = known
        return known

    def delete_many(self, keys: Sequence[TierKey]) -> int:
        replies = self._pipelined([("DELETE", self._key(k)) for k in keys])
        return 0 if replies is None else sum(int(r) for r in replies if isinstance(r, int))

    def delete_matching(self, prefix: bytes, spare: bytes = b"") -> int:
        with self._using() as client:
            return 0 if client is None else self._delete_matching(client, prefix, spare)

    def _delete_matching(self, client: Any, prefix: bytes, spare: bytes) -> int:
        pattern = _escape(self._key(prefix)) + b"*"
        removed = 0
        try:
            batch: list[bytes] = []
            for key in client.scan_iter(match=pattern, count=1000):
                if spare and self._fingerprint_of(key) == spare:
                    continue
                batch.append(key)
                if len(batch) >= _DELETE_BATCH:
                    removed += self._delete_raw(client, batch)
                    batch = []
            if batch:
                removed += self._delete_raw(client, batch)
        except _FAILURES as exc:
            self._failed(exc)
        return removed

    def usage(self) -> RemoteUsage:
        with self._lock:
            counts = dict(self._counts)
        return RemoteUsage(
            self.name, nodes=len(self.config.nodes), nodes_down=int(self._backoff.down()), **counts
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ----------------------------------------------------------------- plumbing

    def _key(self, key: bytes) -> bytes:
        name = self._key_name
        return self._prefix + (name(key) if name is not None else key)

    def _fingerprint_of(self, name: bytes) -> bytes:
        """The fingerprint in a key's name: the 32 bytes after its namespace (``key_name``'s
        ``<namespace>:``, or the tier key's length-prefixed namespace)."""
        rest = name[len(self._prefix) :]
        if self._key_name is None:
            n = rest[0] if rest else 0
            return rest[1 + n : 33 + n]
        return rest.partition(b":")[2][:32]

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self._counts[name] += n

    @contextlib.contextmanager
    def _using(self) -> Iterator[Any]:
        """The cluster client for one call, or None while the cluster is in backoff. A client
        a failed call drops is closed when the last call using it ends: closed under the calls
        still reading from it (a hung cluster's calls time out together), redis-py raised
        AttributeError out of them, a request error where the contract promises misses."""
        client = self._connected()
        try:
            yield client
        finally:
            if client is not None:
                with self._lock:
                    left = self._users.pop(id(client)) - 1
                    if left:
                        self._users[id(client)] = left
                    retired = None if left else self._retired.pop(id(client), None)
                if retired is not None:
                    _close(retired)

    def _connected(self) -> Any:
        """The cluster client, built on first use and counted in use (``_using`` gives it
        back); None while the cluster is in backoff."""
        if not self._backoff.ready():
            return None
        with self._lock:
            if self._closed:
                raise RuntimeError("the redis tier is closed")
            if self._client is not None:
                return self._use(self._client)
        try:
            built = _build_client(self.config, self._password)
        except _FAILURES as exc:
            self._failed(exc)
            return None
        with self._lock:
            if self._client is None:
                self._client = built
                return self._use(built)
            client = self._use(self._client)
        built.close()  # another thread built one meanwhile
        return client

    def _use(self, client: Any) -> Any:
        """Count a call using ``client`` (under the lock)."""
        self._users[id(client)] = self._users.get(id(client), 0) + 1
        return client

    def _pipelined(self, commands: Sequence[tuple[Any, ...]]) -> list[Any] | None:
        """The replies of one pipelined batch, or None when the cluster failed it."""
        if not commands:
            return []
        with self._using() as client:
            if client is None:
                return None
            try:
                replies = _execute(client, commands)
            except _FAILURES as exc:
                self._failed(exc)
                return None
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            self._failed(errors[0])
            return [None if isinstance(r, Exception) else r for r in replies]
        self._backoff.succeeded()
        return replies

    def _delete_raw(self, client: Any, keys: list[bytes]) -> int:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(key)
        return sum(int(r) for r in pipe.execute(raise_on_error=False) if isinstance(r, int))

    def _failed(self, exc: BaseException) -> None:
        """Count it, back off, and drop the client: the next try rebuilds it (the topology
        may have changed, or every connection in it may be dead)."""
        log.warning("redis tier: %s: %s; backing off", type(exc).__name__, exc)
        self._count("failures", 1)
        self._backoff.failed()
        with self._lock:
            client, self._client = self._client, None
            if client is not None and id(client) in self._users:
                self._retired[id(client)] = client  # in use: its last call closes it
                client = None
        if client is not None:
            _close(client)


def _close(client: Any) -> None:
    try:
        client.close()
    except _FAILURES:  # closing a broken client may fail too; it is gone either way
        log.debug("redis tier: closing the failed client failed", exc_info=True)


def _execute(client: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """One pipelined batch's replies (errors among them, not raised)."""
    pipe = client.pipeline(transaction=False)
    for command in commands:
        verb, key, *rest = command
        if verb == "EXISTS":
            pipe.exists(key)
        elif verb == "GET":
            pipe.get(key)
        elif verb == "GETRANGE":
            pipe.getrange(key, 0, rest[0])
        elif verb == "SET":
            value, options = rest
            pipe.set(key, value, **options)
        else:
            pipe.delete(key)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    return replies


def _build_client(config: RemoteConfig, password: str) -> Any:
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    nodes = [ClusterNode(host, int(port)) for host, _, port in (n.rpartition(":") for n in config.nodes)]
    return RedisCluster(
        startup_nodes=nodes,
        username=config.username or None,
        password=password or None,
        socket_timeout=config.timeout_s,
        socket_connect_timeout=config.timeout_s,
        retry=Retry(NoBackoff(), 0),  # our own backoff decides when to try again
        require_full_coverage=False,
    )


def _escape(pattern: bytes) -> bytes:
    """``pattern`` with Redis glob characters escaped, to match itself only."""
    out = bytearray()
    for byte in pattern:
        if byte in _GLOB_SPECIAL:
            out.append(ord("\\"))
        out.append(byte)
    return bytes(out)
