"""The control calls of ``kvstore.v1.KvStore``: Register (a model's identity and block size),
Delete, Invalidate, Demote and Shred (what a tenant, or an admin for any tenant, removes or moves;
each written to the audit log before it takes effect), Stats (built in ``kvstore.server.stats``)
and ServerInfo. The data calls build on these in ``kvstore.server.service``.
"""

from __future__ import annotations

import logging
import time

import grpc

from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.keys import BlockKey, Fingerprint, ModelIdentity
from kvstore.server.auth import Caller, tenant_namespace
from kvstore.server.servicer import Servicer, override
from kvstore.server.stats import stats_response
from proto import kvstore_pb2 as pb

log = logging.getLogger("kvstore.server.service")


class ControlCalls(Servicer):
    """See the module docstring."""

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


def _target_namespace(caller: Caller, tenant: str, verb: str) -> str | None:
    """The namespace an admin-style call acts on: the caller's own by default; another tenant's,
    or every one (``"*"``, returned as None), for admins only."""
    if tenant and tenant != caller.tenant and not caller.admin:
        raise PermissionDenied(f"tenant {caller.tenant!r} may only {verb} its own blocks")
    if tenant == "*":
        return None
    return Caller(tenant or caller.tenant, False).namespace


def _optional_fingerprint(raw: bytes) -> Fingerprint:
    if len(raw) != 32:
        raise InvalidArgument(f"fingerprints are 32 bytes, got {len(raw)}")
    return Fingerprint(raw)
