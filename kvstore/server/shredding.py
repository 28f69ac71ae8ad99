"""Crypto-shredding a tenant while the server runs: on an admin's ``Shred`` call, and when its
key file (``nvme.encryption_keys_dir``) is deleted from under the server.

``shred(namespace)`` deletes the namespace's key file first (no sealed block on disk opens again
from that moment, whatever else fails), then drops every copy the store reaches: the arena's
plaintext copies (what was promoted from nvme included), nvme's, the remote tier's
(``TieredStore.invalidate``). Pinned blocks vanish at once and are freed on their last release.

A key file deleted by hand is noticed by a thread that asks the cipher every KEY_CHECK_S which
key files went (``BlockCipher.vanished``: one ``stat`` per loaded key, nothing on the read path)
and drops the namespace's copies the same way, so within about KEY_CHECK_S no block of it is
served from any tier. That drop is audited (tenant ``-``, action ``shred (key file removed)``)
but never refused when the audit log cannot take it: the key is gone already, and dropping the
copies is the direction that keeps the promise. Without a cipher there is no thread and
``shred`` only drops the copies.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvstore.errors import AuditNotWritten
from kvstore.server.audit import AuditLog
from kvstore.store import TieredStore

if TYPE_CHECKING:  # the cipher's module is not needed (nor its cryptography) without encryption
    from tiers.cipher import BlockCipher

log = logging.getLogger(__name__)

KEY_CHECK_S = 1.0  # how often deleted key files are looked for


def cipher_of(store: TieredStore) -> BlockCipher | None:
    """The cipher sealing the store's persistent tier, or None when nothing is encrypted."""
    for tier in store.tiers:
        inner = getattr(tier, "inner", tier)  # through a Throttled wrapper
        cipher: BlockCipher | None = getattr(inner, "cipher", None)
        if cipher is not None:
            return cipher
    return None


class Shredder:
    def __init__(self, store: TieredStore, audit: AuditLog | None, check_s: float = KEY_CHECK_S) -> None:
        self._store = store
        self._audit = audit
        self._cipher = cipher_of(store)
        self._check_s = check_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._cipher is not None:
            self._thread = threading.Thread(target=self._run, name="kvstore-key-watch", daemon=True)
            self._thread.start()

    def shred(self, namespace: str) -> tuple[int, bool]:
        """Delete the namespace's key, then every copy of its blocks: (blocks dropped, whether a
        key file was deleted)."""
        key_removed = self._cipher.shred(namespace) if self._cipher is not None else False
        removed = self._store.invalidate(namespace=namespace)
        log.warning("shredded %s: key file %s, %d blocks dropped", namespace, _deleted(key_removed), removed)
        return removed, key_removed

    def check(self) -> list[str]:
        """Drop the copies of every namespace whose key file went since the last check."""
        gone = self._cipher.vanished() if self._cipher is not None else []
        for namespace in gone:
            if self._audit is None:
                self._drop(namespace)
                continue
            try:
                with self._audit.action("-", "shred (key file removed)", namespace=namespace) as done:
                    done(self._drop(namespace))
            except AuditNotWritten as exc:  # the key is gone already: drop the copies anyway
                log.error("%s", exc)
                self._drop(namespace)
        return gone

    def _drop(self, namespace: str) -> int:
        removed = self._store.invalidate(namespace=namespace)
        log.warning(
            "the key file of %s was deleted: its %d blocks dropped from every tier", namespace, removed
        )
        return removed

    def _run(self) -> None:
        while not self._stop.wait(self._check_s):
            try:
                self.check()
            except Exception:  # a bug or a tier error must not end the watch: log it, look again
                log.exception("checking the encryption key files failed")

    def close(self) -> None:
        """Stop the watch (before the store closes: a check takes the store's lock)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


def _deleted(key_removed: bool) -> str:
    return "deleted" if key_removed else "absent"
