"""The remote tier's contract: a store shared by many sidecars, under each one's local tiers.

A local tier holds only what its own store put there, so the store indexes it in memory. A
remote tier is written by every sidecar of the fleet: no sidecar can index it, so the store asks
it, in batches, what it holds. Its calls therefore take many keys at once, and each backend
answers a batch in one round trip per node it spans (pipelined, nodes in parallel).

Calls (keys are ``TierKey``s: the store's keys, which carry the tenant namespace and the model
fingerprint, so two tenants' blocks never share a remote key):

    contains(keys)          -> per key, whether it is held (no payload moves)
    heads(keys, fp, not_before_s, n)
                            -> what a lookup may promise: per key, the first ``n`` payload bytes
                               of a copy ``get_many`` would not refuse by its header (another
                               fingerprint, born before ``not_before_s``), else None; a copy
                               refused is deleted and counted as by ``get_many``. Backends with
                               a ranged read (Redis ``GETRANGE``, a kvstore node's head request)
                               move the header and ``n`` bytes; the others read whole values
                               (the default: Mooncake), except when nothing but a damaged
                               header could refuse a copy (no ``not_before_s``, no bytes
                               asked): then ``contains`` answers
    get_many(keys, fp, not_before_s, born)
                            -> per key, the payload (its header checked), or None for a miss;
                               a copy born before ``not_before_s`` is expired (below); ``born``,
                               when given, gets each key's birth time appended (0.0: a miss)
    put_many(blocks)        -> how many of ``blocks`` (RemoteBlock) were stored
    claim(block)            -> stored only if its key was absent: True, False (taken), None (failed)
    carries(namespace)      -> whether that namespace's keys reach this tier at all
    delete_many(keys)       -> how many were present
    delete_matching(prefix, spare)
                            -> how many keys starting with ``prefix`` were removed: the store's
                               invalidation of a namespace, or of one fingerprint in it; keys
                               of fingerprint ``spare`` stay (the fleet's invalidation marks)
    usage()                 -> RemoteUsage: counters of what the tier saw
    close()

Failure: a remote tier is a cache, and the engine can always recompute. An unreachable node, a
timeout (every call is bounded by the backend's ``timeout_s``) or a refused call is never raised
from ``contains``/``get_many``: that node's keys read as misses, the failure is counted, and the
node is left alone for a backoff (doubling up to a cap) so that a dead store costs one timeout,
not one per request. Writes to it are dropped and counted. Only programming errors raise.

Integrity: every value on the medium is a ``BlockHeader`` (fingerprint, length, xxh3-64 of the
payload bound to the tier key: ``tiers.base.bound_checksum``) framed before the payload
(``frame``/``unframe``). A read whose header does not parse, names another fingerprint, or whose
checksum fails is a miss: the value is deleted and counted in ``usage().checksum_failures``.
Since the checksum binds the key (namespace, fingerprint, block key), a value copied or moved
under another key, namespace or model fails it too.

Retention: every value's header carries its block's birth time (``RemoteBlock.born_s``: when
the block was first stored anywhere, wall clock), so no copy restarts the clock. A read asks with
``not_before_s`` (now minus the tenant's retention; 0: none): a copy born before it, or written
without a birth time (a version-2 header: its age cannot be known), is a miss, deleted there and
counted in ``usage().expired``. ``RemoteBlock.expires_s`` is the copy's deadline: a backend with
per-key expiry (Redis) sets it, and a block already past it is not stored.

Threads: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import xxhash

from tiers.base import (
    BlockHeader,
    BytesLike,
    Codec,
    TierKey,
    bound_checksum,
    check_fingerprint,
    check_key,
)

_HEADER_LEN = struct.Struct("<H")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteConfig:
    """The fleet's shared tier under the local ones: kvstore nodes, a Redis Cluster or a Mooncake Store."""

    backend: Literal["", "kvstore", "redis", "mooncake"] = ""  # the fleet's shared tier; "": none
    # host:port of the shared kvstore servers, any Redis Cluster nodes (the rest are discovered),
    # or the one Mooncake master
    nodes: tuple[str, ...] = ()
    timeout_s: float = 1.0  # every remote call; a node past it reads as misses and backs off
    backoff_s: float = 1.0  # a failed node is skipped this long, doubling up to max_backoff_s
    max_backoff_s: float = 30.0  # the longest a failed node is skipped
    queue_bytes: int = 256 << 20  # new blocks waiting to be sent (write-behind); beyond: dropped, counted
    invalidation_poll_s: float = 0.5  # how often the fleet's invalidation marks are read (0: at start only)
    tokens: Mapping[str, str] = field(default_factory=dict)  # kvstore: namespace (t/<tenant>) -> token
    tls_ca_file: str = ""  # kvstore: PEM CA to verify nodes that serve TLS
    key_prefix: str = "kvs:"  # redis, mooncake: every key starts with it
    username: str = ""  # redis: an ACL user (limit it to ~<key_prefix><namespace>* per tenant)
    password_file: str = ""  # redis: a file holding its password (mode 0600)
    ttl_s: float = 0.0  # redis: expiry of each remote copy; 0 = none
    metadata_server: str = ""  # mooncake: the transfer engine's metadata (http://host:port/metadata)
    local_hostname: str = "127.0.0.1"  # mooncake: the address this sidecar's transfer engine advertises
    protocol: str = "tcp"  # mooncake: tcp or rdma
    rdma_devices: str = ""  # mooncake, with protocol rdma: the devices to use

    def __post_init__(self) -> None:
        if self.backend and not self.nodes:
            raise ValueError(f"remote.backend = {self.backend} needs remote.nodes (host:port, ...)")
        for node in self.nodes:
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"remote.nodes: {node!r} is not HOST:PORT with a port from 1 to 65535")
        if self.timeout_s <= 0:
            raise ValueError(f"remote.timeout_s must be positive, got {self.timeout_s}")
        for namespace in self.tokens:
            if not namespace.startswith(("t/", "s/")):
                raise ValueError(
                    f"remote.tokens are keyed by namespace (t/<tenant> or s/<scope>), got {namespace!r}"
                )
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"remote.protocol is tcp or rdma, got {self.protocol!r}")


@dataclass(frozen=True)
class RemoteBlock:
    """One block to store remotely: its key, the fingerprint it belongs to, its bytes, its birth
    time (wall clock, first stored anywhere) and the deadline its retention sets (inf: none).
    ``lasting``: no expiry at all, not even a tier's cap (``ttl_s``): the fleet's invalidation
    marks, which must outlive the sidecars that are down."""

    key: TierKey
    fingerprint: bytes
    payload: BytesLike
    born_s: float = 0.0
    expires_s: float = math.inf
    lasting: bool = False


@dataclass(frozen=True)
class RemoteUsage:
    name: str
    gets: int = 0  # keys asked for by get_many
    hits: int = 0  # of them, served
    puts: int = 0  # blocks stored
    failures: int = 0  # calls (or a node's share of one) that failed: timeouts, refusals
    checksum_failures: int = 0
    expired: int = 0  # copies read past their retention (or of unknown age under one), deleted
    nodes: int = 0
    nodes_down: int = 0  # nodes in backoff now
    unsealable: int = 0  # sealed copies that did not open (key shredded or absent): missed, deleted


class RemoteTier(ABC):
    """A tier many sidecars share. See the module docstring for the contract."""

    name = "remote"

    @abstractmethod
    def contains(self, keys: Sequence[TierKey]) -> list[bool]: ...

    @abstractmethod
    def get_many(
        self,
        keys: Sequence[TierKey],
        fingerprint: bytes,
        not_before_s: float = 0.0,
        born: list[float] | None = None,
    ) -> list[BytesLike | None]:
        """Each key's payload (the caller's to keep), or None; a value stored under another
        ``fingerprint``, or born before ``not_before_s``, is a miss. ``born`` gets each key's
        birth time appended (0.0 for a miss)."""

    def heads(
        self, keys: Sequence[TierKey], fingerprint: bytes, not_before_s: float = 0.0, n: int = 0
    ) -> list[bytes | None]:
        """See the module docstring. This default reads whole values (``get_many``: the
        payload moves, and a copy it refuses is deleted and counted there). With no retention
        or invalidation to check and no bytes asked, an existence check answers: reading whole
        values on every lookup would cost ~10x a lookup's time over a kvstore node to catch
        only a damaged header, which the restore still catches."""
        if not_before_s <= 0.0 and n == 0:
            return [b"" if held else None for held in self.contains(keys)]
        got = self.get_many(keys, fingerprint, not_before_s)
        return [None if v is None else bytes(memoryview(v).cast("B")[:n]) for v in got]

    @abstractmethod
    def put_many(self, blocks: Sequence[RemoteBlock]) -> int: ...

    def claim(self, block: RemoteBlock) -> bool | None:
        """Store ``block`` only if its key is absent: True stored, False the key was taken,
        None the remote failed. Atomic where the backend is (Redis ``SET NX``; a kvstore node
        keeps a key's first copy); this default (look, then put) is not: two claims racing
        may both win (Mooncake)."""
        if self.contains([block.key]) == [True]:
            return False
        return self._put_claim(block)

    def _put_claim(self, block: RemoteBlock) -> bool | None:
        """``put_many([block])`` read as a claim: True stored, False nothing stored (the key
        was taken), None when the call counted a failure."""
        failures = self.usage().failures
        stored = self.put_many([block])
        return True if stored else None if self.usage().failures != failures else False

    def carries(self, namespace: str) -> bool:
        """Whether blocks of ``namespace`` reach this tier at all (a kvstore node: those with a
        token)."""
        return True

    @abstractmethod
    def delete_many(self, keys: Sequence[TierKey]) -> int: ...

    @abstractmethod
    def delete_matching(self, prefix: bytes, spare: bytes = b"") -> int: ...

    @abstractmethod
    def usage(self) -> RemoteUsage: ...

    @abstractmethod
    def close(self) -> None: ...


class Backoff:
    """When a node may be tried again: after a failure it is skipped for ``base_s``, doubling
    with each failure in a row up to ``max_s``; a success resets it. When a skip ends, one caller
    tries the node and the others go on skipping it until that try reports, or for ``try_s`` (the
    longest a try takes) or the skip's span if longer: every request in flight would otherwise
    try a hung node at once, each holding its server thread for the whole timeout (four tenants'
    requests held all eight of a data port's workers, and a third tenant's local lookups waited
    the timeout out). Thread-safe."""

    def __init__(self, base_s: float, max_s: float, try_s: float = 0.0) -> None:
        self._base_s = base_s
        self._max_s = max_s
        self._try_s = try_s
        self._lock = threading.Lock()
        self._failures = 0
        self._wait_s = 0.0
        self._until = 0.0

    def ready(self) -> bool:
        """Whether to call the node now: always while it has not failed; after a failure, once
        per span (the caller's try: report it with ``failed`` or ``succeeded``)."""
        if time.monotonic() < self._until:
            return False
        with self._lock:
            now = time.monotonic()
            if now < self._until:
                return False  # another caller took this try
            if self._failures:
                self._until = now + max(self._wait_s, self._try_s)
            return True

    def down(self) -> bool:
        """Whether the node's last call failed (no try has succeeded since)."""
        return self._failures > 0

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            self._wait_s = min(self._max_s, self._base_s * 2 ** (self._failures - 1))
            self._until = time.monotonic() + self._wait_s

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._until = 0.0


def frame(block: RemoteBlock) -> bytes:
    """The value stored for ``block``: u16 header length, the header, the payload (its one copy)."""
    check_key(block.key)
    check_fingerprint(block.fingerprint)
    view = memoryview(block.payload).cast("B")
    n = len(view)
    checksum = bound_checksum(block.key, xxhash.xxh3_64_intdigest(view))
    header = BlockHeader(block.fingerprint, n, n, Codec.NONE, checksum, born_s=block.born_s).pack()
    return b"".join((_HEADER_LEN.pack(len(header)), header, view))


def unframe(value: BytesLike, key: TierKey, fingerprint: bytes) -> memoryview | None:
    """The payload of a value read under ``key``, as a view of ``value`` (no copy), or None when
    it is not a whole, intact block of ``fingerprint`` stored under ``key`` (the caller deletes
    it and counts a checksum failure)."""
    opened = unframe_born(value, key, fingerprint)
    return None if opened is None else opened[0]


def unframe_born(value: BytesLike, key: TierKey, fingerprint: bytes) -> tuple[memoryview, float] | None:
    """``unframe``, with the block's birth time from its header (0.0: unknown)."""
    found = _header_of(value)
    if found is None or found[0].fingerprint != fingerprint:
        return None
    header, start = found
    payload = memoryview(value)[start:]
    if len(payload) != header.stored_len:
        return None
    if xxhash.xxh3_64_intdigest(payload) != bound_checksum(key, header.checksum):
        return None
    return payload, header.born_s


HEAD_SLACK = 256  # bytes past the u16 a ranged read asks for: frame()'s header is 71


def served_heads(
    what: str,
    keys: Sequence[TierKey],
    values: Sequence[BytesLike | None] | None,
    fingerprint: bytes,
    not_before_s: float,
    n: int,
    count: Callable[[str, int], None],
    delete_many: Callable[[Sequence[TierKey]], object],
    plain_ok: bool = False,
) -> list[bytes | None]:
    """``heads`` for a backend that read the first ``2 + HEAD_SLACK + n`` bytes of each value
    (None or empty: absent; ``values`` None: unreachable, every key a miss): each copy's first
    ``n`` payload bytes, or None where ``get_many`` would refuse it by its header, which is then
    deleted there and counted as ``get_many`` would (a header that does not parse or names
    another fingerprint: a checksum failure; born before ``not_before_s``, or unknown under a
    retention: expired). ``plain_ok`` as for ``open_values``. The payload's checksum needs the
    whole value: a ``get_many`` checks it."""
    if values is None:
        return [None] * len(keys)
    out: list[bytes | None] = []
    corrupt: list[TierKey] = []
    expired: list[TierKey] = []
    for key, value in zip(keys, values, strict=True):
        head, opened = None, _head_of(value, fingerprint, n, plain_ok) if value else None
        if value and opened is None:
            corrupt.append(key)
        elif opened is not None and not_before_s > 0 and opened[1] < not_before_s:  # 0.0: unknown
            expired.append(key)
        elif opened is not None:
            head = bytes(memoryview(value)[opened[0] : opened[0] + n])  # type: ignore[arg-type]
        out.append(head)
    if corrupt:
        log.warning("%s tier: %d blocks failed their header check; deleted", what, len(corrupt))
        count("checksum_failures", len(corrupt))
    if expired:
        count("expired", len(expired))
    if corrupt or expired:
        delete_many(corrupt + expired)
    return out


def _head_of(value: BytesLike, fingerprint: bytes, n: int, plain_ok: bool) -> tuple[int, float] | None:
    """Where the payload starts in a value's head and the block's birth time (0.0: unknown), or
    None when a get would refuse the value by its header (or its head is short of ``n`` payload
    bytes); ``plain_ok``: a value with no header is a plain block of unknown age."""
    found = _header_of(value)
    if found is None:
        return (0, 0.0) if plain_ok and not _framed(value) and len(value) >= n else None
    header, start = found
    if header.fingerprint != fingerprint or len(value) < start + n:  # type: ignore[arg-type]
        return None
    return start, header.born_s


def _header_of(value: BytesLike) -> tuple[BlockHeader, int] | None:
    """A framed value's header and where its payload starts, or None when it has none of ours."""
    view = memoryview(value)
    if len(view) < _HEADER_LEN.size:
        return None
    (header_len,) = _HEADER_LEN.unpack_from(view)
    start = _HEADER_LEN.size + header_len
    header = BlockHeader.unpack(view[_HEADER_LEN.size : start]) if start <= len(view) else None
    return None if header is None or header.codec is not Codec.NONE else (header, start)


def _framed(value: BytesLike) -> bool:
    """Whether ``value`` begins with a header of ours (intact or not)."""
    view = memoryview(value)
    if len(view) < _HEADER_LEN.size:
        return False
    (header_len,) = _HEADER_LEN.unpack_from(view)
    start = _HEADER_LEN.size + header_len
    return start <= len(view) and BlockHeader.unpack(view[_HEADER_LEN.size : start]) is not None


@dataclass
class Opened:
    """What ``open_values`` made of one batch of values read from a backend."""

    payloads: list[BytesLike | None]
    corrupt: list[TierKey]  # failed their header check: the backend deletes and counts them
    expired: list[TierKey]  # past retention, or of unknown age under one: deleted and counted


def open_values(
    keys: Sequence[TierKey],
    values: Sequence[BytesLike | None],
    fingerprint: bytes,
    not_before_s: float,
    born: list[float] | None,
    plain_ok: bool = False,
) -> Opened:
    """Each value (None or empty: absent) checked and opened as ``get_many`` promises; a copy
    born before ``not_before_s``, or without a birth time while one is asked for, is expired.
    ``plain_ok``: a value with no header at all is a plain block of unknown age (a kvstore node
    holds blocks its own clients wrote, checked by its own tiers), not a corrupt one."""
    out = Opened([], [], [])
    for key, value in zip(keys, values, strict=True):
        opened = unframe_born(value, key, fingerprint) if value else None
        if opened is None and value and plain_ok and not _framed(value):
            opened = memoryview(value), 0.0
        if opened is None:
            if value:
                out.corrupt.append(key)
        elif not_before_s > 0 and opened[1] < not_before_s:  # 0.0 (unknown) is before any
            out.expired.append(key)
            opened = None
        out.payloads.append(None if opened is None else opened[0])
        if born is not None:
            born.append(0.0 if opened is None else opened[1])
    return out


def served(
    what: str,
    keys: Sequence[TierKey],
    values: Sequence[BytesLike | None] | None,
    fingerprint: bytes,
    not_before_s: float,
    born: list[float] | None,
    count: Callable[[str, int], None],
    delete_many: Callable[[Sequence[TierKey]], object],
) -> list[BytesLike | None]:
    """``get_many``'s second half for a backend that read ``values`` of ``keys`` (None: it could
    not be reached, every key a miss): the values opened (``open_values``), the corrupt and the
    expired deleted there and counted, the hits counted."""
    if values is None:
        if born is not None:
            born.extend([0.0] * len(keys))
        return [None] * len(keys)
    opened = open_values(keys, values, fingerprint, not_before_s, born)
    if opened.corrupt:
        log.warning("%s tier: %d blocks failed their header check; deleted", what, len(opened.corrupt))
        count("checksum_failures", len(opened.corrupt))
    if opened.expired:
        count("expired", len(opened.expired))
    if opened.corrupt or opened.expired:
        delete_many(opened.corrupt + opened.expired)
    count("hits", sum(p is not None for p in opened.payloads))
    return opened.payloads
