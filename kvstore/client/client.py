"""The kvstore client: for users, scripts, tests and engine plugins.

    with connect("unix:///run/kvstore/kvstore.sock") as kv:     # or connect("host:port", token=...)
        kv.put(fingerprint, keys, blocks)                      # remote path (Put stream)
        n = kv.lookup(fingerprint, keys)                       # length of the present prefix
        blocks = kv.get(fingerprint, keys)                     # the present prefix's blocks
        n = kv.get_into(fingerprint, keys, buffers)            # ... into the caller's buffers

Lookups, resolves and reservations (with their releases, commits and aborts), remote puts and
gets use the server's raw data port (over TCP, or its Unix twin on the same host) when it has
one (``data_plane="auto"``, the default), else gRPC (``data_plane="grpc"``). The way is chosen
once per client, at its first data call (asking the server whether it has a data port; making
a client sends nothing, so a client can be made before its server is up), as one of three
transports behind ``kvstore.client.transport.Transport``; the Client delegates to it.

What ``get`` returns: one writable ``memoryview`` per block, of memory that is the caller's for
as long as it holds the view, or anything made from it (a slice, ``bytes(view)`` is a copy, a
numpy array or tensor over it). The memory comes from the calling thread's receive pool
(``kvstore.client.pool``): received into before, so warm, and reused by a later ``get`` of that
thread only once nothing refers to it any more; drop the views (or ``view.release()`` each)
when done with them and the next ``get`` receives into the same memory. Nothing is ever
overwritten behind a view the caller still holds: a thread that keeps its blocks simply gets
fresh memory (page faults, about a third of the speed). ``receive_pool_bytes`` (per thread,
default RECEIVE_POOL_BYTES; 0: no pool) bounds what the pool keeps. The views compare equal to
``bytes`` of the same content; ``bytes(view)`` where an immutable copy is needed.

``get_into`` is the fast path for callers with buffers of their own (an engine's staging
buffers, pinned host memory): over the data port each block goes straight from the socket into
its buffer, nothing allocated. Each buffer must hold its block (InvalidArgument otherwise).

Same-host calls (Unix socket only) move no bytes through the service: ``resolve`` returns views
of the shared arena to read in place (valid until ``release``), ``reserve`` returns views to
write in place before ``commit``; ``read_into`` and ``write`` wrap the two phases. ``put``
writes in place too (what finds no room goes through the socket), and ``get`` copies a prefix
held in the arena out of it into the receive pool (through the socket when a block is in a
slower tier, or when this process cannot map the arena).

Deadlines: every call waits at most the client's ``timeout_s``; inside ``with kv.deadline(s):``
every call this thread makes (with the ``server_info`` and ``attach`` the first data call makes
implicitly, and connecting to the data port) must end within ``s`` of entering the block, or
raises ``DeadlineExceeded`` (a kind of ``Unavailable``). A data-port connection that timed out
is dropped: its stream stopped mid-message; the next call opens another.

Fingerprints and keys are 32-byte ``bytes``. Every failure raises a ``kvstore.errors`` class:
the server's own class for a status it sent (``kvstore.status``), ``InvalidArgument`` for bad
arguments, ``Unavailable`` (``DeadlineExceeded`` for a timeout) for whatever the layers below
raise (gRPC, sockets, the arena's mapping), translated in ``kvstore.client.translate`` and nowhere else; no
``OSError`` or ``grpc.RpcError`` leaves a public method. A Client is safe to share between threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvstore.address import Address, parse_address
from kvstore.client.connections import DataConnections
from kvstore.client.dataport_transport import DataPortTransport
from kvstore.client.grpc_transport import GrpcTransport
from kvstore.client.mapping import ArenaMapping
from kvstore.client.pool import ReceivePool
from kvstore.client.results import Lookup, PendingWrite, ResolvedBlocks, stats_dict
from kvstore.client.samehost_transport import SameHostTransport
from kvstore.client.transport import Blocks, Transport, check_stored
from kvstore.errors import DeadlineExceeded, InvalidArgument
from kvstore.keys import Fingerprint, ModelIdentity
from kvstore.tls import ClientTls
from proto import kvstore_pb2 as pb
from tiers.dram import Arena

RECEIVE_POOL_BYTES = 512 << 20  # per thread: what ``get`` keeps of the buffers it receives into


class Client:
    def __init__(
        self,
        address: str | Address,
        token: str | None = None,
        timeout_s: float = 30.0,
        data_plane: str = "auto",
        tls: ClientTls | None = None,
        receive_pool_bytes: int = RECEIVE_POOL_BYTES,
    ) -> None:
        if data_plane not in ("auto", "grpc"):
            raise InvalidArgument(f"data_plane is 'auto' or 'grpc', got {data_plane!r}")
        self.address = parse_address(address) if isinstance(address, str) else address
        if tls is not None and self.address.same_host:
            raise InvalidArgument("TLS is for TCP addresses; the Unix socket is local and plain")
        if receive_pool_bytes < 0:
            raise InvalidArgument(f"receive_pool_bytes is at least 0, got {receive_pool_bytes}")
        self.timeout_s = timeout_s
        self.receive_pool_bytes = receive_pool_bytes
        self._local = threading.local()  # per thread: its deadline and its receive pool
        self._mapping = ArenaMapping(self.address.same_host, self._attach_call)
        # Control calls go over gRPC whatever the transport; so does data without a data port.
        self._grpc = GrpcTransport(self.address, token, tls, self._timeout_s, self._mapping)
        self._data = (
            DataConnections(self.address, token, tls, self._data_deadline, self.server_info)
            if data_plane == "auto"
            else None
        )
        self._chosen: Transport | None = None  # by the first data call (``_transport``)

    # ----------------------------------------------------------------- plumbing

    @contextlib.contextmanager
    def deadline(self, timeout_s: float) -> Iterator[None]:
        """Calls this thread makes inside the block end within ``timeout_s`` of entering it
        (nested blocks: the earlier end wins), or raise DeadlineExceeded."""
        outer: float | None = getattr(self._local, "deadline", None)
        end = time.monotonic() + timeout_s
        self._local.deadline = end if outer is None else min(outer, end)
        try:
            yield
        finally:
            self._local.deadline = outer

    def _timeout_s(self) -> float:
        """What the next call may take: the client's timeout, or what is left of the deadline."""
        end: float | None = getattr(self._local, "deadline", None)
        if end is None:
            return self.timeout_s
        left = end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the call's deadline passed before it started")
        return min(self.timeout_s, left)

    def _data_deadline(self) -> float | None:
        """The ``time.monotonic()`` by which a data-port operation must end (None: the port's
        own IO_TIMEOUT_S per socket operation, as without a deadline)."""
        if getattr(self._local, "deadline", None) is None:
            return None
        return time.monotonic() + self._timeout_s()

    def _receive_pool(self) -> ReceivePool:
        """This thread's pool of buffers that ``get`` receives into."""
        pool: ReceivePool | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = ReceivePool(self.receive_pool_bytes)
        return pool

    def _transport(self) -> Transport:
        """The way data calls go, chosen once: the data port when the server offers this client
        one (its Unix twin, with the arena, on the same host), else gRPC. A ServerInfo that
        fails chooses nothing; the next call asks again."""
        chosen = self._chosen
        if chosen is None:
            if self._data is None or not self._data.available():
                chosen = self._grpc
            elif self.address.same_host:
                chosen = SameHostTransport(self._data, self._mapping, self.exists)
            else:
                chosen = DataPortTransport(self._data, self._mapping)
            self._chosen = chosen  # two threads choosing at once choose alike
        return chosen

    def _attach_call(self) -> str:
        r: pb.AttachResponse = self._grpc.call(self._grpc.stub.Attach, pb.AttachRequest())
        return r.arena_name

    # ----------------------------------------------------------------- control

    def register(self, identity: ModelIdentity) -> Fingerprint:
        """Tell the server the model's layout; returns its fingerprint. Blocks stored under it
        must then be exactly ``identity.block_bytes`` long."""
        message = pb.ModelIdentity(**{k: v for k, v in identity.__dict__.items()})
        response: pb.RegisterResponse = self._grpc.call(
            self._grpc.stub.Register, pb.RegisterRequest(identity=message)
        )
        return Fingerprint(response.fingerprint)

    def lookup(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> int:
        """Length of the present prefix of ``keys``."""
        return self._transport().lookup(fingerprint, keys, scope)

    def lookup_tiers(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        pin_ttl_s: float = 0.0,
        scope: str = "",
        slots: bool = False,
    ) -> Lookup:
        """The present prefix with the tier of each hit; ``pin_ttl_s`` > 0 pins it under a lease.
        ``slots`` (same host, pinning): also where each hit lies in the arena, to copy it in
        place through ``arena_views`` and then confirm with ``lease_held`` that the pin held,
        one round trip instead of a ``resolve``. Elsewhere no slots come back."""
        return self._transport().lookup_tiers(fingerprint, keys, pin_ttl_s, scope, slots)

    def exists(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> list[bool]:
        r: pb.ExistsResponse = self._grpc.call(
            self._grpc.stub.Exists, pb.ExistsRequest(fingerprint=fingerprint, keys=list(keys), scope=scope)
        )
        return list(r.present)

    def delete(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> int:
        r: pb.DeleteResponse = self._grpc.call(
            self._grpc.stub.Delete, pb.DeleteRequest(fingerprint=fingerprint, keys=list(keys), scope=scope)
        )
        return int(r.deleted)

    def invalidate(
        self, fingerprint: bytes | None = None, *, tenant: str = "", everything: bool = False
    ) -> int:
        """Remove every block of ``fingerprint``, or ``everything``; of the caller's tenant unless
        ``tenant`` names another (``"*"``: all tenants), which needs an admin tenant."""
        if (fingerprint is None) == (not everything):
            raise InvalidArgument("invalidate takes a fingerprint or everything=True, not both")
        request = (
            pb.InvalidateRequest(fingerprint=fingerprint, tenant=tenant)
            if fingerprint is not None
            else pb.InvalidateRequest(everything=True, tenant=tenant)
        )
        return int(self._grpc.call(self._grpc.stub.Invalidate, request).removed)

    def demote(self, tier: str, fingerprint: bytes | None = None, *, tenant: str = "") -> int:
        """Move the caller's blocks (of ``fingerprint``, or all) out of ``tier`` into the next
        tier; ``tenant`` as for ``invalidate``. Returns how many blocks moved."""
        request = pb.DemoteRequest(tier=tier, fingerprint=fingerprint or b"", tenant=tenant)
        return int(self._grpc.call(self._grpc.stub.Demote, request).moved)

    def shred(self, tenant: str) -> tuple[int, bool]:
        """Crypto-shred ``tenant`` now (admins only): its key file deleted and every copy of its
        blocks the server reaches dropped. Returns (blocks dropped, whether a key file went)."""
        r: pb.ShredResponse = self._grpc.call(self._grpc.stub.Shred, pb.ShredRequest(tenant=tenant))
        return int(r.removed), bool(r.key_removed)

    def stats(self) -> dict[str, Any]:
        return stats_dict(self._grpc.call(self._grpc.stub.Stats, pb.StatsRequest()))

    @property
    def checksum_failures(self) -> int:
        """Blocks this client received (over the data port or a gRPC Get stream) that failed
        the checksum the server sent with them: each ended its get's prefix (a miss)."""
        data = 0 if self._data is None else self._data.checksum_failures
        return data + self._grpc.checksum_failures

    def server_info(self) -> dict[str, Any]:
        r: pb.ServerInfoResponse = self._grpc.call(self._grpc.stub.ServerInfo, pb.ServerInfoRequest())
        return {"data_port": r.data_port, "data_socket": r.data_socket, "tiers": list(r.tiers)}

    def release(self, lease_id: int, wait: bool = True) -> None:
        """Let go of a lease's pins. ``wait=False``, on the data port: send the release and
        return without the round trip; the server then ignores a lease it cannot release
        (expired, unknown) rather than answer. Over gRPC it is a plain release."""
        self._transport().release(lease_id, wait)

    def lease_held(self, lease_id: int) -> bool:
        """Whether this tenant's lease still pins its blocks (neither released nor expired and
        collected): after copying slots of a ``lookup_tiers(..., slots=True)``, True means the
        copy read the blocks the lookup found. Over the data port only."""
        return self._transport().lease_held(lease_id)

    # ----------------------------------------------------------------- remote data plane

    def put(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        blocks: Blocks,
        parent: bytes | None = None,
        scope: str = "",
    ) -> int:
        """Store a chain (over the data port, else the Put stream); how many blocks were new. On
        the same host the blocks are copied into the arena in place (``write``), and only what
        finds no room there (a full arena of pinned blocks; no arena) goes through the socket,
        which may place it in a slower tier."""
        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks")
        if not keys:
            return 0
        return self._transport().put(fingerprint, keys, blocks, parent, scope)

    def get(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> list[memoryview]:
        """The blocks of the present prefix of ``keys`` (shorter than ``keys`` at the first miss),
        each a writable ``memoryview`` of its own memory, valid for as long as the caller holds
        it (see the module docstring: the memory is reused once nothing refers to it)."""
        return self._transport().get(fingerprint, keys, scope, self._receive_pool())

    def get_into(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        scope: str = "",
        exact: bool = False,
    ) -> int:
        """Receive the present prefix into ``outs`` (block i into ``outs[i]``, which must hold
        it, and with ``exact`` be exactly its size: InvalidArgument otherwise; a caller whose
        buffers are blocks of one layout cannot tell a short block from a whole one without
        it); how many blocks. The fast path for callers with buffers of their own: over the
        data port the bytes go straight from the socket into ``outs``. After a failure ``outs``
        may hold part of the blocks."""
        return self._transport().get_into(fingerprint, keys, outs, scope, exact)

    def heads(
        self, fingerprint: bytes, keys: Sequence[bytes], head_bytes: int, scope: str = ""
    ) -> list[bytes]:
        """The first ``head_bytes`` (at most ``kvstore.wire.MAX_HEAD_BYTES``) of each block of
        the present prefix of ``keys``, fewer of a shorter block: a copy's header checked
        without its payload moving. The server promotes nothing and counts no hit."""
        return self._transport().heads(fingerprint, keys, head_bytes, scope)

    # ----------------------------------------------------------------- same host

    def attach(self) -> Arena:
        """Map the server's arena (once per client; FailedPrecondition off the Unix socket)."""
        return self._mapping.attach()

    def pin_arena_for_cuda(self) -> bool:
        """Register the arena's mapping in this process as pinned memory with CUDA (attaching
        first), and any arena mapped later after a server restart; whether it is pinned now.
        For an engine whose caches are on a GPU: copies between the arena and the GPU then run
        by DMA (``Arena.pin_with_cuda``; the server's own registration does not cover this
        process). False without CUDA or when the driver refuses; copies still work. The first
        call registers the whole mapping: seconds for tens of GiB."""
        return self._mapping.pin_for_cuda()

    def resolve(
        self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float = 30.0, scope: str = ""
    ) -> ResolvedBlocks:
        self.attach()
        name, slots, tiers, lease_id = self._transport().resolve(fingerprint, keys, ttl_s, scope)
        return ResolvedBlocks(self._mapping.views(name, slots), tiers, lease_id)

    def arena_views(self, name: str, slots: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views of arena ``name`` at ``slots`` (of ``lookup_tiers(..., slots=True)``), valid
        while their lease holds; re-maps the arena when the server now serves another."""
        self.attach()
        return self._mapping.views(name, slots)

    def read_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str = ""
    ) -> int:
        """Restore the present prefix into ``outs`` straight from the arena; blocks copied.
        Over the data port, when the arena holds every block of the prefix (the usual case),
        one pinning lookup names the slots and the release goes out without waiting for its
        answer; otherwise a ``resolve`` first copies the others into the arena."""
        self.attach()
        return self._transport().read_into(fingerprint, keys, outs, scope)

    def reserve(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
        ttl_s: float = 30.0,
        scope: str = "",
    ) -> PendingWrite:
        self.attach()
        name, reservation_id, slots = self._transport().reserve(
            fingerprint, keys, sizes, parent, ttl_s, scope
        )
        return PendingWrite(self._mapping.slot_views(name, slots), reservation_id)

    def commit(self, reservation_id: int, scope: str = "", checksums: Sequence[int] = ()) -> int:
        """Publish the slots of ``reserve``; ``checksums``: the xxh3-64 of each given slot's
        block as written, in order, where the writer took them (``inplace.copy_hashed``);
        otherwise the server's hasher takes them after the commit."""
        return self._transport().commit(reservation_id, scope, checksums)

    def abort(self, reservation_id: int, scope: str = "") -> None:
        self._transport().abort(reservation_id, scope)

    def write(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        blocks: Blocks,
        parent: bytes | None = None,
        scope: str = "",
    ) -> int:
        """Store a chain by writing the arena in place; how many blocks were new. Raises
        ``StoreFull`` (with ``.stored``) when some blocks found no room and are not stored.
        Over the data port the chain goes in chunks (``kvstore.client.inplace``), pipelined: the
        server reserves and commits chunks while this thread copies others."""
        self.attach()
        stored, gaps = self._transport().write(fingerprint, keys, blocks, parent, scope)
        check_stored(stored, keys, gaps, lambda skipped: self.exists(fingerprint, skipped, scope=scope))
        return stored

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        self._mapping.close()
        if self._data is not None:
            self._data.close()
        self._grpc.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str | Address,
    token: str | None = None,
    timeout_s: float = 30.0,
    data_plane: str = "auto",
    tls: ClientTls | None = None,
    receive_pool_bytes: int = RECEIVE_POOL_BYTES,
) -> Client:
    """A client for ``unix:///path/to/socket`` (same host) or ``host:port`` (remote; with
    ``tls`` for a server whose TCP listeners use TLS: gRPC and the data port alike), or an
    address parsed already (``kvstore.address``)."""
    if not address:
        raise InvalidArgument("empty address")
    return Client(address, token, timeout_s, data_plane, tls, receive_pool_bytes)
