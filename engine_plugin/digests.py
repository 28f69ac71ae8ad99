"""Digests of model files (weights, tokenizer, adapters): what a fingerprint knows the weights by.

What a model's digest (``model_digest``) covers, exactly: every byte of every file under the
folder whose name matches ``WEIGHT_PATTERNS`` (safetensors, bin, pt, pth, gguf shards) or is
``config.json``, each file by its SHA-256 over its whole contents, and the file's name relative
to the folder. Nothing is sampled: any changed byte of such a file, an added, removed or
renamed shard changes the digest. Other files (the safetensors index, generation_config.json,
README) are not covered; the tokenizer files have their own digest. The folder's own path is
not in it: the same weights copied or mounted anywhere give the same digest.

Cost: hashing reads every weight byte once (SHA-256: 1.4 GiB per core-second measured here,
files hashed on up to 8 threads; a 140 GB checkpoint is over a minute of
disk and CPU), so each file's digest is remembered in a small JSON cache, keyed by the
file itself (device and inode, not its path) and valid while its size, mtime and ctime are
unchanged. ctime cannot be set back by hand, so a file rewritten in place with its size and
mtime restored is hashed again. The stat is taken before the file is read (a write after it
changes the ctime), and no entry is kept for a file that changed within ``_SETTLED_S`` before
its stat (a second write in the same timestamp tick would leave the ctime as it was). A copy at
another path is a new file: hashed once there.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
# The architecture's hyperparameters (norm epsilon, activation, sliding window, ...): a change
# there changes the KV as a change of weights does, and the fingerprint's own fields miss most.
CONFIG_PATTERNS = ("config.json",)
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "*.model",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
_THREADS = min(8, os.cpu_count() or 1)
# A file changed less than this before its stat may change again within the same timestamp
# tick, leaving size, mtime and ctime as the stat saw them: its digest is not kept.
_SETTLED_S = 1.0


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore" / "file-digests.json"


class DigestCache:
    """File digests remembered across processes. Safe for threads; last writer wins on disk."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_cache_path()
        self._lock = threading.Lock()
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            loaded = {}
        # [size, mtime_ns, ctime_ns, digest]; entries of another shape are from older versions
        self._entries: dict[str, list[object]] = (
            {k: v for k, v in loaded.items() if isinstance(v, list) and len(v) == 4}
            if isinstance(loaded, dict)
            else {}
        )
        self.hashed_files = 0  # files actually read since this cache was opened

    def file_digest(self, path: Path) -> str:
        stated_ns = time.time_ns()
        stat = path.stat()  # before reading: a write during the read changes what the cache sees
        key = f"{stat.st_dev}:{stat.st_ino}"
        state = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[:3] == state:
                return str(entry[3])
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        with self._lock:
            self.hashed_files += 1
            if stated_ns - max(stat.st_mtime_ns, stat.st_ctime_ns) > _SETTLED_S * 1e9:
                self._entries[key] = [*state, digest]
        return digest

    def model_digest(self, folder: Path) -> str:
        """The digest a fingerprint knows a model folder by: its weight files and its
        ``config.json``; "" when the folder holds no weight files."""
        weights = _matching(folder, WEIGHT_PATTERNS)
        return self._digest(folder, sorted(weights + _matching(folder, CONFIG_PATTERNS))) if weights else ""

    def folder_digest(self, folder: Path, patterns: Iterable[str]) -> str:
        """Digest of the files under ``folder`` matching ``patterns``; "" when none match."""
        return self._digest(folder, _matching(folder, tuple(patterns)))

    def _digest(self, folder: Path, files: list[Path]) -> str:
        if not files:
            return ""
        # one thread per file up to _THREADS: SHA-256 and reads release the GIL, so the shards of a
        # big checkpoint are hashed on as many cores as the disk can feed
        with ThreadPoolExecutor(min(len(files), _THREADS)) as pool:
            digests = list(pool.map(self.file_digest, files))
        h = hashlib.sha256()
        for p, digest in zip(files, digests, strict=True):
            h.update(str(p.relative_to(folder)).encode() + b"\0" + digest.encode() + b"\n")
        return h.hexdigest()

    def save(self) -> None:
        with self._lock:
            data = json.dumps(self._entries)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(data)
        os.replace(tmp, self.path)


def _matching(folder: Path, patterns: tuple[str, ...]) -> list[Path]:
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
    )
