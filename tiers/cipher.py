"""Encryption at rest for a persistent tier: AES-256-GCM, one key per namespace.

Stored form of a block: nonce (12 random bytes) ‖ ciphertext ‖ tag (16 bytes), the block's tier
key as associated data, so a sealed block cannot be moved under another key. Keys live in a
folder of their own, one file per namespace (``<hex of the namespace>.key``, 32 random bytes,
mode 0600), made the first time a namespace stores a block (atomically: sidecars of a fleet may
share the folder, see ``tiers.sealed_remote``). Deleting a namespace's key file
shreds every block of it on disk: they no longer open, and the tier treats each as corrupt (a
miss, deleted, counted) when it is next read. While a server runs, ``vanished`` (called every
second by ``kvstore.server.shredding``) notices a deleted key file and forgets the key, and
``shred`` deletes one; the server then drops the namespace's copies in every tier.

``namespace_of`` maps a tier key to the namespace whose key seals it; the tier's owner supplies
it (the tiered store knows the key layout; this package does not import it).

Thread-safe: keys are loaded once per namespace under a lock; AESGCM objects are safe to share.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tiers.durable import fsync_dir

if TYPE_CHECKING:  # cryptography is the encryption extra: imported when a cipher is made
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD_BYTES = NONCE_BYTES + TAG_BYTES
KEY_ID_BYTES = 8
# a key's id is its GCM tag over nothing under this nonce: random nonces (2^-96 of hitting it)
# never meet it with a payload, so it reveals nothing of the key or of any block
_KEY_ID_NONCE = b"kvstore-kid\0"


class BlockCipher:
    def __init__(self, keys_dir: str | Path, namespace_of: Callable[[bytes], str]) -> None:
        """Raises ModuleNotFoundError without cryptography (pip install 'kvstore[encryption]')."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aesgcm = AESGCM
        self._invalid_tag = InvalidTag
        self._dir = Path(keys_dir)
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self._dir, 0o700)
        self._namespace_of = namespace_of
        self._keys: dict[str, AESGCM | None] = {}
        # each key file there is, at start or once loaded or made: (path, (device, inode))
        self._files: dict[str, tuple[str, tuple[int, int]]] = dict(_key_files(self._dir))
        self._lock = threading.Lock()

    def namespace_of(self, key: bytes) -> str:
        """The namespace whose key seals ``key``."""
        return self._namespace_of(key)

    def key_path(self, namespace: str) -> Path:
        return self._dir / f"{namespace.encode().hex()}.key"

    def _aead(self, key: bytes, create: bool) -> AESGCM | None:
        namespace = self._namespace_of(key)
        with self._lock:
            aead = self._keys.get(namespace)
            if aead is not None:
                return aead
            # no key known: the folder is asked each time (a failed open, only on this rare path),
            # because a sidecar sharing it may make the namespace's key after this one first
            # looked; remembering "none" would leave its copies unopenable here until this
            # sidecar sealed a block of its own
            path = self.key_path(namespace)
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                if not create:
                    return None  # shredded, or never had a block: nothing opens
                raw = _make_key_file(path)
            aead = self._aesgcm(raw) if len(raw) == 32 else None
            self._keys[namespace] = aead
            file_id = _file_id(str(path))
            if aead is not None and file_id is not None:
                self._files[namespace] = (str(path), file_id)
            return aead

    def shred(self, namespace: str) -> bool:
        """Delete the namespace's key file and forget its key: none of its sealed blocks opens
        again (a block stored later is sealed under a new key). Whether a key file was there."""
        with self._lock:
            self._keys[namespace] = None
            self._files.pop(namespace, None)
            try:
                self.key_path(namespace).unlink()
            except FileNotFoundError:
                return False
            fsync_dir(self._dir)  # a shredded key must not come back after a crash
            return True

    def vanished(self) -> list[str]:
        """The namespaces whose key file was deleted or replaced since the start (or since their
        key was loaded or made), their keys forgotten now: a ``stat`` per key file, so call it
        every second or so, not per block. Deleting a key file while the server runs shreds like
        ``shred``. The stats run outside the lock, which every seal and open takes."""
        with self._lock:
            loaded = list(self._files.items())
        gone = [(ns, entry) for ns, entry in loaded if _file_id(entry[0]) != entry[1]]
        with self._lock:
            forgotten = [ns for ns, entry in gone if self._files.get(ns) is entry]  # not reloaded since
            for namespace in forgotten:
                self._keys[namespace] = None
                del self._files[namespace]
        return forgotten

    def key_id(self, key: bytes) -> bytes | None:
        """``KEY_ID_BYTES`` naming the key of ``key``'s namespace here, None without one (shredded,
        never made): a copy tagged with another id was sealed under another key and will not
        open, which a lookup can tell from the copy's first bytes (``tiers.sealed_remote``)."""
        aead = self._aead(key, create=False)
        if aead is None:
            return None
        return aead.encrypt(_KEY_ID_NONCE, b"", b"kvstore key id")[:KEY_ID_BYTES]

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
        except self._invalid_tag:
            return None
        return n


def _make_key_file(path: Path) -> bytes:
    """A new key at ``path``, or the one another sidecar sharing the folder made first: the
    key is written whole to a file of its own, then linked in place (atomic, and refused when
    the name exists), so no sidecar ever reads a half-written key or replaces another's."""
    raw = secrets.token_bytes(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return path.read_bytes()
        fsync_dir(path.parent)
        return raw
    finally:
        tmp.unlink()


def _key_files(folder: Path) -> Iterator[tuple[str, tuple[str, tuple[int, int]]]]:
    """(namespace, (path, file id)) of each key file in ``folder``."""
    for path in folder.glob("*.key"):
        file_id = _file_id(str(path))
        try:
            namespace = bytes.fromhex(path.stem).decode()
        except ValueError:
            continue  # not one of ours
        if file_id is not None:
            yield namespace, (str(path), file_id)


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
