"""How ``KvStoreService`` meets gRPC: errors sent as statuses, and its handlers registered.

``abort`` is the one place a ``KvStoreError`` becomes a gRPC status: the code and detail of
``kvstore.status``, the detail also as trailing metadata (``kvstore-error``) so that the client
raises the same class again.

``register`` puts the servicer on a server through the generated
``add_KvStoreServicer_to_server``, so the proto names every method, and changes each generated
handler where the generated code cannot say what we need (``tuned``): the Get and Put streams
carry ``BlockFrame``s encoded and decoded by hand (``kvstore.frames``: no protobuf serializer
copies block payloads), and a request protobuf cannot parse is refused as INVALID_ARGUMENT
(gRPC itself would answer INTERNAL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import InvalidArgument, KvStoreError
from kvstore.status import DETAIL_METADATA, status_of
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc

R = TypeVar("R")
_SERVICE = pb.DESCRIPTOR.services_by_name["KvStore"]
SERVICE_NAME = _SERVICE.full_name


def abort(context: grpc.ServicerContext, error: KvStoreError) -> NoReturn:
    """End the call with ``error``'s status."""
    code, detail = status_of(error)
    context.set_trailing_metadata(((DETAIL_METADATA, detail),))
    context.abort(grpc.StatusCode[code.name], str(error))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def register(servicer: pb_grpc.KvStoreServicer, server: grpc.Server) -> None:
    """Register every RPC of ``servicer`` on ``server``: the generated handlers, ``tuned``."""
    registrar = _Registrar(server)
    pb_grpc.add_KvStoreServicer_to_server(servicer, registrar)
    if not registrar.registered:
        raise RuntimeError("add_KvStoreServicer_to_server registered no method handlers")


class _Registrar:
    """The server the generated ``add_KvStoreServicer_to_server`` registers on: it hands the
    real one the generated handlers changed by ``tuned``, as generic and as registered method
    handlers, as the generated code itself does."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server
        self.registered = False

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # built from the same handlers as the call below, which registers both kinds

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        changed = {method: tuned(method, handler) for method, handler in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, changed),))
        self._server.add_registered_method_handlers(service, changed)
        self.registered = True


def tuned(method: str, handler: Any) -> Any:
    """The generated ``handler`` of ``method``, with hand-made frames and tolerant parsing."""
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
            abort(context, InvalidArgument(request.reason))
        return fn(request, context)

    return handle
