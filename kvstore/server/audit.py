"""The audit log: who removed or moved which blocks, and which admin acted on another tenant.

Fails closed: an admin action (delete, invalidate, demote, shred) is recorded, on disk, before
it takes effect, and one whose record cannot be written is refused (``AuditNotWritten``) and
not done. ``action`` writes an *intent* record and fsyncs it, runs the action, then writes its
*done* record (the outcome: how many blocks, or the error), best effort and not fsynced: the
action has happened by then, and an intent without its done record reads as attempted.

Records are lines in ``server.audit_log`` (default ``<data_dir>/audit.log``, mode 0600, appended,
never rewritten): ``<crc32 of the JSON, 8 hex digits> <JSON object>\\n``, each one ``os.write``
on an ``O_APPEND`` descriptor. A line cut short (a crash mid-write, a full disk) or damaged fails
its checksum and is skipped by ``read_audit``, counted; a failed write is truncated away at once,
and the next record starts on a fresh line whatever the file's tail holds. A record holds
identities and hashes only: never a token, never prompt text, never block bytes (a block key is
a one-way hash of its tokens).

Thread-safe: one lock around each record's write, fsync and repair.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import AuditNotWritten

log = logging.getLogger(__name__)

MAX_KEYS_LISTED = 64  # a delete of more keys records their count and the first ones


class AuditLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._fresh_line = not _ends_mid_line(self._fd)  # a torn tail: start the next record anew

    @contextlib.contextmanager
    def action(
        self,
        tenant: str,
        action: str,
        *,
        namespace: str | None,
        fingerprint: bytes | None = None,
        keys: Sequence[bytes] = (),
    ) -> Iterator[Callable[[int], None]]:
        """Record the intent (raises ``AuditNotWritten`` when it cannot: the caller must not act),
        run the body, then record its outcome, which the body passes to the callable it gets."""
        entry: dict[str, object] = {
            "id": secrets.token_hex(8),
            "tenant": tenant,
            "action": action,
            "namespace": namespace if namespace is not None else "*",
        }
        if fingerprint is not None:
            entry["fingerprint"] = fingerprint.hex()
        if keys:
            entry["keys"] = len(keys)
            entry["key_hashes"] = [k.hex() for k in keys[:MAX_KEYS_LISTED]]
        try:
            self.write({**entry, "phase": "intent"})
        except OSError as exc:
            raise AuditNotWritten(
                f"{action} refused and not done: its audit record cannot be written to "
                f"{self.path} ({exc.strerror or exc}); make room there (or fix server.audit_log) "
                "and retry"
            ) from None
        outcome: list[int] = []
        done = {k: entry[k] for k in ("id", "tenant", "action", "namespace")} | {"phase": "done"}
        try:
            yield outcome.append
        except Exception as exc:
            self._done({**done, "error": type(exc).__name__})
            raise
        self._done({**done, "outcome": outcome[0] if outcome else None})

    def _done(self, entry: dict[str, object]) -> None:
        try:
            self.write(entry, sync=False)  # one fsync per action: a done record lost reads as attempted
        except OSError as exc:  # done already: the intent on disk says it was attempted
            log.error("audit log %s: the outcome of %s %s not recorded: %s", self.path, *_ids(entry), exc)

    def write(self, entry: dict[str, object], sync: bool = True) -> None:
        """Append one record (and fsync it); raises OSError, leaving no part of it in the file."""
        body = json.dumps({"time": round(time.time(), 3), **entry}, sort_keys=True).encode()
        line = b"%08x %s\n" % (zlib.crc32(body), body)
        with self._lock:
            if not self._fresh_line:
                line = b"\n" + line
            size = os.fstat(self._fd).st_size
            try:
                written = os.write(self._fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes", self.path)
                if sync:
                    os.fsync(self._fd)
            except OSError:
                self._cut(size)
                raise
            self._fresh_line = True

    def _cut(self, size: int) -> None:
        """Under the lock, after a failed write: truncate its part away (freeing, not taking,
        room); where even that fails, the next record starts on a new line."""
        try:
            os.ftruncate(self._fd, size)
            self._fresh_line = size == 0 or not _ends_mid_line(self._fd)
        except OSError as exc:
            log.error("audit log %s: a torn record stays at the end (%s); readers skip it", self.path, exc)
            self._fresh_line = False

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)


def _ends_mid_line(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def _ids(entry: dict[str, object]) -> tuple[object, object]:
    return entry.get("action"), entry.get("id")


@dataclass
class AuditRead:
    """The records of an audit log: each action's intent with its outcome merged in (``phase``
    ``done``, or ``intent`` where no done record was written), in the log's order, and how many
    lines were skipped as torn or damaged."""

    actions: list[dict[str, object]] = field(default_factory=list)
    skipped: int = 0


def read_audit(path: str | Path) -> AuditRead:
    """Read an audit log, skipping (and counting) every line whose checksum does not hold."""
    read = AuditRead()
    by_id: dict[object, dict[str, object]] = {}
    for raw in Path(path).read_bytes().split(b"\n"):
        if not raw:
            continue  # the end of the file, or the fresh line after a torn record
        entry = _parse(raw)
        if entry is None:
            read.skipped += 1
            continue
        intent = by_id.get(entry.get("id"))
        if entry.get("phase") == "done" and intent is not None:
            intent.update(entry)
        else:
            by_id[entry.get("id")] = entry
            read.actions.append(entry)
    return read


def _parse(raw: bytes) -> dict[str, object] | None:
    crc, _, body = raw.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        entry = json.loads(body)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None
