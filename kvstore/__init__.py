"""kvstore: tiered KV-cache offload storage for LLM serving.

    from kvstore import ModelIdentity, block_keys, connect

    with connect("unix:///run/kvstore/kvstore.sock") as kv:
        fp = kv.register(identity)
        n = kv.lookup(fp, block_keys(fp, token_ids, identity.tokens_per_block))

What a user of the client needs is here: ``connect`` and ``Client`` (``kvstore.client``), what
its calls return, ``ClientTls`` (``kvstore.tls``), the identity and key functions
(``kvstore.keys``) and the error classes (``kvstore.errors``). All but the errors are imported
on first use, so ``import kvstore`` itself loads no gRPC and no numpy until a name is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.errors import *  # noqa: F403  (cheap: they import nothing)

if TYPE_CHECKING:  # what the lazy names below are, for type checkers
    from kvstore.client import Client, Lookup, PendingWrite, ResolvedBlocks, connect
    from kvstore.keys import BlockKey, Fingerprint, ModelIdentity, block_keys, root_key
    from kvstore.tls import ClientTls

    __version__: str

_HOMES = {
    **dict.fromkeys(("Client", "Lookup", "PendingWrite", "ResolvedBlocks", "connect"), "kvstore.client"),
    **dict.fromkeys(("BlockKey", "Fingerprint", "ModelIdentity", "block_keys", "root_key"), "kvstore.keys"),
    "ClientTls": "kvstore.tls",
}
__all__ = ["BlockKey", "Client", "ClientTls", "Fingerprint", "Lookup", "ModelIdentity", "PendingWrite"]
__all__ += ["ResolvedBlocks", "__version__", "block_keys", "connect", "root_key"]
__all__ += errors.__all__


def __getattr__(name: str) -> object:
    if name == "__version__":
        value: object = _version()
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstore")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
