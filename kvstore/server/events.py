"""The sidecar's KV cache events: what it holds, published in vLLM's format over ZMQ PUB.

``events.publish_address`` turns it on (off by default). The store tells the publisher of every
copy stored or gone, under its lock (``kvstore.store.changes``); the publisher copies the call
into a bounded queue and returns, and its own thread turns the queue into ``KVEventBatch``es
(``kvstore.kv_events``) sent as vLLM's ``ZmqEventPublisher`` sends them: frames (topic,
8-byte sequence, msgpack payload). So a store never waits on the feed: when ``events.max_queued``
changes are waiting, further ones are dropped and counted (``kvstore_events_dropped_total``), and
the next batch's sequence number skips one, so a subscriber sees the gap. PUB itself never
blocks either: a subscriber slower than ``events.send_hwm`` batches loses batches (ZMQ drops them).

Mapping (docs/events.md): a stored chain of blocks in one tier is one ``BlockStored`` (its keys
in order, the parent of the first as ``parent_block_hash``); removals in a row from one tier
are one ``BlockRemoved``; an invalidation of everything is ``AllBlocksCleared`` and replaces the
changes still queued (they are moot). The fleet's remote tier is not published here: its copies
are the fleet's (a shared node, itself a ``kvstore serve``, publishes its own).

Threads: ``stored``/``removed``/``cleared`` are called by the store under its lock (one producer
at a time); ``close`` by whoever stops the server. Needs pyzmq and msgspec (the ``events`` extra).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.errors import FailedPrecondition
from kvstore.keys import Fingerprint
from kvstore.kv_events import (
    LOCAL,
    MEDIUM_OF_TIER,
    OWNERSHIP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    sequence_bytes,
)
from kvstore.server.config import EventsSettings
from kvstore.store.invalidations import MARK_FINGERPRINT
from kvstore.store.model import Block

log = logging.getLogger(__name__)

_STORED, _REMOVED, _CLEARED = 0, 1, 2
_Change = tuple[int, int, tuple[Block, ...]]  # kind, tier, blocks
_BATCH_EVENTS = 1024  # events per KVEventBatch at most (a burst goes out as several)
_IDLE_WAIT_S = 0.5  # the thread's sleep when nothing is queued (a change wakes it at once)
# Between batches while changes keep coming: the thread sends what gathered meanwhile in one
# batch. Woken per change instead, it took the GIL from the writers at every put (a put took
# 2.2 times as long in an in-process store on a busy 2-core machine).
_GATHER_S = 0.05


class EventPublisher:
    """See the module docstring. A ``kvstore.store.changes.BlockChanges``."""

    def __init__(
        self,
        settings: EventsSettings,
        tier_names: Sequence[str],
        block_size_of: Callable[[Fingerprint], int] = lambda fp: 0,
    ) -> None:
        self._settings = settings
        self._media = [MEDIUM_OF_TIER.get(name, name.upper()) for name in tier_names]
        self._block_size_of = block_size_of
        self._queue: collections.deque[_Change] = collections.deque()
        # Each count has one writer (producers under the store lock / the thread), so no lock.
        self.dropped = 0  # block changes refused because the queue was full
        self.published = 0  # events sent
        self._wake = threading.Event()
        self._idle = True  # the thread waits on ``_wake``: the next change sets it
        self._closed = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, settings.send_hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(settings.publish_address)
        except zmq.ZMQError as exc:
            self._pub.close()
            self._ctx.term()
            raise FailedPrecondition(
                f"events.publish_address {settings.publish_address}: cannot bind ({exc}); set a free "
                "tcp://host:port or ipc:///path, or nothing to turn events off"
            ) from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # port 0: the one bound
        self._topic = settings.topic.encode()
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- under the store lock

    def stored(self, blocks: Sequence[Block], tier: int) -> None:
        self._put((_STORED, tier, tuple(blocks)))

    def removed(self, blocks: Sequence[Block], tier: int) -> None:
        self._put((_REMOVED, tier, tuple(blocks)))

    def cleared(self) -> None:
        # Everything queued before is moot; the clear itself is never dropped (a lost clear
        # would leave subscribers holding blocks that are gone).
        self._queue.clear()
        self._put((_CLEARED, 0, ()), always=True)

    def _put(self, change: _Change, always: bool = False) -> None:
        if not always and len(self._queue) >= self._settings.max_queued:
            self.dropped += max(1, len(change[2]))
            return
        self._queue.append(change)
        if self._idle:
            self._idle = False
            self._wake.set()

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        dropped_seen = 0
        while True:
            if self._queue:
                time.sleep(_GATHER_S)
            else:
                self._idle = True
                if not self._queue:  # (a change queued just before saw the thread busy)
                    self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
            closing = self._closed
            while self._queue:
                events = self._take(_BATCH_EVENTS)
                if not events:
                    continue
                if self.dropped != dropped_seen:  # changes were lost: show subscribers a gap
                    dropped_seen = self.dropped
                    seq += 1
                payload = encode(KVEventBatch(ts=time.time(), events=events))
                try:
                    self._pub.send_multipart((self._topic, sequence_bytes(seq), payload), zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # PUB drops rather than blocks; this is a closed socket
                    log.warning("event batch %d not sent: %s", seq, exc)
                seq += 1
                self.published += len(events)
            if closing:
                return

    def _take(self, most: int) -> list[KVCacheEvent]:
        """Up to about ``most`` events off the queue, runs of one kind and tier merged."""
        events: list[KVCacheEvent] = []
        while self._queue and len(events) < most:
            try:
                kind, tier, blocks = self._queue.popleft()
            except IndexError:  # cleared meanwhile
                break
            if kind == _CLEARED:  # what this batch holds so far is moot too
                events.clear()
                events.append(AllBlocksCleared())
                continue
            medium = self._media[tier]
            blocks = tuple(b for b in blocks if b.scope.fingerprint != MARK_FINGERPRINT)
            if kind == _REMOVED:
                last = events[-1] if events else None
                if isinstance(last, BlockRemoved) and last.medium == medium:
                    last.block_hashes.extend(b.key for b in blocks)
                elif blocks:
                    events.append(
                        BlockRemoved([b.key for b in blocks], medium, locality=LOCAL, ownership=OWNERSHIP)
                    )
            else:
                self._add_stored(events, blocks, medium)
        return events

    def _add_stored(self, events: list[KVCacheEvent], blocks: Sequence[Block], medium: str) -> None:
        """One event per chain: a block stored in the same tier right after its parent joins the
        parent's event (a put stores its chain a block at a time)."""
        for block in blocks:
            last = events[-1] if events else None
            if (
                isinstance(last, BlockStored)
                and last.medium == medium
                and block.parent is not None
                and block.parent == last.block_hashes[-1]
            ):
                last.block_hashes.append(block.key)
                continue
            event = BlockStored(
                block_hashes=[block.key],
                parent_block_hash=block.parent,
                token_ids=[],
                block_size=self._block_size_of(block.scope.fingerprint),
                lora_id=None,
                medium=medium,
                lora_name=None,
                locality=LOCAL,
                ownership=OWNERSHIP,
            )
            events.append(event)

    # ----------------------------------------------------------------- lifecycle, metrics

    def close(self) -> None:
        """Send what is queued, then close the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5.0)
        self._pub.close(linger=0)
        self._ctx.term()

    def collector(self) -> Collector:
        return _EventsCollector(self)


class _EventsCollector(Collector):
    def __init__(self, publisher: EventPublisher) -> None:
        self._p = publisher

    def collect(self) -> Iterator[Any]:
        p = self._p
        yield CounterMetricFamily(
            "kvstore_events_published", "KV cache events sent on events.publish_address", value=p.published
        )
        yield CounterMetricFamily(
            "kvstore_events_dropped",
            "Block changes (a block in a tier) not published: the event queue was full (events.max_queued)",
            value=p.dropped,
        )
        yield GaugeMetricFamily(
            "kvstore_events_queued", "Block changes waiting to be published", value=len(p._queue)
        )


def start_publisher(
    settings: EventsSettings, tier_names: Sequence[str], block_size_of: Callable[[Fingerprint], int]
) -> EventPublisher:
    publisher = EventPublisher(settings, tier_names, block_size_of)
    log.info("publishing KV cache events on %s (topic %r)", publisher.endpoint, settings.topic)
    return publisher
