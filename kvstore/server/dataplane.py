"""The data plane both transports share: the gRPC Get/Put streams and the raw data port are thin
adapters over this, so a request has the same outcome, status and metrics whichever carries it.

    lookup(caller, scope, keys, pin_ttl_s)     -> LookupResult; counts hits
    resolve(caller, scope, keys, ttl_s)        -> Resolved (same host: slots to read in place)
    release(caller, lease_id)
    reserve(caller, scope, keys, sizes, parent, ttl_s) -> Reservation (same host: slots to fill)
    commit(caller, reservation_id, checksums) -> blocks stored;  abort(caller, reservation_id)
    heads(scope, keys, n)                      -> the first n bytes of each block of the present
                                                  prefix: nothing promoted, no hit recorded
    read(caller, scope, keys, each)            -> yields, per batch of BATCH_BLOCKS, the results
                                                  of ``each(key, slot view, its xxh3-64)`` for the present
                                                  prefix; the batch is pinned while ``each`` runs
                                                  and released before the list is yielded, so a
                                                  slow consumer never holds a pin; a block
                                                  whose arena bytes changed since they were
                                                  checksummed ends the prefix (counted, deleted)
    write(caller, scope, parent, keys, sizes, fill) -> blocks stored; ``fill(i, view)`` writes
                                                  block i's bytes into its reserved arena
                                                  slot, hashed there; the commit carries them

Every block lands in the arena (`dram`), reserved in batches so that one request never needs the
whole arena; a block the arena cannot take (full of pinned blocks) is filled into a buffer and
stored through ``put``, which places it lower. No slot is touched within LEASE_MARGIN_S of its
lease's or reservation's end (the transports' request deadlines end well before): a transfer that
loses its lease fails with LEASE_EXPIRED and touches nothing more. Sizes are checked against the
registered layout and ``store.max_block_bytes`` before anything is reserved.

Thread-safe: the store locks; the plane keeps no state of its own per request.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import xxhash

from kvstore.errors import FailedPrecondition, KvStoreError, LeaseExpired
from kvstore.keys import BlockKey
from kvstore.server.auth import Caller
from kvstore.store import LookupResult, Reservation, Resolved, Scope, TieredStore, tier_key
from kvstore.store.writes import PACE_SLICE_BYTES, slices
from tiers import InPlaceTier

BATCH_BLOCKS = 32  # pinned or reserved per step of a transfer
WRITE_STEP_BYTES = PACE_SLICE_BYTES  # and, for a write, about this many bytes at most
LEASE_S = 60.0  # a transfer's pins and reservations; the transports' deadlines end well inside
LEASE_MARGIN_S = 5.0  # no slot is touched this close to its lease's end

T = TypeVar("T")


def check_live(expires_at_s: float, what: str) -> None:
    if time.monotonic() >= expires_at_s - LEASE_MARGIN_S:
        raise LeaseExpired(f"the {what} ran out mid-transfer; nothing more is read or written")


class DataPlane:
    def __init__(
        self,
        store: TieredStore,
        check_sizes: Callable[[bytes, Sequence[int]], None],
        record_hits: Callable[[Caller, bytes, int, Sequence[str]], None],
    ) -> None:
        self.store = store
        self._check_sizes = check_sizes
        self._record_hits = record_hits

    def arena(self) -> InPlaceTier:
        arena = self.store.arena
        if arena is None:
            raise FailedPrecondition("this server has no dram arena to move blocks through")
        return arena

    def lookup(
        self,
        caller: Caller,
        scope: Scope,
        keys: Sequence[BlockKey],
        pin_ttl_s: float | None,
        slots: bool = False,
    ) -> LookupResult:
        result = self.store.lookup(scope, keys, pin_ttl_s=pin_ttl_s, owner=caller.tenant, slots=slots)
        self._record_hits(caller, scope.fingerprint, len(keys), result.tiers)
        return result

    def resolve(
        self, caller: Caller, scope: Scope, keys: Sequence[BlockKey], ttl_s: float | None
    ) -> Resolved:
        self.arena()
        resolved = self.store.resolve(scope, keys, ttl_s, owner=caller.tenant)
        self._record_hits(caller, scope.fingerprint, len(keys), resolved.tiers)
        return resolved

    def release(self, caller: Caller, lease_id: int) -> None:
        self.store.release(lease_id, owner=caller.tenant)

    def lease_held(self, caller: Caller, lease_id: int) -> bool:
        return self.store.lease_held(lease_id, owner=caller.tenant)

    def reserve(
        self,
        caller: Caller,
        scope: Scope,
        keys: Sequence[BlockKey],
        sizes: Sequence[int],
        parent: BlockKey | None,
        ttl_s: float | None,
    ) -> Reservation:
        self.arena()
        self._check_sizes(scope.fingerprint, sizes)
        return self.store.reserve(scope, keys, sizes, parent=parent, ttl_s=ttl_s, owner=caller.tenant)

    def commit(self, caller: Caller, reservation_id: int, checksums: Sequence[int] = ()) -> int:
        return self.store.commit(reservation_id, owner=caller.tenant, checksums=checksums)

    def abort(self, caller: Caller, reservation_id: int) -> None:
        self.store.abort(reservation_id, owner=caller.tenant)

    def heads(self, scope: Scope, keys: Sequence[BlockKey], n: int) -> list[bytes]:
        """The first ``n`` bytes of each block of the present prefix (``TieredStore.heads``): a
        sidecar's lookup checking headers; no hit is recorded, nothing promoted."""
        return self.store.heads(scope, keys, n)

    def read(
        self,
        caller: Caller,
        scope: Scope,
        keys: Sequence[BlockKey],
        each: Callable[[BlockKey, memoryview, int], T],
    ) -> Iterator[list[T]]:
        arena = self.arena()
        served: list[str] = []
        try:
            for first in range(0, len(keys), BATCH_BLOCKS):
                batch = keys[first : first + BATCH_BLOCKS]
                resolved = self.store.resolve(scope, batch, LEASE_S, owner=caller.tenant)
                changed: BlockKey | None = None
                try:
                    results = []
                    for key, slot in zip(batch, resolved.slots, strict=False):
                        if resolved.lease is not None:
                            check_live(resolved.lease.expires_at_s, "lease")
                        view = arena.arena.view[slot.offset : slot.offset + slot.size_bytes]
                        # the bytes leave the process: they must be the block's (tiers.slab)
                        checksum = arena.verified_checksum(tier_key(scope, key), slot, view)
                        if checksum is None:
                            changed = key
                            break
                        results.append(each(key, view, checksum))
                finally:
                    if resolved.lease is not None:
                        with contextlib.suppress(LeaseExpired):  # expired: nothing is held
                            self.store.release(resolved.lease.lease_id, owner=caller.tenant)
                served.extend(resolved.tiers[: len(results)])
                if changed is not None:  # a miss from there on (a prefix is served), and deleted
                    self.store.delete(scope, [changed])
                yield results
                if len(results) < len(batch):
                    return
        finally:
            self._record_hits(caller, scope.fingerprint, len(keys), served)

    def write(
        self,
        caller: Caller,
        scope: Scope,
        parent: BlockKey | None,
        keys: Sequence[BlockKey],
        sizes: Sequence[int],
        fill: Callable[[int, memoryview], None],
    ) -> int:
        self._check_sizes(scope.fingerprint, sizes)
        arena = self.arena()
        owner = caller.tenant
        stored = 0
        # A step holds at most BATCH_BLOCKS and about WRITE_STEP_BYTES: each reservation is
        # paced for the disk on its own (``Placement.pace``), so that a large put still has
        # every victim demoted and none dropped when the disk is behind.
        for first, last in slices(sizes, WRITE_STEP_BYTES, BATCH_BLOCKS):
            reservation = self.store.reserve(
                scope, keys[first:last], sizes[first:last], parent, LEASE_S, owner
            )
            aside: list[tuple[BlockKey, BlockKey | None, bytearray]] = []
            checksums: list[int] = []  # of each filled slot, in order: the commit carries them
            try:
                for i, (slot, size) in enumerate(zip(reservation.slots, sizes[first:last], strict=True)):
                    if slot is not None:
                        check_live(reservation.expires_at_s, "reservation")
                        view = arena.arena.view[slot.offset : slot.offset + size]
                        fill(first + i, view)
                        # hashed while the bytes just received are warm, so that the block
                        # carries its checksum from its commit (tiers.slab)
                        checksums.append(xxhash.xxh3_64_intdigest(view))
                    else:
                        data = bytearray(size)
                        fill(first + i, memoryview(data))
                        aside.append((keys[first + i], keys[first + i - 1] if first + i else parent, data))
                check_live(reservation.expires_at_s, "reservation")  # every byte in before it ended
            except BaseException:
                with contextlib.suppress(KvStoreError):  # expired meanwhile: nothing to give back
                    self.store.abort(reservation.reservation_id, owner=owner)
                raise
            stored += self.store.commit(reservation.reservation_id, owner=owner, checksums=checksums)
            for run in _chained(aside):  # one put a run: it waits for the disk once, if at all
                stored += self.store.put(scope, [k for k, _, _ in run], [d for _, _, d in run], run[0][1])
            parent = keys[last - 1]
        return stored


def _chained(
    aside: Sequence[tuple[BlockKey, BlockKey | None, bytearray]],
) -> Iterator[Sequence[tuple[BlockKey, BlockKey | None, bytearray]]]:
    """The (key, parent, bytes) of ``aside`` in runs, each block's parent the key before it."""
    first = 0
    for i in range(1, len(aside) + 1):
        if i == len(aside) or aside[i][1] != aside[i - 1][0]:
            yield aside[first:i]
            first = i
