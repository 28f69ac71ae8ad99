"""The data port's workers: a bounded pool of threads that serve the requests the answering loop
(``kvstore.server.answering``) does not answer itself, taking tenants in turn.

A connection with such a request (a get, a put, a reserve or commit, a resolve, a lookup too big
for the loop's buffer or one that may ask the remote tier, any request under TLS) is queued under
its tenant; a free worker takes the next tenant in the ring that has one of its places free
(``kvstore.server.fairness``: the same places gRPC's workers take), then that tenant's connection
queued longest: per tenant first, then per connection within the tenant. The worker serves it
holding the place (lent while it sleeps on a disk, ``kvstore.asleep``; WORKERS_PER_TENANT bounds
a tenant's workers, lent places included) and gives the connection back to the loop, or queues it
again when it holds another request already.

Why a pool and not a thread per connection: Python runs one thread at a time, so what a request
waits for is how many threads want the GIL, and 250 connections of one tenant were 250 threads
(each woken for its own requests). Here at most WORKERS threads serve at once, at most
``per_tenant`` of them one tenant's, however many connections are open.

Thread rules: ``submit`` from any thread; ``close`` once; ``serve`` runs on a worker, one
connection on one worker at a time (a connection is queued at most once: its owner submits it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from kvstore.server.fairness import TenantShares

log = logging.getLogger(__name__)

# Threads serving data-port requests at once, every tenant together: each more is one more thread
# wanting the GIL; fewer leaves tenants waiting while every worker sleeps on a socket or a disk.
WORKERS = 8
# The most of them one tenant's requests take, lent places included: a worker asleep on a disk
# lends its place to the tenant's next request, and without a bound a tenant's paced writes
# could put every worker to sleep and leave the other tenants none.
WORKERS_PER_TENANT = WORKERS // 2

Item = TypeVar("Item")


class Workers(Generic[Item]):
    """``serve(item)`` on a worker, in turn per tenant; ``drop(item)`` for what ``close`` finds
    still queued. ``timeout_s``: how long a worker that lent its place waits to take one again."""

    def __init__(
        self,
        shares: TenantShares,
        serve: Callable[[Item], None],
        drop: Callable[[Item], None],
        timeout_s: float,
        count: int = WORKERS,
    ) -> None:
        self._shares = shares
        self._serve = serve
        self._drop = drop
        self._timeout_s = timeout_s
        self._queues: dict[str, deque[Item]] = {}  # per tenant, oldest first
        self._ring: deque[str] = deque()  # tenants with something queued, next turn first
        self._busy: dict[str, int] = {}  # workers serving each tenant now
        self._ready = threading.Condition()
        self._closed = False
        shares.on_free(self._freed)
        self._threads = [
            threading.Thread(target=self._run, name=f"kvstore-dataport-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: str, item: Item) -> None:
        with self._ready:
            if not self._closed:
                queue = self._queues.get(tenant)
                if queue is None:
                    queue = self._queues[tenant] = deque()
                    self._ring.append(tenant)
                queue.append(item)
                self._ready.notify()
                return
        self._drop(item)

    def queued(self, tenant: str) -> int:
        """How many of ``tenant``'s connections wait for a worker now."""
        with self._ready:
            queue = self._queues.get(tenant)
            return len(queue) if queue is not None else 0

    def close(self, deadline: float) -> None:
        """Drop what is queued; let the workers finish what they serve until ``deadline``."""
        with self._ready:
            self._closed = True
            left = [item for queue in self._queues.values() for item in queue]
            self._queues.clear()
            self._ring.clear()
            self._ready.notify_all()
        for item in left:
            self._drop(item)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` in all for the workers to end (after ``close``)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _freed(self) -> None:
        with self._ready:
            if self._ring:
                self._ready.notify()

    def _next(self) -> tuple[str, Item] | None:
        """The next tenant in turn with a place free, and its connection queued longest; None
        once closed. Waits while there is none."""
        with self._ready:
            while not self._closed:
                for _ in range(len(self._ring)):
                    tenant = self._ring[0]
                    self._ring.rotate(-1)  # its turn taken or passed: to the back
                    if self._busy.get(tenant, 0) < WORKERS_PER_TENANT and self._shares.try_take(tenant):
                        self._busy[tenant] = self._busy.get(tenant, 0) + 1
                        queue = self._queues[tenant]
                        item = queue.popleft()
                        if not queue:
                            del self._queues[tenant]
                            self._ring.pop()  # at the back now
                        return tenant, item
                self._ready.wait()
            return None

    def _run(self) -> None:
        while (turn := self._next()) is not None:
            tenant, item = turn
            try:
                with self._shares.holding(tenant, self._timeout_s):
                    self._serve(item)
            except Exception:  # serve reports its own; a worker must outlive any request
                log.exception("a data-port worker's request failed")
            finally:
                with self._ready:
                    if self._busy[tenant] == 1:
                        del self._busy[tenant]
                    else:
                        self._busy[tenant] -= 1
                    if tenant in self._queues:
                        self._ready.notify()  # its next may wait for this worker's end alone
