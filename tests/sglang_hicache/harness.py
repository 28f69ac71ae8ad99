"""One HiCache rank's storage side, made of SGLang 0.5.23's own pieces, without an engine.

    rank = Rank(address, folder)                       # the backend from SGLang's factory
    stored = rank.store(RadixKey(tokens))              # the controller's backup of those pages
    restored, pages = rank.restore(RadixKey(tokens))   # its hit query, then its prefetch I/O

- the backend is built by ``StorageBackendFactory.create_backend("dynamic", ...)`` from the same
  extra config an engine gets, then ``register_mem_pool_host`` as the controller does;
- the host pool is SGLang's ``MHATokenToKVPoolHost`` in host memory (``pin_memory=False``: the
  pinning is CUDA's); only the device-side buffers it points at are plain CPU tensors here;
- page keys come from SGLang's ``get_storage_hash_str`` (its C++ hash, the request's salt and
  ``extra_key`` seeding the chain), through the controller's own ``_page_backup``,
  ``_storage_hit_query`` and ``_page_transfer``, whose page functions are picked as
  ``attach_storage_backend`` picks them (zero copy with ``interface_v1``).

Runs only where SGLang is importable (``tests/sglang_hicache/env.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from queue import Queue
from typing import Any

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from engine_plugin.sglang_backend import KvstoreHiCacheStorage

__all__ = ["RadixKey", "Rank", "get_storage_hash_str", "model_folder"]

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
DEVICE_TOKENS = 256  # the host pool holds twice this


def model_folder(root: Path, name: str = "tiny", weights: bytes = b"weights") -> Path:
    """A model folder whose files the fingerprint digests (no real weights are needed)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"rope_theta": 10000.0, "num_hidden_layers": LAYERS}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def host_pool(layout: str, dtype: torch.dtype = torch.bfloat16, page_size: int = PAGE) -> Any:
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    buffers = KVBuffers(
        k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v), layout=KVBufferLayout.NHD
    )
    info = MHABufferInfo(
        buffers=buffers,
        page_size=page_size,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


class Rank:
    def __init__(
        self,
        address: str,
        folder: Path,
        *,
        layout: str = "page_first",
        interface_v1: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        page_size: int = PAGE,
        tp_rank: int = 0,
        tp_size: int = 1,
        is_mla: bool = False,
        token: str | None = None,
        **extra: Any,
    ) -> None:
        self.page_size = page_size
        self.pool = host_pool(layout, dtype, page_size)
        config = HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=is_mla,
            enable_storage_metrics=False,
            is_page_first_layout=layout.startswith("page_first"),
            model_name=str(folder),
            extra_config={
                "backend_name": "kvstore",
                "module_path": "engine_plugin.sglang_backend",
                "class_name": "KvstoreHiCacheStorage",
                "address": address,
                "interface_v1": int(interface_v1),
                **({"token": token} if token else {}),
                **extra,
            },
        )
        self.backend: KvstoreHiCacheStorage = StorageBackendFactory.create_backend(
            "dynamic", config, self.pool
        )
        self.backend.register_mem_pool_host(self.pool)
        self.controller = _controller(self.backend, self.pool, page_size, interface_v1)

    def hashes(self, key: RadixKey) -> list[str]:
        hashes: list[str] = get_storage_hash_str(key, None, page_size=self.page_size)
        return hashes

    def store(self, key: RadixKey, seed: int = 0) -> tuple[int, list[torch.Tensor]]:
        """Fill host pages with random KV, back them up as the controller does; the tokens it
        counts as stored, and the pages' flat contents."""
        hashes = self.hashes(key)
        indices = self.pool.alloc(len(hashes) * self.page_size)
        generator = torch.Generator().manual_seed(seed)
        pages = []
        for i in range(len(hashes)):
            flat = self.pool.get_dummy_flat_data_page()
            flat.copy_(torch.randn(flat.shape, generator=generator).to(flat.dtype))
            self.pool.set_from_flat_data_page(int(indices[i * self.page_size]), flat)
            pages.append(flat)
        operation = StorageOperation(indices, key, hash_value=hashes)
        self.controller._page_backup(operation)
        self.pool.free(indices)
        return operation.completed_tokens, pages

    def hit_tokens(self, key: RadixKey) -> int:
        _, hit = self.controller._storage_hit_query(PrefetchOperation("req", key))
        return int(hit)

    def restore(self, key: RadixKey) -> tuple[int, list[torch.Tensor]]:
        """The controller's hit query, then its prefetch of the hit pages into host pages zeroed
        first; the pages it read, and the contents of one host page per page of ``key``."""
        operation = PrefetchOperation("req", key)
        operation.hash_value, _ = self.controller._storage_hit_query(operation)
        n_pages = len(self.hashes(key))
        indices = self.pool.alloc(n_pages * self.page_size)
        starts = [int(indices[i * self.page_size]) for i in range(n_pages)]
        for start in starts:
            self.pool.set_from_flat_data_page(start, self.pool.get_dummy_flat_data_page())
        operation.host_indices = indices[: len(operation.hash_value) * self.page_size]
        read = self.controller._page_transfer(operation)
        pages = [self.pool.get_data_page(start).clone() for start in starts]
        self.pool.free(indices)
        return read, pages

    def close(self) -> None:
        self.backend.close()


def _controller(backend: Any, pool: Any, page_size: int, interface_v1: bool) -> Any:
    """The storage half of SGLang's cache controller around ``backend``: its own methods, with
    the attributes ``attach_storage_backend`` sets for them (no threads, no process groups)."""
    controller = HiCacheController.__new__(HiCacheController)
    controller.page_size = page_size
    controller.mem_pool_host = controller.storage_host_pool = pool
    controller.storage_backend = backend
    controller.prefetch_sync_queue = Queue()
    if interface_v1:  # as attach_storage_backend chooses for a "dynamic" backend
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
    else:
        controller.page_get_func = controller._generic_page_get
        controller.page_set_func = controller._generic_page_set
    return controller
