"""The sidecar's KV event feed, followed by the connector's scheduler side, so that a saved
block the sidecar lets go reaches vLLM's publisher as a ``BlockRemoved`` under vLLM's hash.

With ``kv_connector_extra_config["sidecar_events"]`` (the sidecar's ``events.publish_address``)
the connector ``watch``es each block it announced (its kvstore key on tensor-parallel rank 0,
and the hash vLLM knows it by). A thread follows the feed into an index of what the sidecar
holds (``kvstore.kv_events.SidecarIndex``); when a watched key is held in no tier any more
(evicted from the last one, deleted, invalidated) its vLLM hash is queued for ``take_removed``.
A demotion (dram to nvme) is no removal: the block is still restorable, and the engine's feed
keeps calling it ``CPU`` (kvstore, on this host).

Bounds: at most ``MAX_WATCHED`` blocks are watched, the oldest forgotten first (a forgotten
block's eviction goes unannounced). Only rank 0's copy is watched: a block another rank's
sidecar lets go alone is not announced. The feed has no history: blocks evicted while the
scheduler was not subscribed (before it started) are not announced.

Threads: ``watch`` and ``take_removed`` on vLLM's scheduler thread, the follower on its own;
one lock between them. Needs pyzmq and msgspec (vLLM brings both), imported when a feed is
followed, so that the module imports wherever the connector's other modules do.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from kvstore.extras import require

log = logging.getLogger(__name__)

MAX_WATCHED = 1 << 18  # blocks watched at most (about 200 B each)
_POLL_MS = 200


class SidecarFeed:
    """See the module docstring."""

    def __init__(self, endpoint: str) -> None:
        for module in ("zmq", "msgspec"):
            require(module, 'kv_connector_extra_config["sidecar_events"]')
        import zmq

        from kvstore.kv_events import SidecarIndex

        self._lock = threading.Lock()
        self._index = SidecarIndex()
        self._watched: collections.OrderedDict[bytes, bytes | int] = collections.OrderedDict()
        self._removed: list[bytes | int] = []
        self._ctx: Any = zmq.Context()
        self._sub: Any = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="kvstore-sidecar-feed", daemon=True)
        self._thread.start()

    def watch(self, key: bytes, vllm_hash: bytes | int) -> None:
        with self._lock:
            self._watched[key] = vllm_hash
            self._watched.move_to_end(key)
            while len(self._watched) > MAX_WATCHED:
                self._watched.popitem(last=False)

    def take_removed(self) -> list[bytes | int]:
        """vLLM hashes of watched blocks the sidecar no longer holds, since the last call."""
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    def _follow(self) -> None:
        from kvstore.kv_events import AllBlocksCleared, BlockRemoved, decoder, sequence_of

        decode = decoder().decode
        while not self._stop.is_set():
            if not self._sub.poll(_POLL_MS):
                continue
            _topic, seq, payload = self._sub.recv_multipart()
            try:
                batch = decode(payload)
            except ValueError as exc:  # msgspec.DecodeError: not a KV event batch
                log.warning("a sidecar event batch did not decode: %s", exc)
                continue
            with self._lock:
                self._index.apply(sequence_of(seq), batch)
                for event in batch.events:
                    if isinstance(event, AllBlocksCleared):
                        self._removed.extend(self._watched.values())
                        self._watched.clear()
                    elif isinstance(event, BlockRemoved):
                        for key in event.block_hashes:
                            if (
                                isinstance(key, bytes)
                                and key in self._watched
                                and key not in self._index.copies
                            ):
                                self._removed.append(self._watched.pop(key))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sub.close(linger=0)
        self._ctx.term()
