"""Status codes: the one table between ``kvstore.errors`` and the codes both transports carry,
and the one translation each way.

    server:  status_of(error)                  -> (Status, detail)   what an error is sent as
    client:  error_for(code, message, detail)  -> KvStoreError       what a status is raised as

``Status`` holds gRPC's code numbers: gRPC sends them as its own status, the data port writes
them as one byte. Beside its code and message a status carries a *detail*: the name of the
error's class (its nearest class in ``kvstore.errors``), so classes that share a code come back
as the class the server raised (``LeaseNotFound`` and ``LeaseExpired`` are both NOT_FOUND).
gRPC carries it as trailing metadata ``kvstore-error: <name>`` (``DETAIL_METADATA``); the data
port in its status frame (see ``kvstore.server.dataport``). A detail that is missing, unknown, or names
a class of another code is ignored: it refines the code, never contradicts it.

Pure functions of their arguments; no import of gRPC or of the transports.
"""

from __future__ import annotations

from enum import IntEnum

from kvstore import errors
from kvstore.errors import KvStoreError

DETAIL_METADATA = "kvstore-error"  # the gRPC trailing metadata key of the detail


class Status(IntEnum):
    """gRPC's status codes, by their numbers on the wire."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


# The table. A class not listed has the code of its nearest listed ancestor.
CODES: dict[type[KvStoreError], Status] = {
    errors.KvStoreError: Status.UNKNOWN,
    errors.InvalidArgument: Status.INVALID_ARGUMENT,
    errors.Unauthenticated: Status.UNAUTHENTICATED,
    errors.PermissionDenied: Status.PERMISSION_DENIED,
    errors.NotFound: Status.NOT_FOUND,
    errors.ResourceExhausted: Status.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: Status.FAILED_PRECONDITION,
    errors.Unavailable: Status.UNAVAILABLE,
    errors.DeadlineExceeded: Status.DEADLINE_EXCEEDED,
}
_BY_CODE: dict[int, type[KvStoreError]] = {status: cls for cls, status in CODES.items()}
_BY_NAME: dict[str, type[KvStoreError]] = {name: getattr(errors, name) for name in errors.__all__}


def status_of(error: KvStoreError) -> tuple[Status, str]:
    """The code and detail ``error`` is sent as."""
    public = next(cls for cls in type(error).__mro__ if cls.__name__ in _BY_NAME)
    return _code_of(public), public.__name__


def error_for(code: int, message: str, detail: str = "") -> KvStoreError:
    """The exception a client raises for a status other than OK."""
    cls = base = _BY_CODE.get(code, KvStoreError)
    named = _BY_NAME.get(detail)
    if named is not None and issubclass(named, base) and _code_of(named) == code:
        cls = named
    if code == Status.DEADLINE_EXCEEDED:
        message = f"deadline exceeded: {message}"
    return cls(message)


def _code_of(cls: type[KvStoreError]) -> Status:
    return next(CODES[ancestor] for ancestor in cls.__mro__ if ancestor in CODES)
