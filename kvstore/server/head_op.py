"""The data port's head request (``kvstore.wire``: op 12), served on the connection's thread:
the first bytes of each block of the present prefix, for a sidecar that checks a shared node's
copies by their header (``tiers.remote``: birth time, fingerprint, a sealed copy's key id)
without moving their payloads. Kept apart from ``kvstore.server.dataport_ops``, which only
dispatches to it: the request is scoped (namespace from the connection's hello, as a get's) and
read out of the store like a get, less the promotion and the hit."""

from __future__ import annotations

from kvstore import wire
from kvstore.server.dataplane import DataPlane
from kvstore.store import Scope
from kvstore.stream import Stream


def serve_heads(stream: Stream, plane: DataPlane, namespace: str, max_keys: int) -> None:
    fingerprint, keys = wire.read_keys(stream.read, max_keys)
    head_bytes = wire.read_head_bytes(stream.read)
    heads = plane.heads(Scope(namespace, fingerprint), keys, head_bytes)
    stream.send(wire.heads_answer(heads))
