"""``kvstore bench device``'s layer-wise row: a restore into GPU caches copied a layer at a time
beside a forward pass (``BlockCopier.start_by_layer``: an event per layer, the engine's stream
waiting for each before its layer's work) against the whole restore first, then the same
forward (``scatter``, the host waiting for the copy's event, as the connector's whole loads do).

The forward is a stand-in for a prefill of ``NEW_TOKENS`` tokens on an 8B-like model: per
layer, two matmuls the size of its MLP and a read of the layer's restored blocks (what its
attention reads). Caches: vLLM 0.32's default CUDA layout (LBNHC), 32 layers of 8 KV heads of
128, 16-token blocks, bf16 (2 MiB a block), out of adjacent slots of a pinned arena mapping.
Both measured alternately, medians; the ratio is what sets ``layerwise_load`` on GPU hosts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from benchmarks.common import Result, interleaved
from engine_plugin import kv_layout
from tiers.dram import Arena, DramConfig, DramTier

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16
NEW_TOKENS, HIDDEN, MLP = 512, 4096, 14336


def bench_layerwise(
    blocks: int, rounds: int, timed: Callable[[Callable[[], None]], Callable[[], float]]
) -> Result:
    """``timed``: wraps a step into one that returns its seconds, the device synchronized."""
    caches = [
        torch.randn(blocks, BLOCK_TOKENS, HEADS, 2 * HEAD_DIM, device="cuda")
        .to(torch.bfloat16)
        .transpose(1, 2)
        for _ in range(LAYERS)
    ]
    layouts = [kv_layout.describe(c, blocks) for c in caches]
    copier = kv_layout.BlockCopier(caches, layouts, blocks)
    size = copier.block_bytes
    tier = DramTier(DramConfig(capacity_bytes=blocks * size, page_bytes=max(size, 32 << 20)))
    engine_map = Arena.attach(tier.arena.name)
    try:
        engine_map.pin_with_cuda()
        slots = [engine_map.view[i * size : (i + 1) * size] for i in range(blocks)]
        tier.arena.array[:] = np.random.default_rng(5).integers(0, 256, blocks * size, dtype=np.uint8)
        block_ids = [int(b) for b in np.random.default_rng(6).permutation(blocks)]
        ids = torch.tensor(block_ids, device="cuda")
        x = torch.randn(NEW_TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
        up = torch.randn(HIDDEN, MLP, device="cuda", dtype=torch.bfloat16) / MLP
        down = torch.randn(MLP, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN
        sink = torch.zeros(LAYERS, device="cuda")

        def layer(index: int) -> None:
            sink[index] = caches[index].index_select(0, ids).float().abs().sum() + ((x @ up) @ down).sum()

        def whole() -> None:
            copier.scatter(slots, block_ids)
            copier.synchronize()  # the connector's whole load: the host waits for the copy's event
            for index in range(LAYERS):
                layer(index)

        def by_layer() -> None:
            copy = copier.start_by_layer(slots, block_ids, loader=None)  # type: ignore[arg-type]
            for index in range(LAYERS):
                copy.wait_for(index + 1)
                layer(index)
            copy.wait()

        whole()  # first runs: kernels loaded, a full batch's graph captured
        by_layer()
        layered_s, whole_s = interleaved(timed(by_layer), timed(whole), rounds)
    finally:
        engine_map.close()
        tier.close()
    return Result(
        f"layer-wise restore + forward vs whole restore + forward, {blocks} blocks of {size >> 20} MiB",
        layered_s * 1e3,
        "ms",
        "whole restore, then the forward",
        whole_s * 1e3,
        None,
        f"{LAYERS} layers (LBNHC), a stand-in forward of {NEW_TOKENS} tokens; layerwise_load's "
        "default on GPU hosts follows this ratio (< 0.9: worth turning on)",
    )
