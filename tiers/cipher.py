"""Encryption at rest for a persistent tier: AES-256-GCM, one key per namespace.

Stored form of a block: nonce (12 random bytes) ‖ ciphertext ‖ tag (16 bytes), the block's tier
key as associated data, so a sealed block cannot be moved under another key. Keys live in a
folder of their own, one file per namespace (``<hex of the namespace>.key``, 32 random bytes,
mode 0600), made the first time a namespace stores a block. Deleting a namespace's key file
(with the server stopped) shreds every block of it on disk: they no longer open, and the tier
treats each as corrupt (a miss, deleted, counted) when it is next read.

``namespace_of`` maps a tier key to the namespace whose key seals it; the tier's owner supplies
it (the tiered store knows the key layout; this package does not import it).

Thread-safe: keys are loaded once per namespace under a lock; AESGCM objects are safe to share.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD_BYTES = NONCE_BYTES + TAG_BYTES


class BlockCipher:
    def __init__(self, keys_dir: str | Path, namespace_of: Callable[[bytes], str]) -> None:
        self._dir = Path(keys_dir)
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self._dir, 0o700)
        self._namespace_of = namespace_of
        self._keys: dict[str, AESGCM | None] = {}
        self._lock = threading.Lock()

    def key_path(self, namespace: str) -> Path:
        return self._dir / f"{namespace.encode().hex()}.key"

    def _aead(self, key: bytes, create: bool) -> AESGCM | None:
        namespace = self._namespace_of(key)
        with self._lock:
            if namespace in self._keys and (self._keys[namespace] is not None or not create):
                return self._keys[namespace]
            path = self.key_path(namespace)
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                if not create:
                    self._keys[namespace] = None  # shredded, or never had a block: nothing opens
                    return None
                raw = secrets.token_bytes(32)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(raw)
                    f.flush()
                    os.fsync(f.fileno())
            aead = AESGCM(raw) if len(raw) == 32 else None
            self._keys[namespace] = aead
            return aead

    def seal_into(self, key: bytes, payload: memoryview, out: memoryview) -> None:
        """nonce ‖ ciphertext ‖ tag of ``payload`` under its namespace's key, into ``out``
        (exactly ``len(payload) + OVERHEAD_BYTES`` long)."""
        aead = self._aead(key, create=True)
        if aead is None:
            raise ValueError(f"the key file of namespace {self._namespace_of(key)!r} is not 32 bytes")
        nonce = secrets.token_bytes(NONCE_BYTES)
        out[:NONCE_BYTES] = nonce
        aead.encrypt_into(nonce, payload, key, out[NONCE_BYTES:])

    def open_into(self, key: bytes, sealed: memoryview, out: memoryview) -> int | None:
        """Decrypt ``sealed`` into ``out``; its length, or None when it does not open (wrong or
        shredded key, tampered bytes)."""
        aead = self._aead(key, create=False)
        n = len(sealed) - OVERHEAD_BYTES
        if aead is None or n < 0 or len(out) < n:
            return None
        try:
            aead.decrypt_into(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], key, out[:n])
        except InvalidTag:
            return None
        return n
