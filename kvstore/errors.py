"""The one error hierarchy of kvstore. Each class names the gRPC status code it maps to; the
server translates with ``status_code_name`` in one place, the client raises the same classes.

    KvStoreError
    ├── InvalidArgument        bad key length, block size not matching the layout, bad frame
    ├── Unauthenticated        no or unknown bearer token
    ├── PermissionDenied       a scope the tenant was not granted
    ├── NotFound
    │   ├── LeaseNotFound      a lease id that was never granted, or already released
    │   └── LeaseExpired       a lease that ran out before it was released
    ├── ResourceExhausted
    │   ├── QuotaExceeded      the tenant's byte quota is full of blocks that cannot go
    │   └── StoreFull          no tier can take the block (everything is pinned)
    ├── FailedPrecondition     a call out of order (commit without reserve)
    └── Unavailable            the server is draining or a tier's medium is gone, or unreachable
        └── DeadlineExceeded   no answer within the call's deadline (the server may be hung)

Errors raised by ``tiers`` are translated into these by the tiered store, nowhere else.
"""

from __future__ import annotations


class KvStoreError(Exception):
    status_code_name = "UNKNOWN"


class InvalidArgument(KvStoreError):
    status_code_name = "INVALID_ARGUMENT"


class Unauthenticated(KvStoreError):
    status_code_name = "UNAUTHENTICATED"


class PermissionDenied(KvStoreError):
    status_code_name = "PERMISSION_DENIED"


class NotFound(KvStoreError):
    status_code_name = "NOT_FOUND"


class LeaseNotFound(NotFound):
    pass


class LeaseExpired(NotFound):
    pass


class ResourceExhausted(KvStoreError):
    status_code_name = "RESOURCE_EXHAUSTED"


class QuotaExceeded(ResourceExhausted):
    pass


class StoreFull(ResourceExhausted):
    stored = 0  # blocks of the call stored before room ran out (a partial write says how many)


class FailedPrecondition(KvStoreError):
    status_code_name = "FAILED_PRECONDITION"


class Unavailable(KvStoreError):
    status_code_name = "UNAVAILABLE"


class DeadlineExceeded(Unavailable):
    """A subclass of Unavailable, so callers that retry elsewhere on Unavailable keep doing so;
    callers that must not wait twice (a retry costs another full deadline) catch it first."""

    status_code_name = "DEADLINE_EXCEEDED"


_BY_STATUS: dict[str, type[KvStoreError]] = {
    cls.status_code_name: cls
    for cls in (
        InvalidArgument,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        ResourceExhausted,
        FailedPrecondition,
        Unavailable,
    )
}


def error_for_status(code_name: str, message: str) -> KvStoreError:
    """The exception a client raises for a gRPC status (the inverse of status_code_name)."""
    if code_name == "NOT_FOUND" and "expired" in message:
        return LeaseExpired(message)
    if code_name == "DEADLINE_EXCEEDED":
        return DeadlineExceeded(f"deadline exceeded: {message}")
    return _BY_STATUS.get(code_name, KvStoreError)(message)
