"""Digests of model files (weights, tokenizer, adapters), cached by path, size and mtime.

Hashing tens of GB of weights at every engine start would make start-up slow, so each file's
SHA-256 is remembered in a small JSON cache keyed by its absolute path, size and modification
time: a file that changed in any of those is hashed again. A folder's digest covers the sorted
relative names and digests of the files it holds that match the given patterns.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "*.model",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
_CHUNK = 8 << 20


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore" / "file-digests.json"


class DigestCache:
    """File digests remembered across processes. Safe for threads; last writer wins on disk."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_cache_path()
        self._lock = threading.Lock()
        try:
            self._entries: dict[str, list[object]] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._entries = {}
        self.hashed_files = 0  # files actually read since this cache was opened

    def file_digest(self, path: Path) -> str:
        path = path.resolve()
        stat = path.stat()
        key = str(path)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == stat.st_size and entry[1] == stat.st_mtime_ns:
                return str(entry[2])
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        with self._lock:
            self._entries[key] = [stat.st_size, stat.st_mtime_ns, digest]
            self.hashed_files += 1
        return digest

    def folder_digest(self, folder: Path, patterns: Iterable[str]) -> str:
        """Digest of the files under ``folder`` matching ``patterns``; "" when none match."""
        patterns = tuple(patterns)
        files = sorted(
            p
            for p in folder.rglob("*")
            if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
        )
        if not files:
            return ""
        h = hashlib.sha256()
        for p in files:
            h.update(str(p.relative_to(folder)).encode() + b"\0" + self.file_digest(p).encode() + b"\n")
        return h.hexdigest()

    def save(self) -> None:
        with self._lock:
            data = json.dumps(self._entries)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(data)
        os.replace(tmp, self.path)
