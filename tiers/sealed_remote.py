"""Encryption beyond the host: every copy a sidecar sends to the fleet's remote tier is sealed
under its tenant's key, whatever the backend (kvstore nodes, Redis Cluster, Mooncake).

``SealedRemote`` wraps a ``RemoteTier``: ``put_many`` hands the backend key id ‖ nonce ‖
ciphertext ‖ tag of each payload (``BlockCipher.seal_into``: AES-256-GCM under the key of the
block's namespace, the tier key, which carries namespace, fingerprint and block key, as
associated data; ``BlockCipher.key_id``: 8 bytes naming that key), and ``get_many`` opens what
comes back. The backend frames the sealed bytes as it frames any payload (its header, checksum
and any birth time stay its own), so sealing adds 36 bytes per block and changes nothing else on
the medium.

A copy that does not open (the tenant's key was shredded, this sidecar never had it, the bytes
were altered, or moved under another key) is a miss: counted in ``usage().unsealable`` and
deleted from the backend, as a failed checksum is. Keys come from the same folder as the nvme
tier's (``nvme.encryption_keys_dir``): the sidecars of a fleet read one shared folder, so a key
made by one is used by all, and a shred at one (or deleting the file) is seen by every other
within ``kvstore.server.shredding.KEY_CHECK_S``.

``heads`` (what a lookup promises) reads each copy's key id with its header: a copy sealed under
a key this sidecar does not hold (another, a shredded one, none) is not promised (counted and
deleted, as a get would), so a lookup reports no more than a restore gets, short of a copy
altered in place, which only opening the whole payload reveals. ``contains`` (raw presence) is
the backend's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

from tiers.base import BytesLike, TierKey
from tiers.cipher import KEY_ID_BYTES, OVERHEAD_BYTES, BlockCipher
from tiers.remote import RemoteBlock, RemoteTier, RemoteUsage

SEALED_OVERHEAD_BYTES = KEY_ID_BYTES + OVERHEAD_BYTES

log = logging.getLogger(__name__)


class SealedRemote(RemoteTier):
    def __init__(self, inner: RemoteTier, cipher: BlockCipher, plain: frozenset[bytes] = frozenset()) -> None:
        """``plain``: fingerprints whose values are the fleet's own bookkeeping, no tenant's data
        (the invalidation marks): left unsealed, so a shred cannot hide an invalidation."""
        self.inner = inner
        self.cipher = cipher
        self._plain = plain
        self.name = inner.name
        self._lock = threading.Lock()
        self._unsealable = 0

    def contains(self, keys: Sequence[TierKey]) -> list[bool]:
        return self.inner.contains(keys)

    def get_many(
        self,
        keys: Sequence[TierKey],
        fingerprint: bytes,
        not_before_s: float = 0.0,
        born: list[float] | None = None,
    ) -> list[BytesLike | None]:
        first = 0 if born is None else len(born)
        got = self.inner.get_many(keys, fingerprint, not_before_s, born)
        if fingerprint in self._plain:
            return got
        out: list[BytesLike | None] = []
        unopened: list[TierKey] = []
        ids = _KeyIds(self.cipher)
        for i, (key, sealed) in enumerate(zip(keys, got, strict=True)):
            if sealed is None:
                out.append(None)
                continue
            view = memoryview(sealed).cast("B")
            plain = bytearray(max(0, len(view) - SEALED_OVERHEAD_BYTES))
            opened = bytes(view[:KEY_ID_BYTES]) == ids.of(key)  # another key's copy is not even tried
            if (
                not opened
                or self.cipher.open_into(bytes(key), view[KEY_ID_BYTES:], memoryview(plain)) is None
            ):
                unopened.append(key)
                out.append(None)
                if born is not None:
                    born[first + i] = 0.0  # a miss has no birth time
            else:
                out.append(plain)
        self._unopened(unopened)
        return out

    def _unopened(self, keys: list[TierKey]) -> None:
        """Count and delete copies that do not open here."""
        if keys:
            log.warning(
                "remote tier %s: %d copies did not open (key shredded or absent, or altered); deleted",
                self.name,
                len(keys),
            )
            with self._lock:
                self._unsealable += len(keys)
            self.inner.delete_many(keys)

    def heads(
        self, keys: Sequence[TierKey], fingerprint: bytes, not_before_s: float = 0.0, n: int = 0
    ) -> list[bytes | None]:
        """The backend's heads, less those of copies sealed under a key other than this
        sidecar's for their namespace (each head is of the sealed bytes, after the key id):
        those are counted and deleted, as ``get_many`` would."""
        if fingerprint in self._plain:
            return self.inner.heads(keys, fingerprint, not_before_s, n)
        got = self.inner.heads(keys, fingerprint, not_before_s, KEY_ID_BYTES + n)
        ids = _KeyIds(self.cipher)
        out: list[bytes | None] = []
        unopened: list[TierKey] = []
        for key, head in zip(keys, got, strict=True):
            if head is not None and head[:KEY_ID_BYTES] != ids.of(key):
                unopened.append(key)
                head = None
            out.append(None if head is None else head[KEY_ID_BYTES:])
        self._unopened(unopened)
        return out

    def put_many(self, blocks: Sequence[RemoteBlock]) -> int:
        sealed: list[RemoteBlock] = []
        ids = _KeyIds(self.cipher)
        for block in blocks:
            if block.fingerprint in self._plain:
                sealed.append(block)
                continue
            view = memoryview(block.payload).cast("B")
            out = bytearray(len(view) + SEALED_OVERHEAD_BYTES)
            try:
                self.cipher.seal_into(bytes(block.key), view, memoryview(out)[KEY_ID_BYTES:])
                kid = ids.of(block.key)  # after the seal, which makes a namespace's first key
                if kid is None:
                    raise ValueError("the key went while sealing")
                out[:KEY_ID_BYTES] = kid
            except (ValueError, OSError) as exc:  # a bad or unwritable key file: never sent plain
                log.warning("remote tier %s: a block not sealed, not sent: %s", self.name, exc)
                continue
            sealed.append(dataclasses.replace(block, payload=out))
        return self.inner.put_many(sealed)

    def claim(self, block: RemoteBlock) -> bool | None:
        if block.fingerprint not in self._plain:
            raise ValueError("only plain blocks (the fleet's marks) are claimed")
        return self.inner.claim(block)

    def carries(self, namespace: str) -> bool:
        return self.inner.carries(namespace)

    def delete_many(self, keys: Sequence[TierKey]) -> int:
        return self.inner.delete_many(keys)

    def delete_matching(self, prefix: bytes, spare: bytes = b"") -> int:
        return self.inner.delete_matching(prefix, spare)

    def usage(self) -> RemoteUsage:
        with self._lock:
            unsealable = self._unsealable
        return dataclasses.replace(self.inner.usage(), unsealable=unsealable)

    def close(self) -> None:
        self.inner.close()


class _KeyIds:
    """Each namespace's key id, looked up once per batch."""

    def __init__(self, cipher: BlockCipher) -> None:
        self._cipher = cipher
        self._ids: dict[str, bytes | None] = {}

    def of(self, key: bytes) -> bytes | None:
        namespace = self._cipher.namespace_of(key)
        if namespace not in self._ids:
            self._ids[namespace] = self._cipher.key_id(bytes(key))
        return self._ids[namespace]
