"""Which replicas answer: passive ejection on a failure, a background probe to bring them back.

A replica is down from the moment a request to it fails (connection refused or timed out, no
answer in time, a 5xx) until its ``/health`` answers 2xx to the probe, which asks every replica
each ``interval_s`` (so one that died with no traffic is seen down too, and one that came back is
used again within an interval). While down it gets no new requests. Everything here runs on the
router's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import aiohttp

log = logging.getLogger(__name__)


class ReplicaHealth:
    def __init__(self, names: Sequence[str], bases: Sequence[str], interval_s: float) -> None:
        self.names = tuple(names)
        self._bases = tuple(b.rstrip("/") for b in bases)
        self._interval_s = interval_s
        self._down_since: dict[int, float] = {}
        self._task: asyncio.Task[None] | None = None

    def down(self) -> frozenset[int]:
        return frozenset(self._down_since)

    def failed(self, replica: int, why: str) -> None:
        if replica not in self._down_since:
            log.warning(
                "replica %s (%s) is down (%s): no new requests until it answers",
                self.names[replica],
                self._bases[replica],
                why,
            )
            self._down_since[replica] = time.monotonic()

    def answered(self, replica: int) -> None:
        since = self._down_since.pop(replica, None)
        if since is not None:
            log.warning("replica %s is up again after %.1f s", self.names[replica], time.monotonic() - since)

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._probe_forever(session))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def probe(self, session: aiohttp.ClientSession) -> None:
        """Ask every replica's ``/health`` once, in parallel."""
        await asyncio.gather(*(self._probe_one(session, i) for i in range(len(self._bases))))

    async def _probe_one(self, session: aiohttp.ClientSession, replica: int) -> None:
        timeout = aiohttp.ClientTimeout(total=self._interval_s)
        try:
            async with session.get(self._bases[replica] + "/health", timeout=timeout) as answer:
                ok = answer.status < 300
                status = f"/health answered {answer.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, status = False, f"/health: {type(exc).__name__}"
        if ok:
            self.answered(replica)
        else:
            self.failed(replica, status)

    async def _probe_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.probe(session)
            await asyncio.sleep(self._interval_s)
