"""The client's one translation of what the layers below raise into ``kvstore.errors``.

A gRPC status becomes the server's own class (its detail read from the trailing metadata,
``kvstore.status``); a timeout becomes ``DeadlineExceeded``; any other socket or file failure
(connecting, a data-port stream cut mid-message, mapping the arena) becomes ``Unavailable``.
Every public method of ``Client`` runs what can fail inside ``translated``: nothing else in the
client catches ``grpc.RpcError``, ``TimeoutError`` or ``OSError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from kvstore.errors import DeadlineExceeded, KvStoreError, Unavailable
from kvstore.status import DETAIL_METADATA, error_for


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Run the block; re-raise a lower layer's failure as a ``kvstore.errors`` class, with
    ``what`` (``"the Put stream"``) saying which step failed."""
    try:
        yield
    except grpc.RpcError as exc:
        raise rpc_error(exc) from None
    except TimeoutError as exc:
        raise DeadlineExceeded(f"{what} timed out: {exc}") from None
    except OSError as exc:
        raise Unavailable(f"{what} failed: {exc}") from None


def rpc_error(exc: grpc.RpcError) -> KvStoreError:
    """The ``kvstore.errors`` class of a failed gRPC call."""
    if not isinstance(exc, grpc.Call):  # no status at all: the channel itself failed
        return Unavailable(str(exc))
    code = exc.code()
    detail = dict(exc.trailing_metadata() or ()).get(DETAIL_METADATA, "")
    return error_for(code.value[0], exc.details() or code.name, detail)
