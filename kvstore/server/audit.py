"""The audit log: who removed or moved which blocks, and which admin acted on another tenant.

One JSON object per line in ``server.audit_log`` (default ``<data_dir>/audit.log``, mode 0600,
appended, never rewritten): time, the calling tenant, the action, the namespace acted on, the
fingerprint, the block keys (their hashes) or their count, and the outcome. It records
identities and hashes only: never a token, never prompt text, never block bytes (a block key is
a one-way hash of its tokens).

Thread-safe: one ``os.write`` per record on an ``O_APPEND`` descriptor keeps lines whole.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

MAX_KEYS_LISTED = 64  # a delete of more keys records their count and the first ones


class AuditLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def record(
        self,
        tenant: str,
        action: str,
        *,
        namespace: str | None,
        fingerprint: bytes | None = None,
        keys: Sequence[bytes] = (),
        outcome: int,
    ) -> None:
        entry: dict[str, object] = {
            "time": round(time.time(), 3),
            "tenant": tenant,
            "action": action,
            "namespace": namespace if namespace is not None else "*",
            "outcome": outcome,
        }
        if fingerprint is not None:
            entry["fingerprint"] = fingerprint.hex()
        if keys:
            entry["keys"] = len(keys)
            entry["key_hashes"] = [k.hex() for k in keys[:MAX_KEYS_LISTED]]
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        with self._lock:
            try:
                os.write(self._fd, line)
            except OSError as exc:  # a full disk must not fail the request that was audited
                log.error("audit log %s: %s", self.path, exc)

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)
