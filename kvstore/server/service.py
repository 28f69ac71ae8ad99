"""The gRPC servicer of ``kvstore.v1.KvStore`` over a tiered store: its data calls (Lookup,
Exists, Release, the same-host Attach, Resolve, Reserve, Commit and Abort, and the Get and Put
streams), on the control calls (``kvstore.server.control_calls``) and the plumbing every call
goes through (``kvstore.server.servicer``: draining, authentication, per-tenant places, errors
as statuses).

The servicer implements the generated ``KvStoreServicer`` (a method renamed in the proto fails
the type check here: ``@override``) and is registered by ``kvstore.server.handlers.register``.
The Get and Put streams carry hand-written frames (``kvstore.frames``) that no protobuf
serializer touches: Get serves blocks straight out of the arena slots it pinned, Put hands
received payloads to the store without decoding them; both go through the data plane
(``kvstore.server.dataplane``), as the raw data port does."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc

from kvstore.errors import FailedPrecondition, InvalidArgument, KvStoreError
from kvstore.frames import decode_frame, encode_frame
from kvstore.keys import BlockKey
from kvstore.server.auth import Caller
from kvstore.server.control_calls import ControlCalls
from kvstore.server.dataplane import BATCH_BLOCKS
from kvstore.server.handlers import abort
from kvstore.server.servicer import override
from kvstore.store import Scope
from kvstore.wire import MAX_HEAD_BYTES
from proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)

TIER_ENUM = {"hbm": pb.TIER_HBM, "dram": pb.TIER_DRAM, "nvme": pb.TIER_NVME, "remote": pb.TIER_REMOTE}
PUT_BUFFER_BYTES = 32 << 20  # a Put stream's frames buffered before they go to the data plane


class KvStoreService(ControlCalls):
    """See the module docstring; built as ``Servicer`` says."""

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
    def Heads(self, request: pb.HeadsRequest, context: grpc.ServicerContext) -> pb.HeadsResponse:
        def body(caller: Caller) -> pb.HeadsResponse:
            if request.head_bytes > MAX_HEAD_BYTES:
                raise InvalidArgument(f"Heads asks at most {MAX_HEAD_BYTES} bytes of a block")
            scope = self._scope(caller, request.fingerprint, request.scope)
            keys = [BlockKey(k) for k in request.keys]
            return pb.HeadsResponse(heads=self.plane.heads(scope, keys, request.head_bytes))

        return self._serve("Heads", context, body)

    @override
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        def body(caller: Caller) -> pb.ReleaseResponse:
            self.plane.release(caller, request.lease_id)
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
            stored = self.plane.commit(caller, request.reservation_id, request.checksums)
            if self.metrics is not None:
                self.metrics.store_seconds.labels("commit").observe(time.perf_counter() - start)
            return pb.CommitResponse(stored=stored)

        return self._serve("Commit", context, body)

    @override
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        def body(caller: Caller) -> pb.AbortResponse:
            self.plane.abort(caller, request.reservation_id)
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


def _fill(view: memoryview, payload: memoryview) -> None:
    if len(payload) != len(view):
        raise InvalidArgument(f"a frame of {len(payload)} B for a {len(view)} B slot")
    view[:] = payload


def _frame(key: bytes, payload: memoryview, checksum: int) -> bytes:
    """A Get stream's frame, with the block's checksum for the receiver to check."""
    return encode_frame(key, payload, checksum=checksum)
