"""Leases: pins that expire on their own.

A lease holds a set of block ids for ``ttl_s`` seconds, on behalf of an ``owner`` (the
tenant that asked; only it may release the lease, anyone else is told it does not exist). ``release`` ends it early; an expired
lease is collected by ``expire`` (the store calls it before any eviction and on every pin or
release). Ids count up from a random start, so an id from before a restart names no lease after
it (a reader checking ``held`` after copying in place must never find another's lease).
Releasing twice raises LeaseNotFound; releasing after expiry raises LeaseExpired (the table
remembers recently expired ids to tell the two apart).

Not thread-safe: the tiered store calls it under its own lock.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.errors import InvalidArgument, LeaseExpired, LeaseNotFound

T = TypeVar("T", bound=Hashable)

_REMEMBER_EXPIRED = 65536


@dataclass(frozen=True)
class Lease:
    lease_id: int
    expires_at_s: float
    blocks: int


class LeaseTable(Generic[T]):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._ids = itertools.count(1 + secrets.randbelow(1 << 52))  # JSON-safe
        self._held: dict[int, tuple[float, tuple[T, ...], str]] = {}
        self._expiry: list[tuple[float, int]] = []
        self._expired: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def grant(self, items: Sequence[T], ttl_s: float, owner: str = "") -> Lease:
        if not ttl_s > 0:
            raise InvalidArgument(f"lease ttl must be positive seconds, got {ttl_s}")
        lease_id = next(self._ids)
        expires = self._clock() + ttl_s
        self._held[lease_id] = (expires, tuple(items), owner)
        heapq.heappush(self._expiry, (expires, lease_id))
        return Lease(lease_id, expires, len(items))

    def release(self, lease_id: int, owner: str = "") -> tuple[T, ...]:
        """The items the lease held; raises LeaseNotFound or LeaseExpired."""
        held = self._held.get(lease_id)
        if held is not None and held[2] != owner:
            held = None  # someone else's lease: indistinguishable from no lease
        else:
            self._held.pop(lease_id, None)
        if held is None:
            if lease_id in self._expired:
                raise LeaseExpired(f"lease {lease_id} expired before it was released")
            raise LeaseNotFound(f"lease {lease_id} is unknown or already released")
        return held[1]

    def held(self, lease_id: int, owner: str = "") -> bool:
        """Whether ``owner`` holds ``lease_id`` (granted, neither released nor collected)."""
        held = self._held.get(lease_id)
        return held is not None and held[2] == owner

    def expire(self) -> list[tuple[T, ...]]:
        """Collect every lease past its expiry; returns what each one held."""
        now = self._clock()
        out: list[tuple[T, ...]] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            held = self._held.pop(lease_id, None)
            if held is None:
                continue
            out.append(held[1])
            self._expired[lease_id] = None
            if len(self._expired) > _REMEMBER_EXPIRED:
                self._expired.popitem(last=False)
        return out
