"""Room held for paced writes: the arena room a write waited for (``Pacing.pace``) is its own
until that write takes it, so a writer beside it cannot take it in between. A resolve waiting to
promote a block (``Pacing.wait_retired``) waits in the same line and holds its room the same way.

    Held(t, sizes)              a paced write's claim on arena tier ``t``: the slots it holds
                                (``keys``) and the sizes it still waits for (``sizes``)
    RoomLine.join(held)         into tier ``held.t``'s line: first come, first served
    RoomLine.hold(t, arena)     free room goes to the line in order, as reserved slots under keys
                                no block has; the first write that cannot have all it waits for
                                keeps what it got and stops the line (none behind passes it)
    RoomLine.wanted_through(held)  the bytes the line still waits for, up to ``held``
    RoomLine.leave(held)        out of the line, keeping what it holds
    RoomLine.let_go(held)       its slots go back to the arena: to its own write, which takes
                                them under the same hold of the lock, or (``hold`` after it) to
                                the line

Every call runs under the store lock. Without the hold, two paced writers woke for the same freed
slot: one took it, and the other, though it had waited, found no room and its block went to the
disk (or its reservation got no slot).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from tiers import InPlaceTier, TierError, TierKey

KEY_PREFIX = b"\x00held:"  # no block's tier key starts with a zero byte (a namespace is never empty)
FINGERPRINT = bytes(32)


@dataclass(eq=False)
class Held:
    """Room in arena tier ``t`` that a paced write waited for; see the module docstring."""

    t: int
    sizes: list[int]
    keys: list[TierKey] = field(default_factory=list)


class RoomLine:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lines: dict[int, deque[Held]] = {}  # per arena tier
        self._ids = itertools.count()

    def join(self, held: Held) -> None:
        self._lines.setdefault(held.t, deque()).append(held)

    def hold(self, t: int, arena: InPlaceTier) -> None:
        line = self._lines.get(t)
        while line:
            held = line[0]
            items = [(TierKey(KEY_PREFIX + b"%d" % next(self._ids)), n) for n in held.sizes]
            try:
                slots = arena.reserve_many(items, FINGERPRINT)
            except TierError:  # the arena closed: nothing to hold
                return
            # None: a block larger than the arena, which no wait gives room for
            held.keys += [key for (key, _), slot in zip(items, slots, strict=False) if slot is not None]
            held.sizes = [n for _, n in items[len(slots) :]]
            if held.sizes:
                return
            line.popleft()

    def wanted_through(self, held: Held) -> int:
        wanted = 0
        for ahead in self._lines.get(held.t, ()):
            wanted += sum(ahead.sizes)
            if ahead is held:
                break
        return wanted

    def leave(self, held: Held) -> bool:
        """Whether it was still in line (its place, now empty, may let the next one on)."""
        line = self._lines.get(held.t)
        if line is None or held not in line:
            return False
        line.remove(held)
        return True

    def let_go(self, held: Held, arena: InPlaceTier) -> None:
        self.leave(held)
        for key in held.keys:
            arena.abort(key)
        held.keys.clear()
        held.sizes.clear()
