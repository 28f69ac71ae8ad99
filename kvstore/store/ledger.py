"""The fleet's invalidation ledger: every invalidation numbered, so that a lost mark is seen.

A mark (``kvstore.store.invalidations``) is a value like any other: a remote tier that evicts
it (Redis ``maxmemory`` under an ``allkeys-*`` policy, a node wiped by a restart) forgets it,
and a sidecar that was down meanwhile would go on serving its local copies of what it killed.
So each invalidation also takes the next number of a *ledger*, and a sidecar that finds a
number missing fails closed.

A ledger is kept per namespace, and one more, ``FLEET``, for invalidations of every namespace
("everything", or a fingerprint in all of them), which every sidecar reads for every tenant it
holds, known to the issuer or not. In the remote tier, under ``MARK_FINGERPRINT`` of the
ledger's namespace: entry *n* (the invalidation's time, number and fingerprint), claimed by a
put that only stores an absent key (``RemoteTier.claim``: two issuers never share a number),
and the head (the highest number issued), rewritten after each claim.

Each sidecar keeps, per ledger, the last number it checked and that entry's time, durably
(``Applied``: a file in its data folder, beside its nvme). At start, before it serves, and at
each poll it reads every ledger's head and its own last entry (one batch), then the entries
after it. A ledger is *lost* when the head is missing (twice, 50 ms apart: a kvstore node
rewrites it by a delete and a put) or went back, its own last entry is missing or is another
one (the remote was emptied or evicted it), an entry between is missing, or, at start, it has
entries and this sidecar no record of it (its blocks predate what it can vouch for). The
sidecar then takes it as an invalidation of that namespace (of every namespace, for
``FLEET``) now (``FleetInvalidations._settle``: local blocks born before dropped, remote
copies refused), counts it (``invalidation_ledger_losses``) and logs one WARNING. A ledger
first seen while serving starts at its head: the blocks it holds came since, past the marks.
The last poll, at close, records the ledgers first seen since the one before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.keys import BlockKey, Fingerprint
from kvstore.store.model import MARK_FINGERPRINT, Scope, tier_key
from tiers import BytesLike, TierKey
from tiers.remote import RemoteBlock, RemoteTier

log = logging.getLogger("kvstore.store")

FLEET = "t/*"  # the ledger (and marks) of invalidations that span every namespace
_ENTRY = struct.Struct("<dQB32s")  # time, number, has a fingerprint, the fingerprint
_HEAD = struct.Struct("<Q")
_NO_FINGERPRINT = bytes(32)
MAX_CLAIMS = 64  # numbers tried past the head before giving up until the next poll
RECHECK_S = 0.05  # a head that reads missing is read again after this (a node's rewrite)


@dataclass(frozen=True)
class Entry:
    number: int
    at_s: float
    fingerprint: Fingerprint | None  # None: the whole namespace


@dataclass
class Outcome:
    """What one ledger's check found: its head, the new entries (in order) after ``after``,
    and why it is lost ("": it is not)."""

    ledger: str
    head: int
    entries: list[Entry]
    lost: str = ""
    after: int = 0
    fresh: bool = False  # first seen: its head entry is read for its time, and may be gone


def _key(ledger: str, label: bytes) -> TierKey:
    """Named apart for FLEET: a kvstore node may file it under a token a namespace uses too
    (a node keys a tenant's blocks without the sidecar's name for the namespace)."""
    name = (b"kvstore fleet ledger " if ledger == FLEET else b"kvstore ledger ") + label
    return tier_key(Scope(ledger, MARK_FINGERPRINT), BlockKey(hashlib.blake2b(name, digest_size=32).digest()))


def head_key(ledger: str) -> TierKey:
    return _key(ledger, b"head")


def entry_key(ledger: str, number: int) -> TierKey:
    return _key(ledger, b"entry %d" % number)


def _entry(value: BytesLike | None) -> Entry | None:
    view = memoryview(value).cast("B") if value is not None else None
    if view is None or len(view) != _ENTRY.size:
        return None
    at_s, number, has, fingerprint = _ENTRY.unpack(view)
    return Entry(number, at_s, Fingerprint(fingerprint) if has else None)


def _head(value: BytesLike | None) -> int | None:
    view = memoryview(value).cast("B") if value is not None else None
    return _HEAD.unpack(view)[0] if view is not None and len(view) == _HEAD.size else None


def read_values(tier: RemoteTier, keys: Sequence[TierKey]) -> dict[TierKey, BytesLike]:
    """The marks and ledger values present among ``keys``: which are, then their values (a
    shared node answers a batch's present prefix only, so the absent ones are not asked for)."""
    present = [k for k, here in zip(keys, tier.contains(keys), strict=True) if here]
    if not present:
        return {}
    values = tier.get_many(present, MARK_FINGERPRINT)
    return {k: v for k, v in zip(present, values, strict=True) if v is not None}


class Applied:
    """Per ledger, the last number checked and its entry's time (0.0: unknown), kept in a JSON
    file (replaced atomically) so that a restarted sidecar knows where it stopped."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._at: dict[str, tuple[int, float]] = {}
        if path is not None and path.exists():
            try:
                self._at = {k: (int(n), float(t)) for k, (n, t) in json.loads(path.read_text()).items()}
            except (OSError, ValueError, TypeError) as exc:  # unreadable: as if new
                log.warning("invalidation ledger record %s unreadable (%s): as if none", path, exc)

    def get(self, ledger: str) -> tuple[int, float] | None:
        return self._at.get(ledger)

    def set(self, changes: dict[str, tuple[int, float]]) -> None:
        changes = {k: v for k, v in changes.items() if self._at.get(k) != v}
        if not changes:
            return
        self._at.update(changes)
        if self._path is None:
            return
        tmp = self._path.with_name(self._path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self._at, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)


class Ledger:
    """See the module docstring. Called by ``FleetInvalidations`` (issuing and its poll)."""

    def __init__(self, tier: RemoteTier, applied: Applied) -> None:
        self._tier = tier
        self.applied = applied

    def issue(self, ledger: str, fingerprint: Fingerprint | None, at_s: float) -> bool:
        """Number an invalidation taken here; False when the remote did not take it (again later)."""
        if not self._tier.carries(ledger):
            return True  # none of its blocks reach the remote: no sidecar reads its ledger there
        if self._tier.usage().nodes_down:
            return False  # a node skipped reads and writes nothing: numbered at a later poll
        head = _head(read_values(self._tier, [head_key(ledger)]).get(head_key(ledger)))
        mine = self.applied.get(ledger)
        number = max(head or 0, mine[0] if mine else 0) + 1
        for _ in range(MAX_CLAIMS):  # the next free number: another issuer may have taken this one
            entry = _ENTRY.pack(at_s, number, fingerprint is not None, fingerprint or _NO_FINGERPRINT)
            claimed = self._tier.claim(
                RemoteBlock(entry_key(ledger, number), MARK_FINGERPRINT, entry, lasting=True)
            )
            if claimed is None:
                return False
            if claimed:
                break
            number += 1
        else:
            return False
        # a kvstore node keeps a key's first copy: the old head goes first (readers recheck)
        self._tier.delete_many([head_key(ledger)])
        head_block = RemoteBlock(head_key(ledger), MARK_FINGERPRINT, _HEAD.pack(number), lasting=True)
        return self._tier.put_many([head_block]) == 1

    def check(
        self, ledgers: Sequence[str], first: dict[TierKey, BytesLike], starting: bool = False
    ) -> list[Outcome]:
        """From ``first`` (``read_values`` of ``first_keys(ledgers)``, read with the marks),
        each ledger's head and last checked entry; then the new entries are read. ``starting``:
        the ledgers are of blocks this sidecar held before it started, so one with entries and
        no record here is lost (it may have stopped before recording it)."""
        if any(head_key(ledger) not in first for ledger in ledgers if (self.applied.get(ledger) or (0,))[0]):
            time.sleep(RECHECK_S)  # a head being rewritten reads missing for a moment
            first = read_values(self._tier, self.first_keys(ledgers))
        outcomes: list[Outcome] = []
        for ledger in ledgers:
            head = _head(first.get(head_key(ledger)))
            mine = self.applied.get(ledger)
            if mine is None and starting and head:
                outcomes.append(Outcome(ledger, head, [], "no record of where this sidecar stopped"))
                continue
            if mine is None:  # first seen: it starts at its head
                outcomes.append(Outcome(ledger, head or 0, [], "", max(0, (head or 0) - 1), fresh=True))
                continue
            number, at_s = mine
            last = _entry(first.get(entry_key(ledger, number))) if number else None
            if number and head is None:
                outcomes.append(Outcome(ledger, 0, [], f"its head is missing ({number} applied here)"))
            elif at_s and (last is None or last.at_s != at_s):
                outcomes.append(
                    Outcome(ledger, head or 0, [], f"entry {number}, applied here, is gone or replaced")
                )
            elif head is not None and head < number and not at_s:
                outcomes.append(Outcome(ledger, head, [], f"its head went back from {number} to {head}"))
            elif head is not None and head > number:
                outcomes.append(Outcome(ledger, head, [], "", number))
        wanted = [
            entry_key(o.ledger, n) for o in outcomes if not o.lost for n in range(o.after + 1, o.head + 1)
        ]
        found = read_values(self._tier, wanted) if wanted else {}
        for o in outcomes:
            if o.lost:
                continue
            numbers = range(o.after + 1, o.head + 1)
            entries = [_entry(found.get(entry_key(o.ledger, n))) for n in numbers]
            o.entries = [e for e in entries if e is not None]
            missing = [n for n, e in zip(numbers, entries, strict=True) if e is None]
            if missing and not o.fresh:
                o.lost = f"entries {missing[:5]} of {numbers.start}..{o.head} are missing"
        return outcomes

    def done(self, outcomes: Sequence[Outcome]) -> None:
        """The outcomes applied: each ledger's record moves to its head; after a loss, with
        that entry's time unknown (0.0), so its absence is no second loss."""
        changes: dict[str, tuple[int, float]] = {}
        for o in outcomes:
            newest = o.entries[-1] if o.entries else None
            exact = not o.lost and newest is not None and newest.number == o.head
            changes[o.ledger] = (o.head, newest.at_s if exact and newest is not None else 0.0)
        self.applied.set(changes)

    def first_keys(self, ledgers: Sequence[str]) -> list[TierKey]:
        """What a check reads first: each ledger's head and the last entry checked here."""
        keys: list[TierKey] = []
        for ledger in ledgers:
            keys.append(head_key(ledger))
            mine = self.applied.get(ledger)
            if mine and mine[0]:
                keys.append(entry_key(ledger, mine[0]))
        return keys
