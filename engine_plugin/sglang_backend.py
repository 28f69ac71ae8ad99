"""kvstore as SGLang HiCache's storage tier (L3): a ``HiCacheStorage`` loaded through ``dynamic``.

    python -m sglang.launch_server --model-path /models/my-model --page-size 32 \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "engine_plugin.sglang_backend", "class_name": "KvstoreHiCacheStorage",
            "address": "unix:///var/lib/kvstore/kvstore.sock", "interface_v1": 1}'

The extra config's own keys (all but ``address`` have a default; SGLang's own are
``backend_name``, ``module_path``, ``class_name`` and ``interface_v1``):

- ``address``: ``unix:///path`` (same host: pages move through the sidecar's mapped arena) or
  ``host:port`` (the data port); default ``$KVSTORE_ADDRESS``;
- the token (``$KVSTORE_TOKEN`` or a 0600 ``token_file``) and ``tls_ca_file``,
  ``tls_cert_file``, ``tls_key_file`` (TCP only): ``engine_plugin.sidecar.SidecarSettings``, as
  for the vLLM connector;
- ``model_path``: the model's local folder, for its weights digest; default SGLang's model name
  when it is a folder, else its snapshot in the Hugging Face cache;
- ``lookup_timeout_s`` (1.0): the deadline of one ``batch_exists``;
- ``min_bytes_per_s`` (100e6): a page read or write slower than this counts as hung; its
  deadline is 0.25 s plus its bytes at this rate.

Order of calls (SGLang's cache controller): ``cls(storage_config, {})`` once per rank, then
``register_mem_pool_host(host_pool)``, which fixes the fingerprint (``engine_plugin.
sglang_identity``). Then, from the controller's threads: ``batch_exists(keys, extra_info)`` on
the prefetch thread; ``batch_get_v1``/``batch_get`` on the prefetch I/O thread;
``batch_set_v1``/``batch_set`` on the backup thread. ``interface_v1: 1`` selects the zero-copy
calls (pages copied between the host pool and the arena once); without it SGLang hands over and
takes flat page tensors. The two order a page's bytes differently for some host layouts, so the
interface is part of the fingerprint. ``clear()`` invalidates this rank's model on the sidecar.

Keys: each SGLang page key (a hex string, salt and ``extra_key`` already chained into it by
SGLang) becomes ``sha256(domain, fingerprint, key)``, stored under the fingerprint; a batch is
one chain, parented on the last of ``extra_info.prefix_keys`` when SGLang passes them.

A sick sidecar never raises into SGLang (``engine_plugin.sidecar``): every call has a deadline;
a timeout or a refused connection is a miss (``batch_exists`` 0, a get False or None, a set
False), opens the circuit breaker for 1 s (doubling to 30 s while probes fail), and meanwhile
calls return misses at once. A block whose length is not the page's is a miss, never served.

Thread rules: each calling thread has its own link (client, breaker); ``close`` closes them all.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine_plugin.sglang_identity import identity_from_sglang, model_folder, page_bytes_of
from engine_plugin.sglang_pages import Page, PageTransfer, flat_page, pointed_pages
from engine_plugin.sidecar import DEADLINE_FLOOR_S, SidecarLink, SidecarSettings, extra_number
from kvstore.client import Client
from kvstore.keys import BlockKey, ModelIdentity

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as exc:  # pragma: no cover - only without sglang installed
    raise ImportError("engine_plugin.sglang_backend needs sglang (scripts/install_sglang.sh)") from exc

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_PAGE_DOMAIN = b"kvstore/sglang-page/v1"


@dataclass(frozen=True)
class BackendConfig:
    """The extra config's keys, parsed once (the module docstring lists them)."""

    sidecar: SidecarSettings  # address, token, TLS
    model_path: str
    zero_copy: bool  # SGLang's interface_v1
    lookup_timeout_s: float = 1.0
    min_bytes_per_s: float = 100e6

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> BackendConfig:
        return cls(
            SidecarSettings.parse(extra, "--hicache-storage-backend-extra-config"),
            str(extra.get("model_path") or ""),
            bool(int(extra.get("interface_v1", 0) or 0)),
            _positive(extra, "lookup_timeout_s", 1.0),
            _positive(extra, "min_bytes_per_s", 100e6),
        )


class KvstoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.config = BackendConfig.parse(storage_config.extra_config or {})
        self.storage_config = storage_config
        self._folder = model_folder(storage_config.model_name, self.config.model_path)
        self._connect: Callable[[], Client] = self.config.sidecar.connect  # tests put a faulty client here
        self.identity: ModelIdentity | None = None
        self._pages: PageTransfer | None = None
        self._local = threading.local()
        self._links: list[SidecarLink] = []
        self._links_lock = threading.Lock()
        self.unreachable = 0  # calls that timed out, failed or were refused by the open breaker

    # ----------------------------------------------------------------- setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        interface = "pieces" if self.config.zero_copy else "flat"
        self.identity = identity_from_sglang(self.storage_config, mem_pool_host, self._folder, interface)
        self._pages = PageTransfer(
            self.identity.fingerprint(), page_bytes_of(mem_pool_host), self.config.sidecar.address.same_host
        )
        log.info(
            "kvstore HiCache storage at %s: model %s, rank %d of %d, fingerprint %s, %d B pages (%s)",
            self.config.sidecar.address,
            self.identity.model_id,
            self.identity.tp_rank,
            self.identity.tp_world_size,
            self.identity.fingerprint().hex()[:16],
            self._pages.page_bytes,
            interface,
        )

    # ----------------------------------------------------------------- lookups

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` kvstore holds."""
        pages = self._transfer()
        hit = self._call(
            "lookup", self.config.lookup_timeout_s, lambda kv: pages.exists(kv, self._keys(keys))
        )
        return hit or 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ----------------------------------------------------------------- zero copy (interface_v1)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices`` (page after page); per
        key, whether it was read (a prefix is True)."""
        n = self._read(keys, self._host_pages(host_indices, len(keys)))
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self._write(keys, self._host_pages(host_indices, len(keys)), extra_info)

    # ----------------------------------------------------------------- copying

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Fill ``target_locations`` (flat pages) with the present prefix; None past it."""
        if target_locations is None:
            pool = self.mem_pool_host
            target_locations = [pool.get_dummy_flat_data_page() for _ in keys]
        n = self._read(keys, [flat_page(t) for t in target_locations])
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        pages = [flat_page(v.contiguous()) for v in values]
        return all(self._write(keys, pages, None))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # ----------------------------------------------------------------- the rest

    def clear(self) -> None:
        """Remove this rank's model's pages from kvstore (SGLang's clear-storage call)."""
        pages = self._transfer()
        self._call("invalidate", self.config.lookup_timeout_s, lambda kv: kv.invalidate(pages.fingerprint))

    def close(self) -> None:
        with self._links_lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    # ----------------------------------------------------------------- plumbing

    def _read(self, keys: list[str], targets: Sequence[Page]) -> int:
        pages = self._transfer()
        timeout_s = self._io_deadline_s(len(keys))
        n = self._call("load", timeout_s, lambda kv: pages.read(kv, self._keys(keys), targets))
        return n or 0

    def _write(self, keys: list[str], sources: Sequence[Page], extra_info: Any) -> list[bool]:
        pages = self._transfer()
        prefix = getattr(extra_info, "prefix_keys", None)
        parent = self._keys(prefix[-1:])[0] if prefix else None
        timeout_s = self._io_deadline_s(len(keys))
        stored = self._call("save", timeout_s, lambda kv: pages.write(kv, self._keys(keys), sources, parent))
        return stored or [False] * len(keys)

    def _host_pages(self, host_indices: torch.Tensor, n_pages: int) -> list[Page]:
        if n_pages == 0:
            return []
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return pointed_pages(pointers, sizes, n_pages)

    def _keys(self, keys: Sequence[str]) -> list[BlockKey]:
        fingerprint = self._transfer().fingerprint
        return [BlockKey(hashlib.sha256(_PAGE_DOMAIN + fingerprint + k.encode()).digest()) for k in keys]

    def _io_deadline_s(self, n_pages: int) -> float:
        return DEADLINE_FLOOR_S + n_pages * self._transfer().page_bytes / self.config.min_bytes_per_s

    def _transfer(self) -> PageTransfer:
        if self._pages is None:
            raise RuntimeError("register_mem_pool_host comes before any storage call")
        return self._pages

    def _call(self, what: str, timeout_s: float, fn: Callable[[Client], _T]) -> _T | None:
        link: SidecarLink | None = getattr(self._local, "link", None)
        if link is None:
            assert self.identity is not None
            link = SidecarLink(self.config.sidecar.address, self._connect, [self.identity], self._unreachable)
            self._local.link = link
            with self._links_lock:
                self._links.append(link)
        return link.call(what, timeout_s, fn)

    def _unreachable(self, what: str) -> None:
        with self._links_lock:
            self.unreachable += 1


def _positive(extra: Mapping[str, Any], name: str, default: float) -> float:
    return extra_number(extra, name, default, "hicache extra config", "a positive number", lambda x: x > 0)
