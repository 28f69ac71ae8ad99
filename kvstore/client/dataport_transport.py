"""The data-port transport: every data call over the server's raw data port (TCP; its Unix
twin is ``samehost_transport``), on the calling thread's connection for the call's scope
(``kvstore.client.connections``), the protocol being ``kvstore.wire``."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.client.connections import DataConnections
from kvstore.client.mapping import ArenaMapping
from kvstore.client.pool import ReceivePool
from kvstore.client.results import Lookup
from kvstore.client.transport import Blocks, Reserved, Resolved, read_resolved, write_reserved
from kvstore.wire import TIER_NAMES


class DataPortTransport:
    def __init__(self, connections: DataConnections, mapping: ArenaMapping) -> None:
        self._data = connections
        self._mapping = mapping

    def lookup(self, fingerprint: bytes, keys: Sequence[bytes], scope: str) -> int:
        hit, _, _ = self._data.call(scope, lambda c: c.lookup(fingerprint, keys))
        return hit

    def lookup_tiers(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float, scope: str, slots: bool
    ) -> Lookup:
        hit, codes, lease_id = self._data.call(scope, lambda c: c.lookup(fingerprint, keys, pin_ttl_s))
        return Lookup(hit, tuple(TIER_NAMES.get(code, "unknown") for code in codes), lease_id)

    def release(self, lease_id: int, wait: bool) -> None:
        self._data.call("", lambda c: c.release(lease_id, wait))

    def lease_held(self, lease_id: int) -> bool:
        return bool(self._data.call("", lambda c: c.lease_held(lease_id)))

    def get(
        self, fingerprint: bytes, keys: Sequence[bytes], scope: str, pool: ReceivePool
    ) -> list[memoryview]:
        pool.begin()
        return self._data.call(scope, lambda c: c.get(fingerprint, keys, pool.take))

    def get_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str, exact: bool
    ) -> int:
        return self._data.call(scope, lambda c: c.get_into(fingerprint, keys, outs, exact))

    def heads(self, fingerprint: bytes, keys: Sequence[bytes], head_bytes: int, scope: str) -> list[bytes]:
        return self._data.call(scope, lambda c: c.heads(fingerprint, keys, head_bytes))

    def put(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> int:
        return self._data.call(scope, lambda c: c.put(fingerprint, keys, blocks, parent))

    def resolve(self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float, scope: str) -> Resolved:
        return self._data.call(scope, lambda c: c.resolve(fingerprint, keys, ttl_s))

    def reserve(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None,
        ttl_s: float,
        scope: str,
    ) -> Reserved:
        return self._data.call(scope, lambda c: c.reserve(fingerprint, keys, sizes, parent, ttl_s))

    def commit(self, reservation_id: int, scope: str, checksums: Sequence[int] = ()) -> int:
        return self._data.call(scope, lambda c: c.commit(reservation_id, checksums))

    def abort(self, reservation_id: int, scope: str) -> None:
        self._data.call(scope, lambda c: c.abort(reservation_id))

    def read_into(
        self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview], scope: str
    ) -> int:
        return read_resolved(self, self._mapping, fingerprint, keys, outs, scope)

    def write(
        self, fingerprint: bytes, keys: Sequence[bytes], blocks: Blocks, parent: bytes | None, scope: str
    ) -> tuple[int, list[int]]:
        return write_reserved(self, self._mapping, fingerprint, keys, blocks, parent, scope)
