"""The gRPC transport: the channel every client has (its control calls go here whatever its
transport), and the data calls over it for a server without a data port, or a client made
with ``data_plane="grpc"``.

Unary calls go through the generated ``KvStoreStub``; the Get and Put streams are wired by
hand, since their frames are bytes encoded and decoded here (``kvstore.frames``), not messages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import xxhash

from kvstore.address import Address
from kvstore.client.dataport import block_misfit
from kvstore.client.inplace import copy_into
from kvstore.client.mapping import ArenaMapping
from kvstore.client.pool import ReceivePool
from kvstore.client.results import TIER_NAME, Lookup
from kvstore.client.translate import translated
from kvstore.client.transport import Blocks, Reserved, Resolved, read_resolved, write_reserved
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.frames import decode_frame, encode_frame
from kvstore.tls import ClientTls
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc

_MAX_MESSAGE_BYTES = 256 << 20
_SERVICE = pb.DESCRIPTOR.services_by_name["KvStore"]


class GrpcTransport:
    """``timeout_s()`` is what the next call may take (the client's timeout, or what is left
    of the calling thread's deadline)."""

    def __init__(
        self,
        address: Address,
        token: str | None,
        tls: ClientTls | None,
        timeout_s: Callable[[], float],
        mapping: ArenaMapping,
    ) -> None:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ]
        if tls is not None:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self.channel = grpc.secure_channel(address.target, tls.grpc_credentials(), options=options)
        else:
            self.channel = grpc.insecure_channel(address.target, options=options)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout_s = timeout_s
        self._mapping = mapping
        self._lock = threading.Lock()
        self._checksum_failures = 0
        self.stub = pb_grpc.KvStoreStub(self.channel)
        # By hand, not the stub's: the frames are bytes, encoded and decoded by kvstore.frames.
        self._get = self.channel.unary_stream(
            _method_path("Get"), request_serializer=pb.GetRequest.SerializeToString
        )
        self._put = self.channel.stream_unary(
            _method_path("Put"), response_deserializer=pb.PutResponse.FromString
        )

    def call(self, rpc: Any, request: Any) -> Any:
        """One unary call of the stub, ``rpc`` being its method (``self.stub.Lookup``)."""
        with translated("the call"):
            return rpc(request, metadata=self._metadata, timeout=self._timeout_s())

    def lookup(self, fingerprint: bytes, keys: Sequence[bytes], scope: str) -> int:
        return self.lookup_tiers(fingerprint, keys, 0.0, scope, False).hit_blocks

    def lookup_tiers(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float, scope: str, slots: bool
    ) -> Lookup:
        r: pb.LookupResponse = self.call(
            self.stub.Lookup,
            pb.LookupRequest(fingerprint=fingerprint, keys=list(keys), pin_ttl_s=pin_ttl_s, scope=scope),
        )
        return Lookup(r.hit_blocks, tuple(TIER_NAME[t] for t in r.tiers), r.lease_id)

    def release(self, lease_id: int, wait: bool) -> None:
        self.call(self.stub.Release, pb.ReleaseRequest(lease_id=lease_id))

    def lease_held(self, lease_id: int) -> bool:
        raise FailedPrecondition("lease_held needs the server's data port")

    def get(
        self, fingerprint: bytes, keys: Sequence[bytes], scope: str, pool: ReceivePool
    ) -> list[memoryview]:
        pool.begin()
        views: list[memoryview] = []
        for payload in self._stream(fingerprint, keys, scope):
            view = pool.take(len(payload))
            view[:] = payload
            views.append(view)
        return views

    def get_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str, exact: bool
    ) -> int:
        n = 0
        for payload in self._stream(fingerprint, keys, scope):
            nbytes = memoryview(outs[n]).nbytes if n < len(outs) else -1
            if nbytes < len(payload) or (exact and nbytes != len(payload)):
                raise InvalidArgument(block_misfit(n, len(payload), exact))
            copy_into(outs[n], payload)
            n += 1
        return n

    def heads(self, fingerprint: bytes, keys: Sequence[bytes], head_bytes: int, scope: str) -> list[bytes]:
        request = pb.HeadsRequest(
            fingerprint=fingerprint, keys=list(keys), head_bytes=head_bytes, scope=scope
        )
        r: pb.HeadsResponse = self.call(self.stub.Heads, request)
        return list(r.heads)

    def put(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> int:
        def frames() -> Iterator[bytes]:
            for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
                if i == 0:
                    yield encode_frame(key, block, fingerprint, parent or b"", scope)
                else:
                    yield encode_frame(key, block)

        with translated("the Put stream"):
            response = self._put(frames(), metadata=self._metadata, timeout=self._timeout_s())
        return int(response.stored)

    def resolve(self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float, scope: str) -> Resolved:
        r: pb.ResolveResponse = self.call(
            self.stub.Resolve,
            pb.ResolveRequest(fingerprint=fingerprint, keys=list(keys), ttl_s=ttl_s, scope=scope),
        )
        slots = [(s.offset, s.size_bytes) for s in r.slots]
        return r.arena_name, slots, tuple(TIER_NAME[t] for t in r.tiers), r.lease_id

    def reserve(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None,
        ttl_s: float,
        scope: str,
    ) -> Reserved:
        request = pb.ReserveRequest(
            fingerprint=fingerprint,
            keys=list(keys),
            sizes=list(sizes),
            parent=parent or b"",
            ttl_s=ttl_s,
            scope=scope,
        )
        r: pb.ReserveResponse = self.call(self.stub.Reserve, request)
        slots = [(s.offset, s.size_bytes) if s.present else None for s in r.slots]
        return r.arena_name, r.reservation_id, slots

    def commit(self, reservation_id: int, scope: str, checksums: Sequence[int] = ()) -> int:
        request = pb.CommitRequest(reservation_id=reservation_id, checksums=checksums)
        return int(self.call(self.stub.Commit, request).stored)

    def abort(self, reservation_id: int, scope: str) -> None:
        self.call(self.stub.Abort, pb.AbortRequest(reservation_id=reservation_id))

    def read_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str
    ) -> int:
        return read_resolved(self, self._mapping, fingerprint, keys, outs, scope)

    def write(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> tuple[int, list[int]]:
        return write_reserved(self, self._mapping, fingerprint, keys, blocks, parent, scope)

    def close(self) -> None:
        self.channel.close()

    @property
    def checksum_failures(self) -> int:
        """Blocks a Get stream brought that failed the checksum the node sent with them."""
        return self._checksum_failures

    def _stream(self, fingerprint: bytes, keys: Sequence[bytes], scope: str) -> Iterator[memoryview]:
        """The payloads of the present prefix, each checked against the checksum its frame
        carries: one that fails (changed on its way) ends the prefix there, a miss, counted, and
        the rest of the stream is cancelled."""
        request = pb.GetRequest(fingerprint=fingerprint, keys=list(keys), scope=scope)
        with translated("the Get stream"):
            call = self._get(request, metadata=self._metadata, timeout=self._timeout_s())
            for message in call:
                frame = decode_frame(message)
                if frame.checksum is not None and xxhash.xxh3_64_intdigest(frame.payload) != frame.checksum:
                    with self._lock:
                        self._checksum_failures += 1
                    call.cancel()
                    return
                yield frame.payload


def _method_path(name: str) -> str:
    """The path of a KvStore method; a KeyError at import when the proto has no such method."""
    return f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name[name].name}"
