"""The gRPC servicer of ``kvstore.v1.KvStore`` over a tiered store.

Every RPC goes through ``_serve``: refuse while draining (UNAVAILABLE), authenticate the caller,
take one of its tenant's in-flight places, time the call, and send a ``KvStoreError`` as its
status (``kvstore.server.handlers.abort``, the one place errors become gRPC statuses). Any other
exception is a bug: gRPC logs it and answers UNKNOWN. A request can only reach its own tenant's
namespace or a shared scope granted to it (``kvstore.server.auth``); lease and reservation ids
are owned by the tenant that got them.

The servicer implements the generated ``KvStoreServicer`` (a method renamed in the proto fails
the type check here: ``@override``) and is registered by ``kvstore.server.handlers.register``.
The Get and Put streams carry hand-written frames (``kvstore.frames``) that no protobuf
serializer touches: Get serves blocks straight out of the arena slots it pinned, Put hands
received payloads to the store without decoding them; both go through the data plane
(``kvstore.server.dataplane``), as the raw data port does. Stats is built in
``kvstore.server.stats``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvStoreError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvstore.frames import decode_frame, encode_frame
from kvstore.keys import BlockKey, Fingerprint, ModelIdentity
from kvstore.remote.layout import fits_layout
from kvstore.server.audit import AuditLog
from kvstore.server.auth import Authenticator, Caller, tenant_namespace
from kvstore.server.dataplane import BATCH_BLOCKS, DataPlane
from kvstore.server.fairness import SERVED_AT_ONCE_PER_TENANT, TenantShares
from kvstore.server.handlers import abort, register
from kvstore.server.metrics import Metrics
from kvstore.server.models import ModelRegistry
from kvstore.server.shredding import Shredder
from kvstore.server.stats import Connections, TokenCounts, stats_response
from kvstore.store import Scope, TieredStore
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import override
else:

    def override(method: Callable[..., Any]) -> Callable[..., Any]:  # typing.override is 3.12+
        return method


log = logging.getLogger(__name__)

TIER_ENUM = {"hbm": pb.TIER_HBM, "dram": pb.TIER_DRAM, "nvme": pb.TIER_NVME, "remote": pb.TIER_REMOTE}
PUT_BUFFER_BYTES = 32 << 20  # a Put stream's frames buffered before they go to the data plane

R = TypeVar("R")


class KvStoreService(pb_grpc.KvStoreServicer):
    def __init__(
        self,
        store: TieredStore,
        auth: Authenticator,
        metrics: Metrics | None = None,
        models: ModelRegistry | None = None,
        max_requests_per_tenant: int = 8,
        stream_timeout_s: float = 60.0,
        audit: AuditLog | None = None,
        shredder: Shredder | None = None,
    ) -> None:
        self.store = store
        self.audit = audit  # invalidations, deletions, demotions, shreds: who, what, how many
        self.shredder = shredder or Shredder(store, audit)
        self.auth = auth
        self.metrics = metrics
        self.draining = threading.Event()
        self.data_port = 0  # set by the server when it runs a raw data port
        self.data_socket = ""  # likewise for its Unix-socket twin
        self.addresses: list[str] = []  # set by the server once it listens (for Stats)
        self.connections: Connections | None = None  # set by the server once it listens (for Stats)
        self._started = time.monotonic()
        self._models = models or ModelRegistry()
        self._tokens = TokenCounts()
        self._in_flight_lock = threading.Lock()
        self._max_in_flight = max_requests_per_tenant
        self._stream_timeout_s = stream_timeout_s
        self._in_flight: Counter[str] = Counter()  # per tenant
        # Of those in flight, the ones a worker runs at once (the data ports take the same places)
        self.shares = TenantShares(SERVED_AT_ONCE_PER_TENANT)
        self.plane = DataPlane(store, self.check_sizes, self.record_hits)  # both transports' bytes

    # ----------------------------------------------------------------- plumbing

    def _serve(
        self, method: str, context: grpc.ServicerContext, body: Callable[[Caller], R], slot: bool = True
    ) -> R:
        start = time.perf_counter()
        try:
            if self.draining.is_set():
                raise Unavailable("the server is draining; retry on another replica or after restart")
            caller = self.auth.caller(context.invocation_metadata(), context.peer())
            with self._slot(caller.tenant) if slot else contextlib.nullcontext():
                return body(caller)
        except KvStoreError as exc:
            abort(context, exc)
        finally:
            if self.metrics is not None and method:
                self.metrics.request_seconds.labels(method).observe(time.perf_counter() - start)

    @contextlib.contextmanager
    def _slot(self, tenant: str) -> Iterator[None]:
        """One of the tenant's ``max_requests_per_tenant`` in-flight places: the workers are
        shared, so one tenant's stalled calls must not take them all; then one of its places in
        ``shares`` (asleep until then), so that its calls in flight want the GIL no more than
        SERVED_AT_ONCE_PER_TENANT at a time."""
        with self._in_flight_lock:
            if self._in_flight[tenant] >= self._max_in_flight:
                raise ResourceExhausted(
                    f"tenant {tenant} has {self._max_in_flight} requests in flight already "
                    "(server.max_requests_per_tenant); retry when one is done"
                )
            self._in_flight[tenant] += 1
        try:
            with self.shares.place(tenant, self._stream_timeout_s):
                yield
        finally:
            with self._in_flight_lock:
                self._in_flight[tenant] -= 1

    def _audited(
        self,
        caller: Caller,
        action: str,
        namespace: str | None,
        fingerprint: bytes | None = None,
        keys: Sequence[bytes] = (),
    ) -> contextlib.AbstractContextManager[Callable[[int], None]]:
        """The audit log's record of an admin action around its body: written before the action
        takes effect, or the action refused (``AuditNotWritten``; ``kvstore.server.audit``)."""
        if self.audit is None:
            return contextlib.nullcontext(_ignore)
        return self.audit.action(
            caller.tenant, action, namespace=namespace, fingerprint=fingerprint, keys=keys
        )

    def _watchdog(self, context: grpc.ServicerContext) -> threading.Timer:
        """Cuts a stream still open after ``stream_timeout_s``: a stalled peer frees its worker."""
        timer = threading.Timer(self._stream_timeout_s, context.cancel)
        timer.daemon = True
        timer.start()
        return timer

    def _scope(self, caller: Caller, fingerprint: bytes, scope: str) -> Scope:
        return Scope(self.auth.namespace(caller, scope), Fingerprint(fingerprint))

    def check_sizes(self, fingerprint: bytes, sizes: Iterable[int]) -> None:
        identity = self._models.get(fingerprint)
        if identity is None:
            return
        expected = identity.block_bytes
        for size in sizes:
            if not fits_layout(size, expected):  # bare, or framed by a sidecar (its remote copies)
                raise InvalidArgument(
                    f"block of {size} B does not match the layout registered for fingerprint "
                    f"{fingerprint.hex()[:16]}: {expected} B per block"
                )

    def _tokens_per_block(self, fingerprint: bytes) -> int:
        identity = self._models.get(fingerprint)
        return identity.tokens_per_block if identity else 0

    def record_hits(self, caller: Caller, fingerprint: bytes, asked: int, tiers: Sequence[str]) -> None:
        tpb = self._tokens_per_block(fingerprint)
        if tpb:
            self._tokens.add(caller.tenant, asked * tpb, len(tiers) * tpb)
        if self.metrics is not None:
            self.metrics.record_lookup(caller.tenant, len(tiers), asked - len(tiers), tiers, tpb)

    # ----------------------------------------------------------------- control

    @override
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        def body(caller: Caller) -> pb.RegisterResponse:
            i = request.identity
            try:
                identity = ModelIdentity(
                    model_id=i.model_id,
                    weights_digest=i.weights_digest,
                    num_layers=i.num_layers,
                    num_kv_heads=i.num_kv_heads,
                    head_dim=i.head_dim,
                    tokens_per_block=i.tokens_per_block,
                    kv_dtype=i.kv_dtype or "bfloat16",
                    kv_quantization=i.kv_quantization,
                    memory_layout=i.memory_layout or "vllm-cpu",
                    adapter_id=i.adapter_id,
                    adapter_digest=i.adapter_digest,
                    tokenizer_digest=i.tokenizer_digest,
                    chat_template_version=i.chat_template_version,
                    rope_theta=i.rope_theta or 10000.0,
                    rope_scaling=i.rope_scaling,
                    tp_rank=i.tp_rank,
                    tp_world_size=i.tp_world_size or 1,
                )
            except ValueError as exc:
                raise InvalidArgument(f"bad model identity: {exc}") from exc
            fingerprint = self._models.register(identity, caller.tenant)
            return pb.RegisterResponse(fingerprint=fingerprint, block_bytes=identity.block_bytes)

        return self._serve("Register", context, body)

    @staticmethod
    def _unclaimed(context: grpc.ServicerContext, call: str, undo: Callable[[], None]) -> None:
        """A caller whose deadline passed (or who hung up) while the store worked never learns
        its lease id and can release nothing: release the pins now, not at their TTL (the data
        port's ``_caller_left`` does the same)."""
        if context.is_active():
            return
        with contextlib.suppress(KvStoreError):  # it expired meanwhile: nothing left to free
            undo()
        log.info("%s: the caller left before its answer (its deadline passed); pins released", call)

    @override
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        def body(caller: Caller) -> pb.LookupResponse:
            scope = self._scope(caller, request.fingerprint, request.scope)
            keys = [BlockKey(k) for k in request.keys]
            ttl = request.pin_ttl_s if request.pin_ttl_s > 0 else None
            result = self.store.lookup(scope, keys, pin_ttl_s=ttl, owner=caller.tenant)
            if result.lease is not None:
                lease_id = result.lease.lease_id
                self._unclaimed(context, "Lookup", lambda: self.store.release(lease_id))
            self.record_hits(caller, request.fingerprint, len(keys), result.tiers)
            return pb.LookupResponse(
                hit_blocks=result.hit_blocks,
                tiers=[TIER_ENUM[t] for t in result.tiers],
                lease_id=result.lease.lease_id if result.lease else 0,
                lease_ttl_s=ttl or 0.0,
            )

        return self._serve("Lookup", context, body)

    @override
    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext) -> pb.ExistsResponse:
        def body(caller: Caller) -> pb.ExistsResponse:
            scope = self._scope(caller, request.fingerprint, request.scope)
            return pb.ExistsResponse(present=self.store.exists(scope, [BlockKey(k) for k in request.keys]))

        return self._serve("Exists", context, body)

    @override
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        def body(caller: Caller) -> pb.DeleteResponse:
            scope = self._scope(caller, request.fingerprint, request.scope)
            keys = [BlockKey(k) for k in request.keys]
            with self._audited(caller, "delete", scope.namespace, scope.fingerprint, keys) as done:
                deleted = self.store.delete(scope, keys)
                done(deleted)
            return pb.DeleteResponse(deleted=deleted)

        return self._serve("Delete", context, body)

    @override
    def Invalidate(
        self, request: pb.InvalidateRequest, context: grpc.ServicerContext
    ) -> pb.InvalidateResponse:
        def body(caller: Caller) -> pb.InvalidateResponse:
            target = request.WhichOneof("target")
            if target is None or (target == "everything" and not request.everything):
                raise InvalidArgument("Invalidate needs a fingerprint or everything=true")
            namespace = _target_namespace(caller, request.tenant, "invalidate")
            fingerprint = _optional_fingerprint(request.fingerprint) if target == "fingerprint" else None
            with self._audited(caller, "invalidate", namespace, fingerprint) as done:
                removed = self.store.invalidate(namespace=namespace, fingerprint=fingerprint)
                done(removed)
            log.warning(
                "tenant %s invalidated %d blocks (target %s)", caller.tenant, removed, request.tenant or "own"
            )
            return pb.InvalidateResponse(removed=removed)

        return self._serve("Invalidate", context, body)

    @override
    def Demote(self, request: pb.DemoteRequest, context: grpc.ServicerContext) -> pb.DemoteResponse:
        def body(caller: Caller) -> pb.DemoteResponse:
            namespace = _target_namespace(caller, request.tenant, "demote")
            fingerprint = _optional_fingerprint(request.fingerprint) if request.fingerprint else None
            with self._audited(caller, f"demote {request.tier}", namespace, fingerprint) as done:
                moved = self.store.demote(request.tier, namespace=namespace, fingerprint=fingerprint)
                done(moved)
            log.info("tenant %s demoted %d blocks out of %s", caller.tenant, moved, request.tier)
            return pb.DemoteResponse(moved=moved)

        return self._serve("Demote", context, body)

    @override
    def Shred(self, request: pb.ShredRequest, context: grpc.ServicerContext) -> pb.ShredResponse:
        def body(caller: Caller) -> pb.ShredResponse:
            if not caller.admin:
                raise PermissionDenied(
                    f"tenant {caller.tenant!r} is not an admin (server.admins): only admins shred"
                )
            if not request.tenant or request.tenant == "*":
                raise InvalidArgument("Shred needs the name of one tenant")
            namespace = tenant_namespace(request.tenant)
            with self._audited(caller, "shred", namespace) as done:
                removed, key_removed = self.shredder.shred(namespace)
                done(removed)
            return pb.ShredResponse(removed=removed, key_removed=key_removed)

        return self._serve("Shred", context, body)

    @override
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        def body(caller: Caller) -> pb.StatsResponse:
            uptime_s = time.monotonic() - self._started
            return stats_response(
                self.store, caller, self._models, self._tokens, uptime_s, self.addresses, self.connections
            )

        return self._serve("Stats", context, body)

    @override
    def ServerInfo(
        self, request: pb.ServerInfoRequest, context: grpc.ServicerContext
    ) -> pb.ServerInfoResponse:
        def body(caller: Caller) -> pb.ServerInfoResponse:
            return pb.ServerInfoResponse(
                data_port=self.data_port,
                data_socket=self.data_socket,
                tiers=[t.name for t in self.store.tiers],
            )

        return self._serve("ServerInfo", context, body)

    @override
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        def body(caller: Caller) -> pb.ReleaseResponse:
            self.store.release(request.lease_id, owner=caller.tenant)
            return pb.ReleaseResponse()

        return self._serve("Release", context, body)

    # ----------------------------------------------------------------- same host

    def _arena(self) -> Any:
        return self.plane.arena()

    @override
    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        def body(caller: Caller) -> pb.AttachResponse:
            if not context.peer().startswith("unix:"):
                raise FailedPrecondition(
                    "Attach is for same-host clients on the Unix socket; use Get and Put"
                )
            arena = self._arena()
            return pb.AttachResponse(
                arena_name=arena.arena.name, arena_bytes=arena.arena.size_bytes, pinned=arena.pinned
            )

        return self._serve("Attach", context, body)

    @override
    def Resolve(self, request: pb.ResolveRequest, context: grpc.ServicerContext) -> pb.ResolveResponse:
        def body(caller: Caller) -> pb.ResolveResponse:
            start = time.perf_counter()
            self._arena()
            scope = self._scope(caller, request.fingerprint, request.scope)
            keys = [BlockKey(k) for k in request.keys]
            resolved = self.store.resolve(scope, keys, request.ttl_s or None, owner=caller.tenant)
            if resolved.lease is not None:
                lease_id = resolved.lease.lease_id
                self._unclaimed(context, "Resolve", lambda: self.store.release(lease_id))
            self.record_hits(caller, request.fingerprint, len(keys), resolved.tiers)
            if self.metrics is not None:
                self.metrics.restore_seconds.labels("resolve").observe(time.perf_counter() - start)
            return pb.ResolveResponse(
                slots=[
                    pb.Slot(offset=s.offset, size_bytes=s.size_bytes, present=True) for s in resolved.slots
                ],
                tiers=[TIER_ENUM[t] for t in resolved.tiers],
                lease_id=resolved.lease.lease_id if resolved.lease else 0,
                arena_name=self._arena().arena.name,
            )

        return self._serve("Resolve", context, body)

    @override
    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        def body(caller: Caller) -> pb.ReserveResponse:
            self._arena()
            scope = self._scope(caller, request.fingerprint, request.scope)
            self.check_sizes(request.fingerprint, request.sizes)
            reservation = self.store.reserve(
                scope,
                [BlockKey(k) for k in request.keys],
                list(request.sizes),
                parent=BlockKey(request.parent) if request.parent else None,
                ttl_s=request.ttl_s or None,
                owner=caller.tenant,
            )
            return pb.ReserveResponse(
                arena_name=self._arena().arena.name,
                reservation_id=reservation.reservation_id,
                slots=[
                    pb.Slot(offset=s.offset, size_bytes=s.size_bytes, present=True) if s else pb.Slot()
                    for s in reservation.slots
                ],
            )

        return self._serve("Reserve", context, body)

    @override
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        def body(caller: Caller) -> pb.CommitResponse:
            start = time.perf_counter()
            stored = self.store.commit(request.reservation_id, owner=caller.tenant)
            if self.metrics is not None:
                self.metrics.store_seconds.labels("commit").observe(time.perf_counter() - start)
            return pb.CommitResponse(stored=stored)

        return self._serve("Commit", context, body)

    @override
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        def body(caller: Caller) -> pb.AbortResponse:
            self.store.abort(request.reservation_id, owner=caller.tenant)
            return pb.AbortResponse()

        return self._serve("Abort", context, body)

    # ----------------------------------------------------------------- remote streams

    @override
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Frames of the present prefix of ``keys``, in order. Each step pins a batch, copies it
        into frames and releases it before yielding, so a slow reader never holds a pin."""
        caller = self._serve("", context, lambda c: c, slot=False)  # authenticated, for its slot
        slot = self._slot(caller.tenant)
        try:
            slot.__enter__()  # the whole stream holds one: a slow reader keeps its worker
        except KvStoreError as exc:
            abort(context, exc)
        watchdog = self._watchdog(context)
        try:
            yield from self._get(caller, request, context)
        finally:
            watchdog.cancel()
            slot.__exit__(None, None, None)

    def _get(self, caller: Caller, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        start_s = time.perf_counter()
        try:
            scope = self._scope(caller, request.fingerprint, request.scope)
            # Each batch is copied into frames under its pin and released before the frames
            # go out: a slow reader never holds a pin.
            for frames in self.plane.read(caller, scope, [BlockKey(k) for k in request.keys], _frame):
                yield from frames
        except KvStoreError as exc:
            abort(context, exc)
        finally:
            if self.metrics is not None:
                seconds = time.perf_counter() - start_s
                self.metrics.observe_request("Get", seconds)
                self.metrics.restore_seconds.labels("get").observe(seconds)

    @override
    def Put(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PutResponse:
        watchdog = self._watchdog(context)
        try:
            return self._put(request_iterator, context)
        finally:
            watchdog.cancel()

    def _put(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PutResponse:
        def body(caller: Caller) -> pb.PutResponse:
            start = time.perf_counter()
            scope: Scope | None = None
            parent: BlockKey | None = None
            keys: list[BlockKey] = []
            payloads: list[memoryview] = []
            pending_bytes = received = stored = 0

            def flush() -> None:
                # Through the same data plane as the data port: the blocks land in the arena.
                nonlocal parent, keys, payloads, pending_bytes, stored
                assert scope is not None
                sizes = [len(p) for p in payloads]
                stored += self.plane.write(
                    caller, scope, parent, keys, sizes, lambda i, view: _fill(view, payloads[i])
                )
                parent, keys, payloads, pending_bytes = keys[-1], [], [], 0

            for raw in request_iterator:
                frame = decode_frame(raw)
                if scope is None:
                    if not frame.fingerprint:
                        raise InvalidArgument("the first frame of a Put stream must carry the fingerprint")
                    scope = self._scope(caller, frame.fingerprint, frame.scope)
                    parent = BlockKey(frame.parent) if frame.parent else None
                self.check_sizes(scope.fingerprint, [len(frame.payload)])
                keys.append(BlockKey(frame.key))
                payloads.append(frame.payload)
                received += 1
                pending_bytes += len(frame.payload)
                if len(keys) >= BATCH_BLOCKS or pending_bytes >= PUT_BUFFER_BYTES:
                    flush()
            if scope is not None and keys:
                flush()
            if self.metrics is not None:
                self.metrics.store_seconds.labels("put").observe(time.perf_counter() - start)
            return pb.PutResponse(stored=stored, received=received)

        return self._serve("Put", context, body)

    def add_to(self, server: grpc.Server) -> None:
        """Register every RPC on ``server`` (``kvstore.server.handlers``)."""
        register(self, server)


def _target_namespace(caller: Caller, tenant: str, verb: str) -> str | None:
    """The namespace an admin-style call acts on: the caller's own by default; another tenant's,
    or every one (``"*"``, returned as None), for admins only."""
    if tenant and tenant != caller.tenant and not caller.admin:
        raise PermissionDenied(f"tenant {caller.tenant!r} may only {verb} its own blocks")
    if tenant == "*":
        return None
    return Caller(tenant or caller.tenant, False).namespace


def _ignore(outcome: int) -> None:
    """The outcome of an admin action when the audit log is off."""


def _fill(view: memoryview, payload: memoryview) -> None:
    if len(payload) != len(view):
        raise InvalidArgument(f"a frame of {len(payload)} B for a {len(view)} B slot")
    view[:] = payload


def _optional_fingerprint(raw: bytes) -> Fingerprint:
    if len(raw) != 32:
        raise InvalidArgument(f"fingerprints are 32 bytes, got {len(raw)}")
    return Fingerprint(raw)


def _frame(key: bytes, payload: memoryview, checksum: int) -> bytes:
    """A Get stream's frame: its BlockFrame carries no checksum (the data port's get does)."""
    return encode_frame(key, payload)
