"""Optional features and the extra (pyproject.toml's ``[project.optional-dependencies]``) that
installs each one's library. ``pip install kvstore`` holds what ``kvstore serve``, ``kvstore
stats`` and the client import; everything else is imported only where it is configured or
asked for, and a missing one is reported in one line naming what to install:

    cryptography   encryption   nvme.encryption_keys_dir (encryption at rest)
    zstandard      zstd         nvme.codec = zstd or zstd-byteplane
    redis          redis        remote.backend = redis
    mooncake       mooncake     remote.backend = mooncake
    torch          engine       the hbm tier, the engine plugins, the benchmarks
    matplotlib     plot         --plot
    aiohttp        router       kvstore route (with transformers, the model's tokenizer)
    zmq, msgspec   events       events.publish_address, kvstore route --follow-events

``require`` checks a configured feature at start (the server refuses to start without it);
``install_hint`` turns any ``ModuleNotFoundError`` of an optional library into that line (the
CLI's one place for them, so a command that reaches one fails with a line, not a traceback).
"""

from __future__ import annotations

import importlib.util

from kvstore.errors import FailedPrecondition

# top-level module -> the extra that installs it
EXTRAS = {
    "cryptography": "encryption",
    "zstandard": "zstd",
    "redis": "redis",
    "mooncake": "mooncake",
    "torch": "engine",
    "matplotlib": "plot",
    "aiohttp": "router",
    "transformers": "router",
    "vllm": "vllm",
    "cupy": "gpu",
    "zmq": "events",
    "msgspec": "events",
}


def install_hint(module: str) -> str | None:
    """'<module> is not installed: pip install 'kvstore[<extra>]'', or None when ``module`` is
    not an optional library of kvstore (a missing required one is a broken install)."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    return None if extra is None else f"{top} is not installed: pip install 'kvstore[{extra}]'"


def require(module: str, setting: str) -> None:
    """Raise FailedPrecondition naming ``setting`` and the extra when ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        extra = EXTRAS.get(module, "")
        raise FailedPrecondition(f"{setting} needs {module}, not installed: pip install 'kvstore[{extra}]'")
