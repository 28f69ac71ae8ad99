"""Where one block's bytes lie in one layer's KV cache tensor: the layouts a connector accepts.

vLLM 0.32 hands a connector one view per layer, ``[B, H, N, C]`` (blocks, KV heads, tokens,
K and V of one head and token, in bytes of the KV dtype), whose strides follow one of six
physical orders (``vllm.v1.kv_cache_layout.KVCacheLayout``, picked per attention backend or by
``VLLM_KV_CACHE_LAYOUT``), optionally with padded pages or manager blocks split into kernel
blocks (``[B * ratio, H, N, C]``). What a copy needs is where a block's bytes are, so a layout
is described by its *places*: ``(start, stride, size)`` in bytes, block ``b``'s slice at
``start + b * stride`` past the tensor's first byte, in the order the slices are stored:

- one place, a block's layer one run of memory: ``LBHNC`` (the CPU backend's), ``LBNHC``,
  ``BLHNC``, ``BLNHC``, padded or split into kernel blocks;
- a place per KV head (``LHBNC``, ``BHLNC``: a head's tokens of all blocks lie together);
- two places, K then V, for a ``[2, num_blocks, ...]`` cache (FlashAttention's layout before
  vLLM 0.32, and tests).

A block is stored in the cache's memory order: engines whose layouts order a block's bytes
differently do not share blocks (the fingerprint's ``memory_layout`` tells them apart).
Anything else — a block's elements not in runs of whole innermost rows, runs overlapping, or
more than ``MAX_PLACES`` runs a layer — is refused when the caches are registered, with the
shape, the strides and the list above (``SUPPORTED``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_MAJOR = "block-major"  # one run per block and layer
KV_SPLIT = "kv-split"  # [2, num_blocks, ...]: K's run, then V's
PER_HEAD = "per-head"  # a run per KV head (or any other outer dimension of the block)
# A copy moves every place of every block one by one (by address) or a kernel per place (staged
# on a GPU): a run per KV head stays cheap; a run per token or element would not.
MAX_PLACES = 256
SUPPORTED = (
    "vLLM 0.32's LBHNC, LBNHC, BLHNC and BLNHC (a block's layer in one run), LHBNC and BHLNC "
    f"(a run per KV head, up to {MAX_PLACES}), padded pages and kernel blocks included; and "
    "[2, num_blocks, ...] caches with K and V apart"
)

Place = tuple[int, int, int]  # (start, stride, size) in bytes


@dataclass(frozen=True)
class LayerLayout:
    kind: str  # BLOCK_MAJOR, KV_SPLIT or PER_HEAD
    block_bytes: int  # this layer's bytes of one block
    places: tuple[Place, ...]  # where they lie, in stored order (see the module docstring)


def describe(cache: torch.Tensor, num_blocks: int) -> LayerLayout:
    """The places of one layer's cache of ``num_blocks`` blocks; ValueError when unsupported."""
    shape, strides = tuple(cache.shape), tuple(cache.stride())
    es = cache.element_size()
    layout = None
    if _disjoint(shape, strides):  # no two elements share memory
        if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            runs = _runs(shape[2:], strides[2:], es)
            if runs is not None and len(runs) == 1:
                (start, size), stride = runs[0], strides[1] * es
                kv = ((start, stride, size), (start + strides[0] * es, stride, size))
                layout = LayerLayout(KV_SPLIT, 2 * size, kv)
        elif len(shape) >= 2 and num_blocks > 0 and shape[0] % num_blocks == 0:
            ratio = shape[0] // num_blocks  # kernel blocks per manager block (1: none)
            inner = (ratio, *shape[1:]) if ratio > 1 else shape[1:]
            runs = _runs(inner, (strides[0], *strides[1:]) if ratio > 1 else strides[1:], es)
            if runs is not None:
                places = tuple((start, strides[0] * ratio * es, size) for start, size in runs)
                kind = BLOCK_MAJOR if len(places) == 1 else PER_HEAD
                layout = LayerLayout(kind, sum(size for _, size in runs), places)
    if layout is None:
        raise ValueError(
            f"unsupported KV cache layout: shape {shape}, strides {strides} for {num_blocks} "
            f"blocks (supported: {SUPPORTED})"
        )
    return layout


def _dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, stride) of each dimension of more than one element, outermost in memory first."""
    return sorted(((n, s) for n, s in zip(shape, strides, strict=True) if n != 1), key=lambda d: -d[1])


def _disjoint(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether every element has memory of its own: each dimension, taken outward in memory
    order, strides past everything inside it (what any of vLLM's layouts does)."""
    extent = 1
    for n, s in reversed(_dims(shape, strides)):
        if s < extent:
            return False
        extent = s * n
    return True


def _runs(shape: tuple[int, ...], strides: tuple[int, ...], es: int) -> list[tuple[int, int]] | None:
    """One block's elements (``shape``/``strides`` in elements, the block dimension left out;
    disjoint) as runs of memory, ``(start, size)`` in bytes in memory order; None when the
    innermost elements are not adjacent or the runs are more than ``MAX_PLACES``."""
    dims = _dims(shape, strides)
    if not dims:
        return [(0, es)]
    if dims[-1][1] != 1:
        return None
    run = 1  # elements in one run: the innermost dimensions that lie end to end
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    starts = [0]
    for n, s in reversed(dims):  # outward
        starts = [i * s + start for i in range(n) for start in starts]
        if len(starts) > MAX_PLACES:
            return None
    return [(start * es, run * es) for start in starts]
