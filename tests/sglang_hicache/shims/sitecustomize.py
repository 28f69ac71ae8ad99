"""Test-only patches that let SGLang 0.5.23's engine run HiCache on CPU torch (never shipped).

Python imports this module at the start of every process whose PYTHONPATH holds this folder:
the test processes of tests/sglang_backend_cases.py and the engine's spawned scheduler
processes alike. Each patch is applied right after SGLang's own module runs, and only to SGLang
0.5.23 (another release: the import fails, saying so):

- ``HostKVCache``: ``pin_memory=False``. Pinning host memory is a CUDA call (cudaHostRegister);
  on CPU torch it raises. What pinning buys (fast asynchronous copies) only a GPU run can show.
- ``pool_host.mha.transfer_kv_direct``: SGLang imports its device<->host copy for CUDA, HIP and
  XPU only (from sgl_kernel); here a plain torch index copy, for ``hicache_io_backend="direct"``
  with the ``layer_first`` layout.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

PATCHED_VERSION = "0.5.23"


def _host_pool_unpinned(module: types.ModuleType) -> None:
    init = module.HostKVCache.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    module.HostKVCache.__init__ = __init__


def transfer_kv_direct(
    src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """sgl_kernel's ``transfer_kv_direct``: per layer, ``dst[dst_indices] = src[src_indices]``."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device).long()] = src[src_indices.to(src.device).long()].to(dst.device)


def _mha_direct_copy(module: types.ModuleType) -> None:
    module.transfer_kv_direct = transfer_kv_direct


_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.base": _host_pool_unpinned,
    "sglang.srt.mem_cache.pool_host.mha": _mha_direct_copy,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        version = importlib.metadata.version("sglang")
        if version != PATCHED_VERSION:
            raise ImportError(f"tests/sglang_hicache/shims patch sglang {PATCHED_VERSION}, found {version}")
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
