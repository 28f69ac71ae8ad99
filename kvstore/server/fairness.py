"""Request threads shared per tenant first: at most ``per_tenant`` of one tenant's requests are
served at once by threads of their own (the data ports' workers, gRPC's); the rest of
that tenant's wait, first come first served, each on a lock of its own.

Why: Python runs one thread at a time (the GIL), and a thread that wants it waits for every
other runnable one. A tenant with 250 connections, each a thread with a request to serve, had
250 threads wanting the GIL, and another tenant's lookup waited behind all of them (p50 0.08 ->
136 ms over TCP). Waiting here, a thread sleeps on a lock and wants nothing: one tenant's
threads then slow each other, not the others' (each tenant has its own ``per_tenant`` places).

A place freed is handed to the tenant's first waiter directly (the releasing thread cannot take
it back at once, as it could from a ``threading.Semaphore``, and starve one connection of its
tenant). A thread that sleeps on a disk inside the block (``kvstore.asleep``) gives its place to
the next of its tenant meanwhile and waits in line for one after: it wants no GIL while it
sleeps, and its tenant's other requests (an engine's restores behind its paced saves) go on.
The data port's workers (``kvstore.server.workers``) do not wait here: they take a place with
``try_take`` for the tenant whose turn it is, skip a tenant with none free, and learn through
``on_free`` when one is freed. Thread rules: ``place``, ``try_take`` and ``holding`` from any
thread; a place is held by the ``with`` block; ``on_free``'s listeners are called outside the lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvstore.asleep import lending
from kvstore.errors import ResourceExhausted

# A tenant's requests served by threads at once. Two: one can wait on its socket or a disk while
# the other runs; each more is one more thread wanting the GIL beside every other tenant's.
# Measured on two CPUs, a tenant flooding with 1000-key lookups (too big for the loop, so each
# served by a thread) left another tenant's lookups at p50 0.6-0.9 ms (TCP), 0.7 (Unix), 2.5
# (gRPC) with two places; with eight, 5-6, 5-6 and 8-10 ms.
SERVED_AT_ONCE_PER_TENANT = 2


@dataclass
class _Share:
    held: int = 0
    waiting: deque[threading.Lock] = field(default_factory=deque)


class TenantShares:
    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be at least 1, got {per_tenant}")
        self.per_tenant = per_tenant
        self._shares: dict[str, _Share] = {}
        self._lock = threading.Lock()
        # Told when a place is freed with nobody of its tenant waiting (the data ports' workers).
        self._listeners: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def place(self, tenant: str, timeout_s: float) -> Iterator[None]:
        """One of ``tenant``'s places for the block; waits up to ``timeout_s`` for one, then
        raises ResourceExhausted."""
        self._acquire(tenant, timeout_s)
        with self.holding(tenant, timeout_s):
            yield

    def on_free(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (outside the lock) whenever a place is freed with nobody waiting."""
        self._listeners.append(listener)

    def try_take(self, tenant: str) -> bool:
        """Take one of ``tenant``'s places if one is free and nobody of the tenant waits for one
        (they came first); then hold it with ``holding``."""
        with self._lock:
            share = self._shares.setdefault(tenant, _Share())
            if share.held < self.per_tenant and not share.waiting:
                share.held += 1
                return True
            if share.held == 0:
                del self._shares[tenant]
            return False

    @contextlib.contextmanager
    def holding(self, tenant: str, timeout_s: float) -> Iterator[None]:
        """The block holds a place of ``tenant``'s already taken, and frees it at the end; asleep
        on a disk inside (``kvstore.asleep``), it lends it meanwhile and waits up to ``timeout_s``
        in line for one after."""
        held = True

        @contextlib.contextmanager
        def give_back() -> Iterator[None]:  # while the thread sleeps on a disk (kvstore.asleep)
            nonlocal held
            self._release(tenant)
            held = False
            try:
                yield
            finally:
                self._acquire(tenant, timeout_s)  # in line again; raises if it waits too long
                held = True

        try:
            with lending(give_back):
                yield
        finally:
            if held:
                self._release(tenant)

    def waiting(self, tenant: str) -> int:
        """How many of ``tenant``'s requests wait for a place now."""
        with self._lock:
            share = self._shares.get(tenant)
            return len(share.waiting) if share is not None else 0

    def _acquire(self, tenant: str, timeout_s: float) -> None:
        with self._lock:
            share = self._shares.setdefault(tenant, _Share())
            if share.held < self.per_tenant:
                share.held += 1
                return
            turn = threading.Lock()
            turn.acquire()
            share.waiting.append(turn)
        if turn.acquire(timeout=timeout_s):
            return  # handed over: ``held`` counts it already
        with self._lock:
            if turn in share.waiting:
                share.waiting.remove(turn)
                raise ResourceExhausted(
                    f"tenant {tenant} has {self.per_tenant} requests being served and waited "
                    f"{timeout_s:.0f} s for one to end; retry later"
                )
        # handed over between the timeout and the check: the place is ours

    def _release(self, tenant: str) -> None:
        with self._lock:
            share = self._shares[tenant]
            if share.waiting:
                share.waiting.popleft().release()  # the place goes to the next, still held
                return
            share.held -= 1
            if share.held < 0:
                raise RuntimeError(f"tenant {tenant}'s places released more often than taken")
            if share.held == 0:
                del self._shares[tenant]
        for listener in self._listeners:
            listener()
