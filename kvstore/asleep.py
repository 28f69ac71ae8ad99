"""A thread about to sleep on something slow says so, so that a scarce place it was lent can serve
another thread meanwhile.

The server lends each request thread one of its tenant's few places (``kvstore.server.fairness``),
which keep a tenant's threads from all wanting the GIL at once. A thread that sleeps on a disk
that is behind (the store's pace before a write: up to 2 s) wants no GIL, yet held its place: two
such writes of one sidecar held every other request of its engine (a restore's resolve included)
for as long. The store, which knows when it sleeps, and the server, which knows what it lent, do
not know each other (the store is a floor below), so they meet here, on the thread:

    with lending(give_back):   # the lender: give_back() is a context that hands the place on
        ...                    # and takes one again (in line) when it exits
            with asleep():     # the sleeper, anywhere below: the place serves another meanwhile
                wait_for_the_disk()

Thread rules: both act on the calling thread only; ``asleep`` without a lender does nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_here = threading.local()


@contextlib.contextmanager
def lending(give_back: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    """For the block, this thread's ``asleep`` calls enter ``give_back()``."""
    previous = getattr(_here, "give_back", None)
    _here.give_back = give_back
    try:
        yield
    finally:
        _here.give_back = previous


@contextlib.contextmanager
def asleep() -> Iterator[None]:
    """For the block, what this thread was lent serves others (it is taken again after)."""
    give_back: Callable[[], contextlib.AbstractContextManager[None]] | None = getattr(
        _here, "give_back", None
    )
    if give_back is None:
        yield
        return
    _here.give_back = None  # one give-back at a time: a nested sleep has nothing left to lend
    try:
        with give_back():
            yield
    finally:
        _here.give_back = give_back
