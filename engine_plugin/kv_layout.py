"""How one kvstore block maps onto vLLM's paged KV cache tensors, per layer.

A kvstore block is one vLLM block (``block_size`` tokens) of every layer of this rank, layer
after layer in the order vLLM registered its caches; within a layer, the bytes of that block
where the cache lays them out, in memory order: its *places* (``engine_plugin.cache_layout``,
which says which layouts are accepted — every one vLLM 0.32 hands a connector — and refuses any
other when the caches are registered, with the list). Copies run on whatever device the cache
lives on: host to host on CPU; on CUDA, between the pinned arena (or a pinned staging buffer)
and the device on the copier's own streams, the engine's stream waiting on events, never the
device (``engine_plugin.device_copy``). The CUDA paths are exercised by the ``gpu``-marked tests.

Many blocks at once (``BlockCopier``, what the connector uses): on CPU caches, by address, every
id and size checked first. With the native copier (``engine_plugin/native/blockcopy.c``, built by
the install where a C compiler is present) one C call copies every slice of every block, without
the GIL, on up to ``COPY_THREADS`` threads for a large copy; a layer-wise load
(``start_by_layer``) runs beside the forward on one thread started in C. Without it, numpy
copies (see ``BlockCopier``), layer-wise ones on the caller's loader thread. At
vLLM's block sizes (tens of KiB per layer) a torch ``copy_`` per slice costs more in dispatch and
view building than in moving bytes: a 3,000-token restore of the 8-layer test model took ~7 ms
that way against ~3 ms by address, and a single memcpy of the same bytes ~1.3 ms. On CUDA caches,
and wherever ``by_address=False``, whole blocks are staged on the caches' device and each slice
of a batch moves in one kernel (``engine_plugin.device_copy``); the tests run every path on the
CPU, and the staged one on CUDA too (``gpu``).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from engine_plugin import host_buffers
from engine_plugin.cache_layout import BLOCK_MAJOR as BLOCK_MAJOR
from engine_plugin.cache_layout import KV_SPLIT as KV_SPLIT
from engine_plugin.cache_layout import LayerLayout as LayerLayout
from engine_plugin.cache_layout import describe as describe
from engine_plugin.device_copy import StagedCopier, rows_of
from engine_plugin.host_buffers import Buffer, address

try:
    from engine_plugin import _blockcopy  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the numpy copies
    _blockcopy = None

# Threads for a whole-block copy of PARALLEL_BYTES or more, where cores are to spare: inside a vLLM
# CPU engine on 2 cores, two threads copied a 3,000-token restore slower than one (2.4-3.9 ms
# against 2.1-2.5), the engine's own threads holding the other core.
COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 4))
PARALLEL_BYTES = 8 << 20
# How often a layer waiting for its copy looks at its progress (a layer of a 3,000-token restore
# copies in ~0.15-0.5 ms here). It sleeps between looks: spinning instead, holding the GIL the
# native copy does not need, made layer-wise restores slower here (1.19x and 1.25x of vLLM's own
# hit against 1.04x-1.09x sleeping), the spin taking the cycles the copy's core shares.
POLL_S = 20e-6


def block_views(
    caches: Sequence[torch.Tensor], layouts: Sequence[LayerLayout], block_id: int
) -> list[torch.Tensor]:
    """The byte views (uint8, flat) that make up block ``block_id``, in stored order."""
    views = []
    for cache, layout in zip(caches, layouts, strict=True):
        flat = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())
        first = int(cache.storage_offset()) * cache.element_size()
        for start, stride, size in layout.places:
            at = first + start + block_id * stride
            views.append(flat[at : at + size])
    return views


def scatter(source: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Copy one stored block (host bytes) into its places in the cache."""
    offset = 0
    for dst in views:
        n = dst.numel()
        dst.copy_(source[offset : offset + n], non_blocking=dst.is_cuda)
        offset += n
    if offset != source.numel():
        raise ValueError(f"a stored block of {source.numel()} B does not fill the {offset} B of its places")


def gather(views: Sequence[torch.Tensor], target: torch.Tensor) -> None:
    """Copy one block's places in the cache into ``target`` (host bytes, e.g. an arena slot)."""
    offset = 0
    for src in views:
        n = src.numel()
        target[offset : offset + n].copy_(src, non_blocking=src.is_cuda)
        offset += n
    if offset != target.numel():
        raise ValueError(f"a block of {offset} B does not fill its {target.numel()} B slot")


def synchronize(caches: Sequence[torch.Tensor]) -> None:
    """Wait for the copies issued on the caches' device (nothing to wait for on the CPU)."""
    if caches and caches[0].is_cuda:
        torch.cuda.current_stream(caches[0].device).synchronize()


@dataclass(frozen=True)
class _Slice:
    """One contiguous place of a block in one layer's cache: block ``b`` lives at
    ``base + b * stride`` for ``size`` bytes (``rows[b]``, a uint8 view), and at ``offset`` in
    the stored block."""

    base: int
    stride: int
    size: int
    offset: int
    rows: np.ndarray | None  # [num_blocks, size] bytes over a host cache itself (else None)


class BlockCopier:
    """Whole blocks between host buffers (arena slots, staging) and one rank's caches.

    ``layers`` (indexes into ``caches``) limits a copy to those layers: layer-wise loading copies
    one layer of every block at a time. Each buffer is one stored block (``block_bytes``); a block
    id outside the caches, or a buffer of another size, is a ValueError before anything is copied.

    By address with the native copier (``native``, the default where it is built): one C call for
    the whole copy, one copy (kv_copy) per slice, block after block. Without it, a run of blocks whose
    buffers are evenly spaced in one buffer (the arena's slots of one chain, a staging buffer)
    moves each layer's slice of the whole run in one numpy copy, indexed by the block ids (vLLM
    hands out ids in any order, often descending); anything else is one memmove per slice. Both
    run in C without torch's thread pool, whose threads, when the cores are busy, made the same
    copy several times slower.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layouts: Sequence[LayerLayout],
        num_blocks: int,
        by_address: bool | None = None,
        native: bool | None = None,
    ) -> None:
        self._caches = list(caches)
        self._layouts = list(layouts)
        self._num_blocks = num_blocks
        host = all(not c.is_cuda for c in self._caches)
        self.by_address = host if by_address is None else (by_address and host)
        if native and _blockcopy is None:
            raise ValueError("the native block copier is not built (no C compiler at install)")
        self.native = self.by_address and (_blockcopy is not None if native is None else native)
        self._slices: list[list[_Slice]] = []  # per layer
        places_of = [layout.places for layout in self._layouts]  # per layer, in bytes
        offset = 0
        for cache, places in zip(self._caches, places_of, strict=True):
            parts = []
            for start, stride, size in places:
                rows = rows_of(cache, start, stride, size, num_blocks).numpy() if host else None
                parts.append(_Slice(cache.data_ptr() + start, stride, size, offset, rows))
                offset += size
            self._slices.append(parts)
        self.block_bytes = offset
        # caches on a GPU (or by_address=False): whole blocks staged on the caches' device
        self._staged = None if self.by_address else StagedCopier(self._caches, places_of, num_blocks)
        # per layer: [base, stride, offset, size] of each slice, what the native copier reads
        self._native_parts = [
            np.array([[x.base, x.stride, x.offset, x.size] for x in parts], dtype=np.int64)
            for parts in self._slices
        ]
        self._all_parts = np.concatenate(self._native_parts)
        # layer l is parts _layer_starts[l] .. _layer_starts[l + 1] of _all_parts
        self._layer_starts = np.cumsum([0] + [len(parts) for parts in self._native_parts], dtype=np.int64)

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    def scatter(
        self, sources: Sequence[Buffer], block_ids: Sequence[int], layers: Sequence[int] | None = None
    ) -> None:
        """Copy stored blocks ``sources`` into blocks ``block_ids`` of the caches."""
        self.check(sources, block_ids)
        if self._staged is not None:
            self._staged.scatter(sources, block_ids, layers)
            return
        if self.native:
            self._copy_native(0, _native_addresses(sources, False), block_ids, layers)
            return
        addresses = [address(source) for source in sources]
        runs = host_buffers.runs(sources, addresses, self.block_bytes)
        move = ctypes.memmove
        for layer in self._layers(layers):
            for part in self._slices[layer]:
                for run in runs:
                    if run.span is not None and part.rows is not None:
                        ids = block_ids[run.first : run.first + run.count]
                        part.rows[ids] = run.strided(part.offset, part.size)
                        continue
                    for i in range(run.first, run.first + run.count):
                        move(part.base + block_ids[i] * part.stride, addresses[i] + part.offset, part.size)

    def start_by_layer(
        self, sources: Sequence[Buffer], block_ids: Sequence[int], loader: Executor
    ) -> LayerCopy:
        """Start ``scatter``ing a layer at a time beside the forward pass, every block's layer
        ``l`` before any of ``l + 1``: on a GPU, issued now on the copy stream with an event per
        layer (``device_copy.DeviceLayerCopy``); natively on a C thread of its own that never
        takes the GIL (so neither its start nor its layers wait for the forward, which holds
        it); otherwise ``scatter`` layer by layer on ``loader``. The caller keeps ``sources``
        unchanged until the copy's ``wait`` returns."""
        self.check(sources, block_ids)
        if self._staged is not None:  # caches on a GPU: an event per layer
            return self._staged.scatter_by_layer(sources, block_ids)
        progress = np.zeros(2, dtype=np.int64)  # layers done; the native copy's nanoseconds
        if self.native:
            assert _blockcopy is not None
            _blockcopy.copy_layers(
                _native_addresses(sources, False),
                np.asarray(block_ids, dtype=np.int64),
                self._all_parts,
                self._layer_starts,
                progress,
            )
            return HostLayerCopy(self.num_layers, progress, None, list(sources))
        future = loader.submit(self._scatter_by_layer, list(sources), list(block_ids), progress)
        return HostLayerCopy(self.num_layers, progress, future, list(sources))

    def _scatter_by_layer(
        self, sources: Sequence[Buffer], block_ids: Sequence[int], progress: np.ndarray
    ) -> float:
        start = time.perf_counter()
        for layer in range(self.num_layers):
            self.scatter(sources, block_ids, layers=(layer,))
            progress[0] = layer + 1
        return time.perf_counter() - start

    def gather(self, block_ids: Sequence[int], targets: Sequence[Buffer]) -> None:
        """Copy blocks ``block_ids`` of the caches into ``targets`` (each one stored block)."""
        self.check(targets, block_ids)
        if any(memoryview(t).readonly for t in targets):
            raise ValueError("a block's target buffer is read-only")
        if self._staged is not None:
            self._staged.gather(block_ids, targets)
            return
        if self.native:
            self._copy_native(1, _native_addresses(targets, True), block_ids, None)
            return
        addresses = [address(target) for target in targets]
        runs = host_buffers.runs(targets, addresses, self.block_bytes)
        move = ctypes.memmove
        for parts in self._slices:
            for part in parts:
                for run in runs:
                    if run.span is not None and part.rows is not None:
                        ids = block_ids[run.first : run.first + run.count]
                        np.take(part.rows, ids, axis=0, out=run.strided(part.offset, part.size), mode="wrap")
                        continue  # ids checked already: "wrap" only spares numpy a buffered copy
                    for i in range(run.first, run.first + run.count):
                        move(addresses[i] + part.offset, part.base + block_ids[i] * part.stride, part.size)

    def _copy_native(
        self, gather: int, addresses: bytes, block_ids: Sequence[int], layers: Sequence[int] | None
    ) -> None:
        """One C call: every slice of every block (of ``layers``), checked by the caller;
        ``addresses``: ``u64`` per buffer (``_native_addresses``)."""
        parts = self._all_parts if layers is None else np.concatenate([self._native_parts[i] for i in layers])
        whole = layers is None and len(block_ids) * self.block_bytes >= PARALLEL_BYTES
        assert _blockcopy is not None
        _blockcopy.copy_blocks(
            gather,
            addresses,
            np.asarray(block_ids, dtype=np.int64),
            parts,
            COPY_THREADS if whole else 1,
        )

    def synchronize(self) -> None:
        """Wait for this copier's copies to be done (on a GPU: their event, not the device)."""
        if self._staged is not None:
            self._staged.synchronize()

    def _layers(self, layers: Sequence[int] | None) -> Sequence[int]:
        return range(len(self._caches)) if layers is None else layers

    def check(self, buffers: Sequence[Buffer], block_ids: Sequence[int]) -> None:
        """ValueError unless each buffer is one block and each id one of the caches' blocks."""
        if len(buffers) != len(block_ids):
            raise ValueError(f"{len(buffers)} buffers for {len(block_ids)} blocks")
        for buffer, block_id in zip(buffers, block_ids, strict=True):
            if not 0 <= block_id < self._num_blocks:
                raise ValueError(f"block {block_id} is outside the caches' {self._num_blocks} blocks")
            if memoryview(buffer).nbytes != self.block_bytes:
                raise ValueError(
                    f"a buffer of {memoryview(buffer).nbytes} B for a block of {self.block_bytes} B"
                )


class LayerCopy(Protocol):
    """A copy into the caches a layer at a time, under way (``BlockCopier.start_by_layer``):
    ``wait_for(l)`` before the forward reads layer ``l - 1`` (on a GPU it returns at once and
    the engine's stream waits), ``wait`` once the forward is done, before the stored blocks go;
    it returns the copy's seconds and raises what the copy raised."""

    num_layers: int

    def layers_done(self) -> int: ...

    def wait_for(self, layers: int) -> None: ...

    def wait(self) -> float: ...


class HostLayerCopy:
    """A copy into host caches a layer at a time: the native copier's thread, or ``loader``."""

    def __init__(
        self, num_layers: int, progress: np.ndarray, future: Future[float] | None, keep: list[Buffer]
    ) -> None:
        self.num_layers = num_layers
        self._progress = progress
        self._future = future  # the fallback's copy on the loader; None: the native thread's
        self._keep = keep  # the stored blocks, alive while the copy reads them

    def layers_done(self) -> int:
        if self._future is None:
            assert _blockcopy is not None
            return int(_blockcopy.layers_done(self._progress))
        return int(self._progress[0])

    def wait_for(self, layers: int) -> None:
        """Until ``layers`` layers are in, or the copy has failed (``wait`` raises it then)."""
        while self.layers_done() < layers:
            if self._future is not None and self._future.done():
                return
            time.sleep(POLL_S)

    def wait(self) -> float:
        """Until every layer is in; the copy's seconds (raises what the fallback's copy raised).
        The native copy cannot fail once started, and always ends."""
        if self._future is not None:
            return self._future.result()
        self.wait_for(self.num_layers)
        self._keep = []
        return int(self._progress[1]) / 1e9


def _native_addresses(buffers: Sequence[Buffer], writable: bool) -> bytes:
    """``u64`` addresses of contiguous host buffers, by the native copier (the caller keeps the
    buffers alive): ~0.1 us a buffer, against ~3 us for ``host_buffers.address``."""
    assert _blockcopy is not None
    try:
        return cast(bytes, _blockcopy.addresses(buffers, writable))
    except BufferError as exc:
        raise ValueError(
            f"a block's buffer must be contiguous{' and writable' if writable else ''}: {exc}"
        ) from exc
