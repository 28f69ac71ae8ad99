"""The one error hierarchy of kvstore, with the gRPC status code each class travels as (the
table itself is ``kvstore.status``: the server and the client both translate through it, and
nowhere else).

    KvStoreError               UNKNOWN
    ├── InvalidArgument        INVALID_ARGUMENT     bad key length, block size not matching the layout, bad frame
    ├── Unauthenticated        UNAUTHENTICATED      no or unknown bearer token
    ├── PermissionDenied       PERMISSION_DENIED    a scope the tenant was not granted
    ├── NotFound               NOT_FOUND
    │   ├── LeaseNotFound                           a lease id that was never granted, or already released
    │   └── LeaseExpired                            a lease that ran out before it was released
    ├── ResourceExhausted      RESOURCE_EXHAUSTED
    │   ├── QuotaExceeded                           the tenant's byte quota is full of blocks that cannot go
    │   └── StoreFull                               no tier can take the block (everything is pinned)
    ├── FailedPrecondition     FAILED_PRECONDITION  a call out of order (commit without reserve)
    │   └── AuditNotWritten                         an admin action refused: its audit record could not be written
    └── Unavailable            UNAVAILABLE          the server is draining or a tier's medium is gone, or unreachable
        └── DeadlineExceeded   DEADLINE_EXCEEDED    no answer within the call's deadline (the server may be hung)

A subclass shares its parent's code; the status carries the class's name beside the code, so the
client raises the very class the server did (``LeaseExpired``, not just ``NotFound``).

Errors raised by ``tiers`` are translated into these by the tiered store, nowhere else; what the
client's lower layers raise (gRPC, sockets, the arena's mapping) is translated by the client.
"""

from __future__ import annotations

__all__ = [
    "AuditNotWritten",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "KvStoreError",
    "LeaseExpired",
    "LeaseNotFound",
    "NotFound",
    "PermissionDenied",
    "QuotaExceeded",
    "ResourceExhausted",
    "StoreFull",
    "Unauthenticated",
    "Unavailable",
]


class KvStoreError(Exception):
    pass


class InvalidArgument(KvStoreError):
    pass


class Unauthenticated(KvStoreError):
    pass


class PermissionDenied(KvStoreError):
    pass


class NotFound(KvStoreError):
    pass


class LeaseNotFound(NotFound):
    pass


class LeaseExpired(NotFound):
    pass


class ResourceExhausted(KvStoreError):
    pass


class QuotaExceeded(ResourceExhausted):
    pass


class StoreFull(ResourceExhausted):
    stored = 0  # blocks of the call stored before room ran out (a partial write says how many)


class FailedPrecondition(KvStoreError):
    pass


class AuditNotWritten(FailedPrecondition):
    """A delete, invalidation, demotion or shred refused, not done: its audit record could not
    be written (a full or read-only file system under ``server.audit_log``). Retrying helps only
    once an operator has made room there."""


class Unavailable(KvStoreError):
    pass


class DeadlineExceeded(Unavailable):
    """A subclass of Unavailable, so callers that retry elsewhere on Unavailable keep doing so;
    callers that must not wait twice (a retry costs another full deadline) catch it first."""
