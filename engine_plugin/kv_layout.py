"""How one kvstore block maps onto vLLM's paged KV cache tensors, per layer.

A kvstore block is one vLLM block (``block_size`` tokens) of every layer of this rank, layer
after layer in the order vLLM registered its caches; within a layer, the bytes of that block as
the cache lays them out. Two arrangements of a layer's cache tensor are supported:

- ``block-major``: the block index is the outermost dimension and ``cache[b]`` is contiguous.
  vLLM's CPU layout ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` and the CUDA layouts
  ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (NHD) or ``[..., kv_heads, block_size,
  head_dim]`` (HND). One contiguous slice per layer and block.
- ``kv-split``: keys and values in separate halves, ``[2, num_blocks, ...]`` (FlashAttention's
  classic CUDA layout). Two contiguous slices per layer and block: K, then V — the same bytes
  as the block-major NHD layout, so the two share stored blocks.

Anything else (a block not contiguous in memory) is refused when the caches are registered,
with the shape in the message. Copies run on whatever device the cache lives on: host to host
on CPU; on CUDA, host to device from the pinned arena (and back for saves) on the current
stream, with ``synchronize`` once per batch before the bytes are used or committed. The CUDA
paths are exercised by the ``gpu``-marked tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK_MAJOR = "block-major"
KV_SPLIT = "kv-split"


@dataclass(frozen=True)
class LayerLayout:
    kind: str  # BLOCK_MAJOR or KV_SPLIT
    block_bytes: int  # this layer's bytes of one block


def describe(cache: torch.Tensor, num_blocks: int) -> LayerLayout:
    """The arrangement of one layer's cache of ``num_blocks`` blocks; ValueError otherwise."""
    shape = tuple(cache.shape)
    if len(shape) >= 2 and shape[0] == num_blocks and cache[0].is_contiguous():
        return LayerLayout(BLOCK_MAJOR, cache[0].numel() * cache.element_size())
    if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks and cache[0, 0].is_contiguous():
        return LayerLayout(KV_SPLIT, 2 * cache[0, 0].numel() * cache.element_size())
    raise ValueError(
        f"unsupported KV cache layout: shape {shape}, strides {tuple(cache.stride())} for "
        f"{num_blocks} blocks (supported: a contiguous block per index of the first dimension, "
        "or [2, num_blocks, ...] with contiguous K and V blocks)"
    )


def block_views(
    caches: Sequence[torch.Tensor], layouts: Sequence[LayerLayout], block_id: int
) -> list[torch.Tensor]:
    """The byte views (uint8, flat) that make up block ``block_id``, in stored order."""
    views = []
    for cache, layout in zip(caches, layouts, strict=True):
        if layout.kind == BLOCK_MAJOR:
            views.append(cache[block_id].reshape(-1).view(torch.uint8))
        else:
            views.append(cache[0, block_id].reshape(-1).view(torch.uint8))
            views.append(cache[1, block_id].reshape(-1).view(torch.uint8))
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
