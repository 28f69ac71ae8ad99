"""The kvstore client: for users, scripts, tests and engine plugins.

    with connect("unix:///run/kvstore/kvstore.sock") as kv:     # or connect("host:port", token=...)
        kv.put(fingerprint, keys, blocks)                      # remote path (Put stream)
        n = kv.lookup(fingerprint, keys)                       # length of the present prefix
        blocks = kv.get(fingerprint, keys)                     # the present prefix's blocks
        n = kv.get_into(fingerprint, keys, buffers)            # ... into the caller's buffers

Lookups, resolves and reservations (with their releases, commits and aborts), remote puts and
gets use the server's raw data port (over TCP, or its Unix twin on the same host) when it has
one (``data_plane="auto"``, the default), else gRPC (``data_plane="grpc"``).

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

Control calls go through the generated ``KvStoreStub``; the Get and Put streams are wired by
hand, since their frames are bytes encoded and decoded here (``kvstore.frames``), not messages.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from kvstore.client.connections import DataConnections
from kvstore.client.dataport import block_misfit
from kvstore.client.inplace import Buffers, copy_into, read_pipelined, write_pipelined
from kvstore.client.pool import ReceivePool
from kvstore.client.results import TIER_NAME, Lookup, PendingWrite, ResolvedBlocks, stats_dict
from kvstore.client.translate import translated
from kvstore.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvStoreError,
    StoreFull,
    Unavailable,
)
from kvstore.frames import decode_frame, encode_frame
from kvstore.keys import Fingerprint, ModelIdentity
from kvstore.tls import ClientTls
from kvstore.wire import TIER_NAMES
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers.dram import Arena

_MAX_MESSAGE_BYTES = 256 << 20
READ_TTL_S = 30.0  # the pin of a read_into: the copy must end inside it
READ_MARGIN_S = 5.0
WRITE_TTL_S = 30.0  # a pipelined write's reservations, should it die before committing them
RECEIVE_POOL_BYTES = 512 << 20  # per thread: what ``get`` keeps of the buffers it receives into
_SERVICE = pb.DESCRIPTOR.services_by_name["KvStore"]


class Client:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        data_plane: str = "auto",
        tls: ClientTls | None = None,
        receive_pool_bytes: int = RECEIVE_POOL_BYTES,
    ) -> None:
        if data_plane not in ("auto", "grpc"):
            raise InvalidArgument(f"data_plane is 'auto' or 'grpc', got {data_plane!r}")
        if tls is not None and address.startswith("unix:"):
            raise InvalidArgument("TLS is for TCP addresses; the Unix socket is local and plain")
        if receive_pool_bytes < 0:
            raise InvalidArgument(f"receive_pool_bytes is at least 0, got {receive_pool_bytes}")
        self.address = address
        self.timeout_s = timeout_s
        self.receive_pool_bytes = receive_pool_bytes
        self._local = threading.local()  # per thread: its deadline and its receive pool
        self._data = (
            DataConnections(address, token, tls, self._data_deadline, self.server_info)
            if data_plane == "auto"
            else None
        )
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ]
        if tls is not None:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, tls.grpc_credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._arena: Arena | None = None
        self._arena_lock = threading.Lock()
        self._unmappable = False  # the arena could not be mapped here: ``get`` reads through the socket
        self._pin_arena = False  # register every arena mapped with CUDA (pin_arena_for_cuda)
        self._stub = pb_grpc.KvStoreStub(self._channel)
        # By hand, not the stub's: the frames are bytes, encoded and decoded by kvstore.frames.
        self._get = self._channel.unary_stream(
            _method_path("Get"), request_serializer=pb.GetRequest.SerializeToString
        )
        self._put = self._channel.stream_unary(
            _method_path("Put"), response_deserializer=pb.PutResponse.FromString
        )

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

    def _data_port(self) -> DataConnections | None:
        """The data-port connections when the server offers one to this client, else None: gRPC."""
        return self._data if self._data is not None and self._data.available() else None

    def _call(self, rpc: Any, request: Any) -> Any:
        """One unary call of the stub, ``rpc`` being its method (``self._stub.Lookup``)."""
        with translated("the call"):
            return rpc(request, metadata=self._metadata, timeout=self._timeout_s())

    # ----------------------------------------------------------------- control

    def register(self, identity: ModelIdentity) -> Fingerprint:
        """Tell the server the model's layout; returns its fingerprint. Blocks stored under it
        must then be exactly ``identity.block_bytes`` long."""
        message = pb.ModelIdentity(**{k: v for k, v in identity.__dict__.items()})
        response: pb.RegisterResponse = self._call(self._stub.Register, pb.RegisterRequest(identity=message))
        return Fingerprint(response.fingerprint)

    def lookup(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> int:
        """Length of the present prefix of ``keys``."""
        if (data := self._data_port()) is not None:
            hit, _, _ = data.call(scope, lambda c: c.lookup(fingerprint, keys))
            return hit
        return self.lookup_tiers(fingerprint, keys, scope=scope).hit_blocks

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
        if (data := self._data_port()) is not None:
            if slots and pin_ttl_s > 0 and self.address.startswith("unix:"):
                hit, codes, lease_id, name, places = data.call(
                    scope, lambda c: c.lookup_slots(fingerprint, keys, pin_ttl_s)
                )
                tiers = tuple(TIER_NAMES.get(code, "unknown") for code in codes)
                return Lookup(hit, tiers, lease_id, name, places)
            hit, codes, lease_id = data.call(scope, lambda c: c.lookup(fingerprint, keys, pin_ttl_s))
            return Lookup(hit, tuple(TIER_NAMES.get(code, "unknown") for code in codes), lease_id)
        r: pb.LookupResponse = self._call(
            self._stub.Lookup,
            pb.LookupRequest(fingerprint=fingerprint, keys=list(keys), pin_ttl_s=pin_ttl_s, scope=scope),
        )
        return Lookup(r.hit_blocks, tuple(TIER_NAME[t] for t in r.tiers), r.lease_id)

    def exists(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> list[bool]:
        r: pb.ExistsResponse = self._call(
            self._stub.Exists, pb.ExistsRequest(fingerprint=fingerprint, keys=list(keys), scope=scope)
        )
        return list(r.present)

    def delete(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> int:
        r: pb.DeleteResponse = self._call(
            self._stub.Delete, pb.DeleteRequest(fingerprint=fingerprint, keys=list(keys), scope=scope)
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
        return int(self._call(self._stub.Invalidate, request).removed)

    def demote(self, tier: str, fingerprint: bytes | None = None, *, tenant: str = "") -> int:
        """Move the caller's blocks (of ``fingerprint``, or all) out of ``tier`` into the next
        tier; ``tenant`` as for ``invalidate``. Returns how many blocks moved."""
        request = pb.DemoteRequest(tier=tier, fingerprint=fingerprint or b"", tenant=tenant)
        return int(self._call(self._stub.Demote, request).moved)

    def shred(self, tenant: str) -> tuple[int, bool]:
        """Crypto-shred ``tenant`` now (admins only): its key file deleted and every copy of its
        blocks the server reaches dropped. Returns (blocks dropped, whether a key file went)."""
        r: pb.ShredResponse = self._call(self._stub.Shred, pb.ShredRequest(tenant=tenant))
        return int(r.removed), bool(r.key_removed)

    def stats(self) -> dict[str, Any]:
        return stats_dict(self._call(self._stub.Stats, pb.StatsRequest()))

    @property
    def checksum_failures(self) -> int:
        """Blocks this client received over the data port that failed the checksum the server
        sent with them: each ended its get's prefix (a miss)."""
        return 0 if self._data is None else self._data.checksum_failures

    def server_info(self) -> dict[str, Any]:
        r: pb.ServerInfoResponse = self._call(self._stub.ServerInfo, pb.ServerInfoRequest())
        return {"data_port": r.data_port, "data_socket": r.data_socket, "tiers": list(r.tiers)}

    def release(self, lease_id: int, wait: bool = True) -> None:
        """Let go of a lease's pins. ``wait=False``, on the data port: send the release and
        return without the round trip; the server then ignores a lease it cannot release
        (expired, unknown) rather than answer. Over gRPC it is a plain release."""
        if (data := self._data_port()) is not None:
            data.call("", lambda c: c.release(lease_id, wait))
            return
        self._call(self._stub.Release, pb.ReleaseRequest(lease_id=lease_id))

    def lease_held(self, lease_id: int) -> bool:
        """Whether this tenant's lease still pins its blocks (neither released nor expired and
        collected): after copying slots of a ``lookup_tiers(..., slots=True)``, True means the
        copy read the blocks the lookup found. Over the data port only."""
        if (data := self._data_port()) is None:
            raise FailedPrecondition("lease_held needs the server's data port")
        return bool(data.call("", lambda c: c.lease_held(lease_id)))

    # ----------------------------------------------------------------- remote data plane

    def put(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[bytes | bytearray | memoryview],
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
        if (data := self._data_port()) is not None:
            stored = 0
            if self._arena_mapped():
                try:
                    return self.write(fingerprint, keys, blocks, parent=parent, scope=scope)
                except StoreFull as exc:  # the rest through the socket: the blocks in are skipped
                    stored = exc.stored
                except FailedPrecondition:  # no arena to write in place (or a throttled one)
                    pass
            stored += data.call(scope, lambda c: c.put(fingerprint, keys, blocks, parent))
            return stored

        def frames() -> Iterator[bytes]:
            for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
                if i == 0:
                    yield encode_frame(key, block, fingerprint, parent or b"", scope)
                else:
                    yield encode_frame(key, block)

        with translated("the Put stream"):
            response = self._put(frames(), metadata=self._metadata, timeout=self._timeout_s())
        return int(response.stored)

    def _stream(self, fingerprint: bytes, keys: Sequence[bytes], scope: str) -> Iterator[memoryview]:
        request = pb.GetRequest(fingerprint=fingerprint, keys=list(keys), scope=scope)
        with translated("the Get stream"):
            for message in self._get(request, metadata=self._metadata, timeout=self._timeout_s()):
                yield decode_frame(message).payload

    def get(self, fingerprint: bytes, keys: Sequence[bytes], scope: str = "") -> list[memoryview]:
        """The blocks of the present prefix of ``keys`` (shorter than ``keys`` at the first miss),
        each a writable ``memoryview`` of its own memory, valid for as long as the caller holds
        it (see the module docstring: the memory is reused once nothing refers to it)."""
        pool = self._receive_pool()
        data = self._data_port()
        if data is not None and self._arena_mapped():  # same host: out of the arena, not the socket
            views: list[memoryview] = []
            # the pool's look at which buffers are free, and the views of them, made while the
            # first lookup is answered
            got = self._from_arena(
                fingerprint,
                keys,
                scope,
                lambda _, sizes: _taken(pool, sizes, views),
                lambda: pool.begin(expect=len(keys)),
            )
            if got is not None:
                return views
        pool.begin()
        if data is not None:
            blocks = data.call(scope, lambda c: c.get(fingerprint, keys, pool.take))
            return blocks
        views = []
        for payload in self._stream(fingerprint, keys, scope):
            view = pool.take(len(payload))
            view[:] = payload
            views.append(view)
        return views

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
        if (data := self._data_port()) is not None:
            copied = data.call(scope, lambda c: c.get_into(fingerprint, keys, outs, exact))
            return copied
        n = 0
        for payload in self._stream(fingerprint, keys, scope):
            nbytes = memoryview(outs[n]).nbytes if n < len(outs) else -1
            if nbytes < len(payload) or (exact and nbytes != len(payload)):
                raise InvalidArgument(block_misfit(n, len(payload), exact))
            copy_into(outs[n], payload)
            n += 1
        return n

    # ----------------------------------------------------------------- same host

    def attach(self) -> Arena:
        """Map the server's arena (once per client)."""
        with self._arena_lock:
            if self._arena is None:
                if not self.address.startswith("unix:"):
                    raise FailedPrecondition("the arena is for same-host clients on the Unix socket")
                r: pb.AttachResponse = self._call(self._stub.Attach, pb.AttachRequest())
                try:
                    self._arena = _map_arena(r.arena_name, self._pin_arena)
                except Unavailable:
                    self._unmappable = True
                    raise
            return self._arena

    def pin_arena_for_cuda(self) -> bool:
        """Register the arena's mapping in this process as pinned memory with CUDA (attaching
        first), and any arena mapped later after a server restart; whether it is pinned now.
        For an engine whose caches are on a GPU: copies between the arena and the GPU then run
        by DMA (``Arena.pin_with_cuda``; the server's own registration does not cover this
        process). False without CUDA or when the driver refuses; copies still work. The first
        call registers the whole mapping: seconds for tens of GiB."""
        self._pin_arena = True
        arena = self.attach()
        with self._arena_lock:
            return arena.pin_with_cuda()

    def _arena_named(self, name: str) -> Arena:
        """The mapped arena, re-attached when the server now serves another one (it restarted:
        slots of the new arena must never be read out of the old mapping)."""
        with self._arena_lock:
            if self._arena is not None and name and self._arena.name != name:
                stale, self._arena = self._arena, None  # a mapping that fails leaves none
                stale.close()
                self._arena = _map_arena(name, self._pin_arena)
            assert self._arena is not None
            return self._arena

    def resolve(
        self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float = 30.0, scope: str = ""
    ) -> ResolvedBlocks:
        arena = self.attach()
        if (data := self._data_port()) is not None:
            name, slots, tiers, lease_id = data.call(scope, lambda c: c.resolve(fingerprint, keys, ttl_s))
            return ResolvedBlocks(self.arena_views(name, slots), tiers, lease_id)
        r: pb.ResolveResponse = self._call(
            self._stub.Resolve,
            pb.ResolveRequest(fingerprint=fingerprint, keys=list(keys), ttl_s=ttl_s, scope=scope),
        )
        arena = self._arena_named(r.arena_name)
        views = [arena.view[s.offset : s.offset + s.size_bytes] for s in r.slots]
        return ResolvedBlocks(views, tuple(TIER_NAME[t] for t in r.tiers), r.lease_id)

    def arena_views(self, name: str, slots: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views of arena ``name`` at ``slots`` (of ``lookup_tiers(..., slots=True)``), valid
        while their lease holds; re-maps the arena when the server now serves another."""
        self.attach()
        arena = self._arena_named(name)
        return [arena.view[o : o + n] for o, n in slots]

    def read_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str = ""
    ) -> int:
        """Restore the present prefix into ``outs`` straight from the arena; blocks copied.
        Over the data port, when the arena holds every block of the prefix (the usual case),
        one pinning lookup names the slots and the release goes out without waiting for its
        answer; otherwise a ``resolve`` first copies the others into the arena."""
        self.attach()
        if self._data_port() is not None:
            hit = self._from_arena(
                fingerprint, keys, scope, lambda first, sizes: outs[first : first + len(sizes)]
            )
            if hit is not None:
                return hit
        resolved = self.resolve(fingerprint, keys, ttl_s=READ_TTL_S, scope=scope)
        try:
            for view, out in zip(resolved.views, outs, strict=False):
                copy_into(out, view)
        finally:
            if resolved.lease_id:
                self.release(resolved.lease_id)
        return len(resolved.views)

    def _from_arena(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        scope: str,
        buffers: Buffers,
        meanwhile: Callable[[], object] | None = None,
    ) -> int | None:
        """The present prefix copied straight out of the arena (attached, data port up) into
        ``buffers(first, sizes)`` (one per block from ``first`` on, of these sizes, or fewer: the
        first ones); how many blocks are present; ``meanwhile`` runs while the first lookups are
        on their way. Pinning lookups name the slots,
        in chunks pipelined with the copies (``kvstore.client.inplace.read_pipelined``); each
        release goes out without waiting for its answer. None when a block of the prefix is in
        a tier below the arena: the caller reads the way that brings it up."""
        data = self._data_port()
        assert data is not None
        return data.call(
            scope,
            lambda c: read_pipelined(
                c, self._region_named, fingerprint, keys, READ_TTL_S, READ_MARGIN_S, buffers, meanwhile
            ),
        )

    def _arena_mapped(self) -> bool:
        """Whether this client can read blocks out of the arena: on the Unix socket, once the
        arena maps. A client that shares the server's socket but not its ``/dev/shm`` (another
        container) cannot map it; it is asked once, and its ``get`` then reads through the
        socket."""
        if self._arena is not None:
            return True
        if self._unmappable or not self.address.startswith("unix:"):
            return False
        try:
            self.attach()
        except Unavailable:
            if self._unmappable:
                return False
            raise
        except FailedPrecondition:  # a server without an arena to map: the socket it is
            self._unmappable = True
            return False
        return True

    def reserve(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
        ttl_s: float = 30.0,
        scope: str = "",
    ) -> PendingWrite:
        arena = self.attach()
        if (data := self._data_port()) is not None:
            name, reservation_id, slots = data.call(
                scope, lambda c: c.reserve(fingerprint, keys, sizes, parent, ttl_s)
            )
            return PendingWrite(self._slot_views(name, slots), reservation_id)
        r: pb.ReserveResponse = self._call(
            self._stub.Reserve,
            pb.ReserveRequest(
                fingerprint=fingerprint,
                keys=list(keys),
                sizes=list(sizes),
                parent=parent or b"",
                ttl_s=ttl_s,
                scope=scope,
            ),
        )
        arena = self._arena_named(r.arena_name)
        views = [arena.view[s.offset : s.offset + s.size_bytes] if s.present else None for s in r.slots]
        return PendingWrite(views, r.reservation_id)

    def commit(self, reservation_id: int, scope: str = "") -> int:
        if (data := self._data_port()) is not None:
            stored: int = data.call(scope, lambda c: c.commit(reservation_id))
            return stored
        return int(self._call(self._stub.Commit, pb.CommitRequest(reservation_id=reservation_id)).stored)

    def abort(self, reservation_id: int, scope: str = "") -> None:
        if (data := self._data_port()) is not None:
            data.call(scope, lambda c: c.abort(reservation_id))
            return
        self._call(self._stub.Abort, pb.AbortRequest(reservation_id=reservation_id))

    def write(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[bytes | bytearray | memoryview],
        parent: bytes | None = None,
        scope: str = "",
    ) -> int:
        """Store a chain by writing the arena in place; how many blocks were new. Raises
        ``StoreFull`` (with ``.stored``) when some blocks found no room and are not stored.
        Over the data port the chain goes in chunks (``kvstore.client.inplace``), pipelined: the
        server reserves and commits chunks while this thread copies others."""
        self.attach()
        data = self._data_port()
        if data is not None:
            unconfirmed: list[int] = []
            try:
                stored, gaps = data.call(
                    scope,
                    lambda c: write_pipelined(
                        c,
                        self._region_named,
                        fingerprint,
                        keys,
                        blocks,
                        parent,
                        WRITE_TTL_S,
                        unconfirmed,
                    ),
                )
            except BaseException:
                self._abort_quietly(unconfirmed, scope)
                raise
            skipped = [keys[i] for i in gaps]
        else:
            sizes = [len(b) for b in blocks]
            pending = self.reserve(fingerprint, keys, sizes, parent=parent, scope=scope)
            try:
                for view, block in zip(pending.views, blocks, strict=True):
                    if view is not None:
                        copy_into(view, block)
            except BaseException:
                self.abort(pending.reservation_id)
                raise
            stored = self.commit(pending.reservation_id)
            skipped = [k for k, v in zip(keys, pending.views, strict=True) if v is None]
        if skipped:  # present already, or no room: only the second is a failure
            missing = sum(not present for present in self.exists(fingerprint, skipped, scope=scope))
            if missing:
                error = StoreFull(
                    f"stored {stored} of {len(keys)} blocks; {missing} found no room in the arena "
                    "(full of pinned or reserved blocks) and were not stored"
                )
                error.stored = stored
                raise error
        return stored

    def _abort_quietly(self, reservation_ids: Sequence[int], scope: str) -> None:
        """Hand back what a failed write reserved; a server that is gone lets them expire."""
        for reservation_id in reservation_ids:
            try:
                self.abort(reservation_id, scope)
            except Unavailable:
                return
            except KvStoreError:  # committed after all, or expired: nothing to give back
                continue

    def _region_named(self, name: str) -> memoryview:
        return self._arena_named(name).view

    def _slot_views(self, name: str, slots: Sequence[tuple[int, int] | None]) -> list[memoryview | None]:
        arena = self._arena_named(name)
        return [None if slot is None else arena.view[slot[0] : slot[0] + slot[1]] for slot in slots]

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        with self._arena_lock:
            if self._arena is not None:
                self._arena.close()
                self._arena = None
        if self._data is not None:
            self._data.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str,
    token: str | None = None,
    timeout_s: float = 30.0,
    data_plane: str = "auto",
    tls: ClientTls | None = None,
    receive_pool_bytes: int = RECEIVE_POOL_BYTES,
) -> Client:
    """A client for ``unix:///path/to/socket`` (same host) or ``host:port`` (remote; with
    ``tls`` for a server whose TCP listeners use TLS: gRPC and the data port alike)."""
    if not address:
        raise InvalidArgument("empty address")
    return Client(address, token, timeout_s, data_plane, tls, receive_pool_bytes)


def _method_path(name: str) -> str:
    """The path of a KvStore method; a KeyError at import when the proto has no such method."""
    return f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name[name].name}"


def _taken(pool: ReceivePool, sizes: list[int], views: list[memoryview]) -> list[memoryview]:
    """A view of ``pool`` for each block of ``sizes``, appended to ``views`` too."""
    taken = pool.take_many(sizes)
    views.extend(taken)
    return taken


def _map_arena(name: str, pin_with_cuda: bool) -> Arena:
    with translated(f"mapping the server's arena {name}"):
        arena = Arena.attach(name)
    if pin_with_cuda:
        arena.pin_with_cuda()
    return arena
