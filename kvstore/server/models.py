"""The models engines registered: fingerprint -> the identity it was computed from.

The server checks block sizes against the registered layout and shows operators which model a
fingerprint is (``kvstore stats``, ``kvstore invalidate --model``). The registry is kept in
``<data_dir>/models.json`` (mode 0600, rewritten atomically when a new fingerprint arrives), so
after a restart the blocks found on `nvme` still have names before any engine re-registers.

Thread-safe. At most ``MAX_MODELS`` fingerprints in all and ``MAX_MODELS_PER_TENANT`` new ones
per tenant (since the server started): registering one more is refused (RESOURCE_EXHAUSTED), so
no client can grow the map without bound, nor fill it for the others.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from pathlib import Path

from kvstore.errors import ResourceExhausted
from kvstore.keys import ModelIdentity

log = logging.getLogger(__name__)

MAX_MODELS = 4096
MAX_MODELS_PER_TENANT = 256
FILE_NAME = "models.json"


class ModelRegistry:
    def __init__(self, path: Path | None = None) -> None:
        """``path``: the JSON file to keep the registry in; None keeps it in memory only."""
        self._path = path
        self._lock = threading.Lock()
        self._models: dict[bytes, ModelIdentity] = {}
        self._per_tenant: dict[str, int] = {}
        if path is not None:
            self._models = _load(path)

    def register(self, identity: ModelIdentity, tenant: str = "") -> bytes:
        """The identity's fingerprint, recorded (and written down if it is new)."""
        fingerprint = identity.fingerprint()
        with self._lock:
            if fingerprint in self._models:
                return fingerprint
            if len(self._models) >= MAX_MODELS:
                raise ResourceExhausted(
                    f"{MAX_MODELS} model fingerprints are registered already; invalidate old models"
                )
            if self._per_tenant.get(tenant, 0) >= MAX_MODELS_PER_TENANT:
                raise ResourceExhausted(
                    f"tenant {tenant} registered {MAX_MODELS_PER_TENANT} new model fingerprints already"
                )
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
            self._models[fingerprint] = identity
            if self._path is not None:
                _save(self._path, self._models)
        return fingerprint

    def get(self, fingerprint: bytes) -> ModelIdentity | None:
        return self._models.get(fingerprint)


def _load(path: Path) -> dict[bytes, ModelIdentity]:
    try:
        raw = json.loads(path.read_text())
        fields = {f.name for f in dataclasses.fields(ModelIdentity)}
        models = {}
        for hex_fp, entry in raw.items():
            identity = ModelIdentity(**{k: v for k, v in entry.items() if k in fields})
            if identity.fingerprint().hex() == hex_fp:  # a field added since: not this model
                models[bytes.fromhex(hex_fp)] = identity
        return models
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring %s (%s): engines register their models again", path, exc)
        return {}


def _save(path: Path, models: dict[bytes, ModelIdentity]) -> None:
    text = json.dumps({fp.hex(): dataclasses.asdict(i) for fp, i in models.items()}, indent=1)
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:  # the registry is a convenience for operators: serving goes on
        log.warning("cannot write %s: %s", path, exc)
