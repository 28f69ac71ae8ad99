"""The router following its sidecars' KV event feeds instead of asking them each prompt.

``FollowedProbe`` answers ``hits`` as ``SidecarProbe`` does (the leading blocks each replica's
sidecar holds, and in which tier), but from an index per sidecar kept from that sidecar's feed
(``events.publish_address``; ``kvstore.kv_events``, docs/events.md): a ``BlockStored`` adds a
copy of each key in its medium, a ``BlockRemoved`` takes one away, ``AllBlocksCleared`` empties
the index. Copies are counted, not flagged: the same key held for two tenants is two copies,
and one removal leaves the other. Only the engines' fingerprint is still asked of the sidecars
(once, ``SidecarProbe.fingerprint``).

What an index can miss: blocks a sidecar held before the router subscribed (ZMQ has no history:
a router started after its sidecars learns what they store from then on), batches lost to a gap
in the sequence (counted in ``gaps``; the index goes on, possibly holding a block gone or missing
one stored), and a restarted sidecar's rebuilt ``nvme`` (its sequence starting over empties the
index). A miss costs a route that ignores a cache, never a wrong answer: the engine's own lookup
decides what is restored.

Threads: one thread receives every feed and applies it under a lock; ``hits`` reads under it.
Needs pyzmq and msgspec (the ``events`` extra).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import msgspec
import zmq

from kvstore.keys import Fingerprint
from kvstore.kv_events import SidecarIndex, decoder, sequence_of
from kvstore.routing.router import SidecarProbe

log = logging.getLogger("kvstore.route")

_POLL_MS = 200


class FollowedProbe(SidecarProbe):
    """A ``SidecarProbe`` whose ``hits`` come from the sidecars' event feeds (``endpoints``, in
    ``sidecars`` order) instead of a lookup per sidecar per prompt."""

    def __init__(
        self, sidecars: Sequence[str], endpoints: Sequence[str], token: str | None = None, topic: str = ""
    ) -> None:
        if len(endpoints) != len(sidecars):
            raise ValueError(f"one --sidecar-events per --sidecar: {len(endpoints)} for {len(sidecars)}")
        super().__init__(sidecars, token=token)
        self.indexes = [SidecarIndex() for _ in endpoints]
        self.events = 0  # events applied, all feeds
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket[bytes]] = []
        for endpoint in endpoints:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.connect(endpoint)
            self._socks.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="kvstore-route-events", daemon=True)
        self._thread.start()

    def hits(
        self, fingerprint: Fingerprint, keys: Sequence[bytes], cache_salt: str = ""
    ) -> list[tuple[str, ...]]:
        with self._lock:
            return [index.prefix_tiers(keys) for index in self.indexes]

    def _follow(self) -> None:
        decode = decoder().decode
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        which = {sock: i for i, sock in enumerate(self._socks)}
        while not self._stop.is_set():
            for sock, _ in poller.poll(_POLL_MS):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 3:
                        continue
                    try:
                        batch = decode(frames[2])
                    except msgspec.DecodeError as exc:  # not a KV event batch
                        log.warning("an event batch from sidecar %d did not decode: %s", which[sock], exc)
                        continue
                    with self._lock:
                        self.indexes[which[sock]].apply(sequence_of(frames[1]), batch)
                        self.events += len(batch.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()
        super().close()
