"""Fleet-wide invalidation: marks in the remote tier that every sidecar polls.

An invalidation says "every block of scope S born before T is dead", S being a namespace (all
of it) or one fingerprint in it. The sidecar (or shared node) that takes it removes what it
holds and what the remote tier holds, then writes a *mark* for S: a tiny value (T, 8 bytes)
under a reserved key of S's namespace in the remote tier (fingerprint ``MARK_FINGERPRINT``), so
a shared kvstore node keeps it under the same tenant token as the tenant's blocks, and Redis or
Mooncake under the same key prefix. "Everything" and "a fingerprint in every namespace" are
written as marks of the namespace ``FLEET`` (a ``t/*`` token on a kvstore node), which every
sidecar reads for every namespace it holds, and as one mark per namespace the issuer knows.
Every invalidation is also numbered in a ledger (``kvstore.store.ledger``), so a sidecar that
finds a mark lost drops its local copies of that namespace rather than serve them.

A shared kvstore node that takes an invalidation itself (an operator's, not a sidecar's) writes
the marks into its own store, as blocks of the same keys, for the namespaces whose marks
sidecars have asked it about (so a server no fleet polls stores none).

Every sidecar reads the marks of the scopes it has seen (those it holds or was asked about) at
start, before it serves, and then every ``poll_s`` (one batched ``contains`` and a ``get_many``
of the marks present: one or two round trips per node). A mark newer than the one it applied
dooms the local blocks of S born at or before T (the birth time every block keeps in its
metadata, so a restart changes nothing), and deletes their remote keys again: a copy this
sidecar's write-behind queue sent after the issuer's delete goes too. Until then:

- write-behind skips blocks born at or before a known mark of their scope;
- every remote read (``RemoteCalls.fill``) refuses a copy born at or before the scope's mark
  (the birth time each remote value's header carries): one a lagging sidecar sent late is a
  miss, deleted there.

Blocks born after T are kept: a scope is usable again at once. Clocks are wall clocks, so the
fleet's clocks must agree to well under a second (NTP); a sidecar whose clock runs ahead keeps
blocks it stored in the skew before T. A mark is a block like any other: a remote tier that
evicts it (Redis ``maxmemory`` under an ``allkeys-*`` policy; a shared node exempts marks from
eviction) forgets it; the ledger makes that a loss the sidecars see, and fail closed on. An
unreachable remote reads as no new mark: the sidecar serves its local
blocks, logs, and catches up when the remote answers; marks it could not write when it issued
them are kept and written again at each poll until the remote takes them.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvstore.keys import BlockKey, Fingerprint
from kvstore.store.counts import Counts
from kvstore.store.index import BlockIndex
from kvstore.store.ledger import FLEET, Applied, Ledger, Outcome, read_values
from kvstore.store.model import MARK_FINGERPRINT, Scope, tier_key
from kvstore.store.parts import Locked
from kvstore.store.pins import Pins
from tiers import BytesLike, TierKey
from tiers.remote import RemoteBlock, RemoteTier

log = logging.getLogger("kvstore.store")

__all__ = [  # MARK_FINGERPRINT lives in model.py (eviction exempts it); the rest of the fleet asks here
    "FLEET",
    "MARK_FINGERPRINT",
    "FleetInvalidations",
    "Target",
    "mark_key",
    "mark_name",
    "mark_value",
    "read_mark",
]
_T = struct.Struct("<d")

Target = tuple[str, Fingerprint | None]  # (namespace, one fingerprint of it or all of it)


def mark_name(fingerprint: Fingerprint | None, fleet: bool = False) -> BlockKey:
    """The block key of the mark of one fingerprint, or (None) of a whole namespace; ``fleet``:
    of every namespace (named apart: a kvstore node may file ``FLEET`` under a tenant's token)."""
    label = b"kvstore fleet mark:" if fleet else b"kvstore mark:"
    return BlockKey(hashlib.blake2b(label + (fingerprint or b"*"), digest_size=32).digest())


def mark_key(namespace: str, fingerprint: Fingerprint | None) -> TierKey:
    return tier_key(Scope(namespace, MARK_FINGERPRINT), mark_name(fingerprint, namespace == FLEET))


def mark_value(at_s: float) -> bytes:
    return _T.pack(at_s)


def read_mark(value: BytesLike | None) -> float:
    view = memoryview(value).cast("B") if value is not None else None
    return _T.unpack(view)[0] if view is not None and len(view) == _T.size else 0.0


class FleetInvalidations:
    """See the module docstring. ``poll`` runs on its own thread; the rest under any lock but
    the store's, except ``dead_before`` (a dict read, called under it)."""

    def __init__(
        self,
        tier: RemoteTier,
        lock: Locked,
        counts: Counts,
        index: BlockIndex,
        pins: Pins,
        poll_s: float,
        record: Path | None = None,
    ) -> None:
        self._tier = tier
        self._ledger = Ledger(tier, Applied(record))  # record: where this sidecar stopped, kept
        self._said_fleet = False  # the warning that FLEET is not carried, logged once
        self._store_lock = lock
        self._counts = counts
        self._index = index
        self._pins = pins
        self.poll_s = poll_s
        self._known: dict[Target, float] = {}  # the newest mark seen or written per target
        self._lock = threading.Lock()  # for _unsent: issuing threads and the poll's
        self._unsent: dict[Target, float] = {}  # marks the remote did not take: sent again each poll
        self._unnumbered: dict[Target, float] = {}  # ledger entries not taken: claimed again each poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Catch up (before the store serves), then poll every ``poll_s`` on a thread."""
        self.poll(starting=True)
        if self.poll_s > 0:
            self._thread = threading.Thread(target=self._run, name="kvstore-invalidations", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop polling, after a last poll: the ledgers of namespaces first seen since the last
        one are recorded, so a restart does not take them for lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            self.poll()
        except Exception:  # closing goes on
            log.exception("fleet invalidation: the last poll failed")

    # ----------------------------------------------------------------- issuing

    def post(
        self, namespace: str | None, fingerprint: Fingerprint | None, known: Iterable[str], at_s: float
    ) -> None:
        """Write the marks of an invalidation taken here at ``at_s`` (a newer one stays) and
        number it: of ``namespace``, or (None) of every namespace: ``FLEET``'s, and each of
        ``known``'s mark (the namespaces' ledgers instead of ``FLEET``'s where it is not carried)."""
        spans = [namespace] if namespace is not None else sorted(known)
        wanted = {(ns, fingerprint) for ns in spans}
        if namespace is None and self._fleet():
            wanted.add((FLEET, fingerprint))
            numbered = {(FLEET, fingerprint)}
        else:
            numbered = {(ns, fingerprint) for ns in spans}
        for target in wanted:
            self._known[target] = max(self._known.get(target, 0.0), at_s)
        self._write(dict.fromkeys(wanted, at_s))
        if self._number(dict.fromkeys(numbered, at_s)):
            log.warning("fleet invalidation: not numbered in the remote tier yet; again at each poll")

    def _fleet(self) -> bool:
        """Whether FLEET's marks reach the remote (asked each time: a Redis ACL's answer comes
        once the cluster answers)."""
        carried = self._tier.carries(FLEET)
        if not carried and not self._said_fleet and not self._tier.usage().nodes_down:
            self._said_fleet = True
            log.warning(
                "fleet invalidation: the remote tier does not carry %s (no such token in "
                "remote.tokens, or the Redis ACL user may not touch its keys), so an invalidation "
                "of every namespace reaches only the namespaces its issuer knows",
                FLEET,
            )
        return carried

    def _number(self, targets: dict[Target, float]) -> int:
        """Number the invalidations in their ledgers; how many the remote did not take (kept)."""
        failed = {t: at_s for t, at_s in targets.items() if not self._ledger.issue(t[0], t[1], at_s)}
        with self._lock:
            self._unnumbered.update(failed)
        return len(failed)

    def _write(self, marks: dict[Target, float]) -> None:
        by_key = {mark_key(*target): (target, at_s) for target, at_s in marks.items()}
        current = self._read(list(by_key))
        stale = {k: v for k, v in by_key.items() if current.get(k, 0.0) < v[1]}
        if not stale:
            return
        # delete first: a shared kvstore node keeps the first copy of a key (puts deduplicate)
        self._tier.delete_many(list(stale))
        stored = self._tier.put_many(
            [
                RemoteBlock(k, MARK_FINGERPRINT, mark_value(at_s), lasting=True)
                for k, (_, at_s) in stale.items()
            ]
        )
        if stored < len(stale):
            with self._lock:  # all of them again (one the remote took reads as current then)
                for target, at_s in stale.values():
                    self._unsent[target] = max(self._unsent.get(target, 0.0), at_s)
            log.warning(
                "fleet invalidation: %d of %d marks not written to the remote tier; written "
                "again at each poll, other sidecars keep their copies meanwhile",
                len(stale) - stored,
                len(stale),
            )
        with self._store_lock:
            self._counts["invalidation_marks_written"] += stored

    # ----------------------------------------------------------------- applying

    def dead_before(self, scope: Scope) -> float:
        """Blocks of ``scope`` born at or before this wall time are invalidated (0: none)."""
        known = self._known
        if not known:
            return 0.0
        return max(
            known.get((scope.namespace, None), 0.0),
            known.get((scope.namespace, scope.fingerprint), 0.0),
            known.get((FLEET, None), 0.0),
            known.get((FLEET, scope.fingerprint), 0.0),
        )

    def poll(self, starting: bool = False) -> int:
        """Send the marks the remote did not take yet, then read the marks of every scope seen
        here and apply the new ones, and check the ledgers (``starting``: see ``Ledger.check``);
        blocks dropped."""
        with self._lock:
            unsent, self._unsent = self._unsent, {}
            unnumbered, self._unnumbered = self._unnumbered, {}
        if unsent:
            self._write(unsent)
        if unnumbered:
            self._number(unnumbered)
        with self._store_lock:
            scopes = [s for s in self._index.scopes() if s.fingerprint != MARK_FINGERPRINT]
        targets: dict[TierKey, Target] = {}
        fleet = self._fleet()
        for scope in scopes:
            for ns in (scope.namespace, FLEET) if fleet else (scope.namespace,):
                targets[mark_key(ns, None)] = (ns, None)
                targets[mark_key(ns, scope.fingerprint)] = (ns, scope.fingerprint)
        if not targets:
            return 0
        failures = self._tier.usage().failures
        ledgers = sorted({ns for ns, _ in targets.values() if self._tier.carries(ns)})
        found = read_values(self._tier, [*targets, *self._ledger.first_keys(ledgers)])  # one batch
        outcomes = self._ledger.check(ledgers, found, starting)
        marks = {k: t for k in targets if (t := read_mark(found.get(k)))}
        dropped = sum(self._learn(targets[key], at_s) for key, at_s in marks.items())
        usage = self._tier.usage()
        if usage.failures != failures or usage.nodes_down:  # a node skipped reads as misses: no loss
            log.warning("fleet invalidation: the remote tier did not answer; serving local blocks meanwhile")
            return dropped
        for outcome in outcomes:
            dropped += self._settle(outcome)
        self._ledger.done(outcomes)
        return dropped

    def _learn(self, target: Target, at_s: float) -> int:
        """A mark or a ledger entry read: applied if newer than the one known here."""
        if at_s <= self._known.get(target, 0.0):
            return 0
        self._known[target] = at_s
        return self._apply(target, at_s)

    def _settle(self, outcome: Outcome) -> int:
        """One ledger's new entries applied; a loss fails closed: it stands for an invalidation
        of its namespace (every namespace, for FLEET) now, so every local block born before
        goes, and every remote copy born before is refused here (``dead_before``) and, through
        the mark written for it, at every sidecar and after a restart (the remote still holds
        the lost invalidation's copies that no local block named)."""
        dropped = sum(self._learn((outcome.ledger, e.fingerprint), e.at_s) for e in outcome.entries)
        if not outcome.lost:
            return dropped
        now = time.time()
        with self._store_lock:
            self._counts["invalidation_ledger_losses"] += 1
        gone = self._learn((outcome.ledger, None), now)
        # unnumbered: the record below moves to the head read before it, so its number would
        # read as a gap at the next poll; evicted, it leaves the cutoff known here only
        self._write({(outcome.ledger, None): now})
        log.warning(
            "fleet invalidation: the ledger of %s lost invalidations (%s); dropped its %d local "
            "blocks born before now, and refuses remote copies born before now, rather than "
            "serve what they may have killed",
            "every namespace" if outcome.ledger == FLEET else f"namespace {outcome.ledger}",
            outcome.lost,
            gone,
        )
        return dropped + gone

    def _apply(self, target: Target, at_s: float) -> int:
        namespace, fingerprint = target
        with self._store_lock:
            victims = [
                b
                for b in list(self._index.pool(None if namespace == FLEET else namespace))
                if not b.doomed
                and b.stored_at_s <= at_s
                and (fingerprint is None or b.scope.fingerprint == fingerprint)
                and b.scope.fingerprint != MARK_FINGERPRINT
            ]
            for block in victims:
                self._pins.doom(block)
            self._counts["fleet_invalidated_blocks"] += len(victims)
        log.info(
            "fleet invalidation: dropped %d blocks of namespace %s, fingerprint %s, born before %.3f",
            len(victims),
            namespace,
            fingerprint.hex() if fingerprint else "*",
            at_s,
        )
        if victims:  # copies this sidecar sent after the issuer's delete
            self._tier.delete_many([b.tkey for b in victims])
        return len(victims)

    def _read(self, keys: Sequence[TierKey]) -> dict[TierKey, float]:
        """The marks present among ``keys``, and their times."""
        return {k: t for k, v in read_values(self._tier, keys).items() if (t := read_mark(v))}

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # a bug here must not stop the polling for good
                log.exception("fleet invalidation: poll failed")
