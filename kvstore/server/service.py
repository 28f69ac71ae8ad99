"""The gRPC servicer of ``kvstore.v1.KvStore`` over a tiered store.

Every RPC goes through ``_serve``: refuse while draining (UNAVAILABLE), authenticate the caller,
time the call, and send a ``KvStoreError`` as its status (``_abort``: the code and detail of
``kvstore.status``, the detail as trailing metadata) — the one place errors become gRPC statuses.
Any other exception is a bug: gRPC logs it and answers UNKNOWN. A request can only reach its own
tenant's namespace or a shared scope granted to it (``kvstore.auth``); lease and reservation ids
are owned by the tenant that got them.

The servicer implements the generated ``KvStoreServicer`` and is registered through the
generated ``add_KvStoreServicer_to_server`` (``add_to``), so the proto names every method; a
method renamed there fails the type check here (``@override``). Two things the generated
handlers cannot say are changed on them: a request protobuf cannot parse is refused as
INVALID_ARGUMENT (gRPC would answer INTERNAL), and the Get and Put streams carry hand-written
frames (``kvstore.frames``) that no protobuf serializer touches: Get serves blocks straight out
of the arena slots it pinned, Put hands received payloads to the store without decoding them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kvstore import __version__
from kvstore.audit import AuditLog
from kvstore.auth import Authenticator, Caller
from kvstore.dataplane import BATCH_BLOCKS, DataPlane
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
from kvstore.metrics import Metrics
from kvstore.models import ModelRegistry
from kvstore.status import DETAIL_METADATA, status_of
from kvstore.store import Scope, TieredStore
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tiers import TierUsage

if TYPE_CHECKING:
    from typing_extensions import override
else:

    def override(method: Callable[..., Any]) -> Callable[..., Any]:  # typing.override is 3.12+
        return method


log = logging.getLogger(__name__)

_SERVICE = pb.DESCRIPTOR.services_by_name["KvStore"]
SERVICE_NAME = _SERVICE.full_name
TIER_ENUM = {"hbm": pb.TIER_HBM, "dram": pb.TIER_DRAM, "nvme": pb.TIER_NVME}
PUT_BUFFER_BYTES = 32 << 20  # a Put stream's frames buffered before they go to the data plane

R = TypeVar("R")


def _abort(context: grpc.ServicerContext, error: KvStoreError) -> NoReturn:
    code, detail = status_of(error)
    context.set_trailing_metadata(((DETAIL_METADATA, detail),))
    context.abort(grpc.StatusCode[code.name], str(error))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


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
    ) -> None:
        self.store = store
        self.audit = audit  # invalidations, deletions, demotions: who, what, how many
        self.auth = auth
        self.metrics = metrics
        self.draining = threading.Event()
        self.data_port = 0  # set by the server when it runs a raw data port
        self.data_socket = ""  # likewise for its Unix-socket twin
        self.addresses: list[str] = []  # set by the server once it listens (for Stats)
        self._started = time.monotonic()
        self._models = models or ModelRegistry()
        self._tokens_lock = threading.Lock()
        self._lookup_tokens: Counter[str] = Counter()  # per tenant: tokens asked for / found
        self._hit_tokens: Counter[str] = Counter()
        self._max_in_flight = max_requests_per_tenant
        self._stream_timeout_s = stream_timeout_s
        self._in_flight: Counter[str] = Counter()  # per tenant
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
            _abort(context, exc)
        finally:
            if self.metrics is not None and method:
                self.metrics.request_seconds.labels(method).observe(time.perf_counter() - start)

    @contextlib.contextmanager
    def _slot(self, tenant: str) -> Iterator[None]:
        """One of the tenant's ``max_requests_per_tenant`` in-flight places: the workers are
        shared, so one tenant's stalled calls must not take them all."""
        with self._tokens_lock:
            if self._in_flight[tenant] >= self._max_in_flight:
                raise ResourceExhausted(
                    f"tenant {tenant} has {self._max_in_flight} requests in flight already "
                    "(server.max_requests_per_tenant); retry when one is done"
                )
            self._in_flight[tenant] += 1
        try:
            yield
        finally:
            with self._tokens_lock:
                self._in_flight[tenant] -= 1

    def _audit(
        self,
        caller: Caller,
        action: str,
        namespace: str | None,
        fingerprint: bytes | None,
        keys: Sequence[bytes],
        outcome: int,
    ) -> None:
        if self.audit is not None:
            self.audit.record(
                caller.tenant,
                action,
                namespace=namespace,
                fingerprint=fingerprint,
                keys=keys,
                outcome=outcome,
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
        for size in sizes:
            if size != identity.block_bytes:
                raise InvalidArgument(
                    f"block of {size} B does not match the layout registered for fingerprint "
                    f"{fingerprint.hex()[:16]}: {identity.block_bytes} B per block"
                )

    def _tokens_per_block(self, fingerprint: bytes) -> int:
        identity = self._models.get(fingerprint)
        return identity.tokens_per_block if identity else 0

    def record_hits(self, caller: Caller, fingerprint: bytes, asked: int, tiers: Sequence[str]) -> None:
        tpb = self._tokens_per_block(fingerprint)
        if tpb:
            with self._tokens_lock:
                self._lookup_tokens[caller.tenant] += asked * tpb
                self._hit_tokens[caller.tenant] += len(tiers) * tpb
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

    @override
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        def body(caller: Caller) -> pb.LookupResponse:
            scope = self._scope(caller, request.fingerprint, request.scope)
            keys = [BlockKey(k) for k in request.keys]
            ttl = request.pin_ttl_s if request.pin_ttl_s > 0 else None
            result = self.store.lookup(scope, keys, pin_ttl_s=ttl, owner=caller.tenant)
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
            deleted = self.store.delete(scope, keys)
            self._audit(caller, "delete", scope.namespace, scope.fingerprint, keys, deleted)
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
            removed = self.store.invalidate(namespace=namespace, fingerprint=fingerprint)
            log.warning(
                "tenant %s invalidated %d blocks (target %s)", caller.tenant, removed, request.tenant or "own"
            )
            self._audit(caller, "invalidate", namespace, fingerprint, (), removed)
            return pb.InvalidateResponse(removed=removed)

        return self._serve("Invalidate", context, body)

    @override
    def Demote(self, request: pb.DemoteRequest, context: grpc.ServicerContext) -> pb.DemoteResponse:
        def body(caller: Caller) -> pb.DemoteResponse:
            namespace = _target_namespace(caller, request.tenant, "demote")
            fingerprint = _optional_fingerprint(request.fingerprint) if request.fingerprint else None
            moved = self.store.demote(request.tier, namespace=namespace, fingerprint=fingerprint)
            log.info("tenant %s demoted %d blocks out of %s", caller.tenant, moved, request.tier)
            self._audit(caller, f"demote {request.tier}", namespace, fingerprint, (), moved)
            return pb.DemoteResponse(moved=moved)

        return self._serve("Demote", context, body)

    @override
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        def body(caller: Caller) -> pb.StatsResponse:
            stats = self.store.stats()
            if caller.admin:
                counters = dict(stats.counters)
                tenant_bytes = dict(stats.namespace_bytes)
                blocks = stats.blocks
                tiers = [_tier_stats(u, u.used_bytes, u.blocks, u.stored_bytes) for u in stats.tiers]
            else:
                # A tenant sees its own figures only: how full the tiers are with other tenants'
                # blocks is theirs to know, not its.
                counters = dict(stats.namespace_counters.get(caller.namespace, {}))
                tenant_bytes = {caller.namespace: stats.namespace_bytes.get(caller.namespace, 0)}
                own = self.store.tier_usage_of(caller.namespace)
                tiers = [_tier_stats(u, own[u.name][1], own[u.name][0], own[u.name][1]) for u in stats.tiers]
            usage = self.store.fingerprint_usage(None if caller.admin else caller.namespace)
            if not caller.admin:
                blocks = sum(n for n, _ in usage.values())
            return pb.StatsResponse(
                tiers=tiers,
                counters={k: v for k, v in counters.items() if v >= 0},
                tenant_bytes=tenant_bytes,
                absent_tiers=list(stats.absent_tiers),
                blocks=blocks,
                leases=stats.leases,
                tenant=caller.tenant,
                version=__version__,
                uptime_s=time.monotonic() - self._started,
                addresses=self.addresses,
                **self._token_figures(caller),
                fingerprints=self._fingerprint_stats(usage),
            )

        return self._serve("Stats", context, body)

    def _token_figures(self, caller: Caller) -> dict[str, int]:
        with self._tokens_lock:
            if caller.admin:
                return {"lookup_tokens": self._lookup_tokens.total(), "hit_tokens": self._hit_tokens.total()}
            return {
                "lookup_tokens": self._lookup_tokens[caller.tenant],
                "hit_tokens": self._hit_tokens[caller.tenant],
            }

    def _fingerprint_stats(self, usage: Mapping[Fingerprint, tuple[int, int]]) -> list[pb.FingerprintStats]:
        out = []
        for fingerprint, (blocks, nbytes) in sorted(usage.items()):
            identity = self._models.get(fingerprint)
            out.append(
                pb.FingerprintStats(
                    fingerprint=fingerprint,
                    model_id=identity.model_id if identity else "",
                    blocks=blocks,
                    bytes=nbytes,
                    tp_rank=identity.tp_rank if identity else 0,
                    tp_world_size=identity.tp_world_size if identity else 0,
                )
            )
        return out

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
            _abort(context, exc)
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
            for frames in self.plane.read(caller, scope, [BlockKey(k) for k in request.keys], encode_frame):
                yield from frames
        except KvStoreError as exc:
            _abort(context, exc)
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

    # ----------------------------------------------------------------- registration

    def add_to(self, server: grpc.Server) -> None:
        """Register every RPC on ``server``: the generated handlers, changed by ``_tuned``."""
        registrar = _Registrar(server)
        pb_grpc.add_KvStoreServicer_to_server(self, registrar)
        if not registrar.registered:
            raise RuntimeError("add_KvStoreServicer_to_server registered no method handlers")


class _Registrar:
    """The server the generated ``add_KvStoreServicer_to_server`` registers on: it hands the
    real one the generated handlers changed by ``_tuned``, as generic and as registered method
    handlers, as the generated code itself does."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server
        self.registered = False

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # built from the same handlers as the call below, which registers both kinds

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        tuned = {method: _tuned(method, handler) for method, handler in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, tuned),))
        self._server.add_registered_method_handlers(service, tuned)
        self.registered = True


def _tuned(method: str, handler: Any) -> Any:
    """A generated handler changed where the generated code cannot say what we need: streams of
    ``BlockFrame`` carry frames encoded and decoded by hand (``kvstore.frames``: no protobuf
    serializer copies block payloads), and a request that does not parse is refused as
    INVALID_ARGUMENT (gRPC itself would answer INTERNAL)."""
    declared = _SERVICE.methods_by_name[method]
    changes: dict[str, Any] = {}
    if declared.output_type is pb.BlockFrame.DESCRIPTOR:
        changes["response_serializer"] = None  # Get yields frames already encoded
    if declared.input_type is pb.BlockFrame.DESCRIPTOR:
        changes["request_deserializer"] = None  # Put decodes its frames itself
    elif not handler.request_streaming:
        behaviour = "unary_stream" if handler.response_streaming else "unary_unary"
        changes["request_deserializer"] = _parser(method, handler.request_deserializer)
        changes[behaviour] = _refuse_malformed(getattr(handler, behaviour))
    return handler._replace(**changes)


class _Malformed:
    """Stands in for a request protobuf could not parse, so that it is refused."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parser(method: str, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def tolerant(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            return _Malformed(f"malformed {method} request: {exc}")

    return tolerant


def _refuse_malformed(
    fn: Callable[[Any, grpc.ServicerContext], R],
) -> Callable[[Any, grpc.ServicerContext], R]:
    def handle(request: Any, context: grpc.ServicerContext) -> R:
        if isinstance(request, _Malformed):
            _abort(context, InvalidArgument(request.reason))
        return fn(request, context)

    return handle


def _target_namespace(caller: Caller, tenant: str, verb: str) -> str | None:
    """The namespace an admin-style call acts on: the caller's own by default; another tenant's,
    or every one (``"*"``, returned as None), for admins only."""
    if tenant and tenant != caller.tenant and not caller.admin:
        raise PermissionDenied(f"tenant {caller.tenant!r} may only {verb} its own blocks")
    if tenant == "*":
        return None
    return Caller(tenant or caller.tenant, False).namespace


def _tier_stats(usage: TierUsage, used_bytes: int, blocks: int, stored_bytes: int) -> pb.TierStats:
    return pb.TierStats(
        name=usage.name,
        capacity_bytes=usage.capacity_bytes,
        used_bytes=used_bytes,
        blocks=blocks,
        checksum_failures=usage.checksum_failures,
        stored_bytes=stored_bytes,
    )


def _fill(view: memoryview, payload: memoryview) -> None:
    if len(payload) != len(view):
        raise InvalidArgument(f"a frame of {len(payload)} B for a {len(view)} B slot")
    view[:] = payload


def _optional_fingerprint(raw: bytes) -> Fingerprint:
    if len(raw) != 32:
        raise InvalidArgument(f"fingerprints are 32 bytes, got {len(raw)}")
    return Fingerprint(raw)
