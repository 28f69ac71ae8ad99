"""Every KV cache layout vLLM 0.32 can hand a connector, laid out as vLLM's own code lays them
(``create_kv_cache_views``, compared where vLLM is installed): each is accepted, and blocks
copied out and back in through every copy path land byte for byte, touching no other byte of
the allocation (padding and the other layers' pages included); anything else is refused with
the list of supported layouts. On a GPU
(``gpu``): the same round trips, a copier's wait that waits for its copy alone, and layer-wise
restores whose layers the engine's stream waits for on events."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_plugin import cache_layout, kv_layout

BLOCKS, LAYERS, TOKENS, HEADS, HEAD_DIM = 6, 3, 16, 2, 8
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# (layout, padded page bytes, kernel block tokens): what vLLM builds (it refuses kernel blocks
# unless pages are dense and layer-compact, and pads only block-compact layouts)
CASES = [
    *((name, None, None) for name in LAYOUTS),
    *((name, 1280, None) for name in ("LBHNC", "LBNHC", "BLHNC", "BLNHC")),
    *((name, None, 8) for name in ("LBHNC", "LBNHC")),
]
CASE_IDS = [f"{n}{'-padded' if p else ''}{'-kernel8' if k else ''}" for n, p, k in CASES]
COPY_PATHS = [
    *([pytest.param(True, True, id="native")] if kv_layout._blockcopy is not None else []),
    pytest.param(True, False, id="numpy"),
    pytest.param(False, None, id="staged"),
]


# vLLM 0.32's KVCacheLayout: the physical order of the logical axes [L, B, H, N, C]
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_views(
    name: str, padded: int | None, kernel_tokens: int | None, device: str = "cpu"
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The backing allocation (random bytes) and its per-layer ``[B, H, N, C]`` views, laid out
    as vLLM 0.32's ``compute_layout_strides``/``create_kv_cache_views`` lay them (checked against
    vLLM's own where it is installed; the GPU machine has torch alone)."""
    order = ORDERS[name]
    ratio = TOKENS // kernel_tokens if kernel_tokens else 1
    shape = (LAYERS, BLOCKS * ratio, HEADS, TOKENS // ratio, 2 * HEAD_DIM * 2)  # C in bytes (bf16 K, V)
    strides = [0] * 5
    current, grid_end = 1, max(order.index(0), order.index(1)) + 1
    for position, dim in reversed(tuple(enumerate(order))):
        if padded is not None and position == grid_end - 1:
            current = max(current, padded)  # padded pages: the page grid steps a padded page
        strides[dim] = current
        current *= shape[dim]
    size = (
        sum((n - 1) * stride for n, stride in zip(shape, strides, strict=True)) + 1 + 64
    )  # room past the end
    raw = torch.from_numpy(np.random.default_rng(7).integers(-128, 128, size, dtype=np.int8)).to(device)
    whole = raw.as_strided(shape, strides)
    return raw, [whole[layer].view(torch.bfloat16) for layer in range(LAYERS)]


@pytest.mark.parametrize(("name", "padded", "kernel_tokens"), CASES, ids=CASE_IDS)
def test_the_layouts_built_here_are_the_views_vllm_hands_a_connector(
    name: str, padded: int | None, kernel_tokens: int | None
) -> None:
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[name]
    spec = interface.FullAttentionSpec(
        block_size=TOKENS,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        dtype=torch.bfloat16,
        page_size_padded=padded,
    )
    layer_stride, block_stride, *_ = interface.compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    raw, ours = layout_views(name, padded, kernel_tokens)
    names = [f"layers.{i}.attn" for i in range(LAYERS)]
    tensor = interface.KVCacheTensor(
        size=raw.numel(), layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    theirs = interface.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_tokens)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
            b.dtype,
        )


def touched(
    caches: list[torch.Tensor], layouts: list[kv_layout.LayerLayout], raw: torch.Tensor, blocks: list[int]
) -> torch.Tensor:
    """A mask over ``raw``'s bytes: those of ``blocks`` in every layer."""
    mask = torch.zeros(raw.numel(), dtype=torch.bool)
    base = raw.untyped_storage().data_ptr()
    for cache, layout in zip(caches, layouts, strict=True):
        first = cache.data_ptr() - base
        for start, stride, size in layout.places:
            for block in blocks:
                at = first + start + block * stride
                mask[at : at + size] = True
    return mask


@pytest.mark.parametrize(("by_address", "native"), COPY_PATHS)
@pytest.mark.parametrize(("name", "padded", "kernel_tokens"), CASES, ids=CASE_IDS)
def test_every_vllm_layout_is_accepted_and_round_trips_byte_for_byte(
    name: str, padded: int | None, kernel_tokens: int | None, by_address: bool, native: bool | None
) -> None:
    round_trip(name, padded, kernel_tokens, "cpu", by_address, native)


def round_trip(
    name: str,
    padded: int | None,
    kernel_tokens: int | None,
    device: str,
    by_address: bool,
    native: bool | None,
) -> None:
    raw, caches = layout_views(name, padded, kernel_tokens, device)
    layouts = [kv_layout.describe(cache, BLOCKS) for cache in caches]
    page = HEADS * TOKENS * 2 * HEAD_DIM * 2
    assert [layout.block_bytes for layout in layouts] == [page] * LAYERS  # K and V of every head, no padding
    expected_kind = cache_layout.PER_HEAD if name in ("LHBNC", "BHLNC") else cache_layout.BLOCK_MAJOR
    assert {layout.kind for layout in layouts} == {expected_kind}
    copier = kv_layout.BlockCopier(caches, layouts, BLOCKS, by_address=by_address, native=native)
    before = raw.cpu().clone()
    old_caches = [cache.cpu().clone() for cache in caches]
    # blocks 1 and 4 out (the stored bytes: each layer's block in memory order, layer after layer)
    stored = [torch.empty(copier.block_bytes, dtype=torch.uint8) for _ in range(2)]
    copier.gather([1, 4], [s.numpy().data for s in stored])
    copier.synchronize()
    for block, blob in zip([1, 4], stored, strict=True):
        layers = [before[touched([c], [lay], raw, [block])] for c, lay in zip(caches, layouts, strict=True)]
        assert torch.equal(blob, torch.cat(layers).view(torch.uint8))  # layer after layer, memory order
    # and back in as blocks 5 and 0: those bytes now hold 1's and 4's, no other byte moved
    copier.scatter([s.numpy().data for s in stored], [5, 0])
    copier.synchronize()
    after = raw.cpu()
    for cache, old in zip(caches, old_caches, strict=True):
        grouped = cache.cpu().view(torch.int16).unflatten(0, (BLOCKS, -1))  # random bytes: NaNs too
        was = old.view(torch.int16).unflatten(0, (BLOCKS, -1))
        assert torch.equal(grouped[5], was[1]) and torch.equal(grouped[0], was[4])
    targets = touched(caches, layouts, raw, [5, 0])
    assert torch.equal(after[~targets], before[~targets])


def test_layouts_no_copy_can_serve_are_refused_with_the_supported_list() -> None:
    block_rows = torch.zeros(BLOCKS, HEADS, TOKENS, 2 * HEAD_DIM)
    per_token = torch.zeros(300, BLOCKS, 1, 16).transpose(0, 1)  # a run per token: 300 runs a block
    refused = {
        "innermost elements apart": block_rows[..., ::2],
        "a run per token": per_token,
        "blocks sharing memory": torch.zeros(1, HEADS, TOKENS, 16).expand(BLOCKS, -1, -1, -1),
        "no dimension of num_blocks": torch.zeros(BLOCKS + 1, 4),
    }
    for why, cache in refused.items():
        with pytest.raises(ValueError, match="unsupported KV cache layout") as raised:
            kv_layout.describe(cache, BLOCKS)
        assert "LBHNC" in str(raised.value) and "BHLNC" in str(raised.value), why
        assert str(tuple(cache.shape)) in str(raised.value), why
    # a run per KV head is accepted up to MAX_PLACES of them
    per_head = torch.zeros(cache_layout.MAX_PLACES, BLOCKS, TOKENS, 16).transpose(0, 1)
    assert len(kv_layout.describe(per_head, BLOCKS).places) == cache_layout.MAX_PLACES


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "padded", "kernel_tokens"), CASES, ids=CASE_IDS)
def test_every_vllm_layout_round_trips_on_gpu_caches(
    name: str, padded: int | None, kernel_tokens: int | None
) -> None:
    round_trip(name, padded, kernel_tokens, "cuda", False, None)


@pytest.mark.gpu
def test_a_copiers_wait_waits_for_its_copy_not_for_the_engines_stream() -> None:
    """Work the engine issues after a copy (its forward) is not waited for: the old wait, a
    synchronize of the engine's stream, waited for it."""
    _, caches = layout_views("LBNHC", None, None, "cuda")
    layouts = [kv_layout.describe(cache, BLOCKS) for cache in caches]
    copier = kv_layout.BlockCopier(caches, layouts, BLOCKS)
    host = [torch.empty(copier.block_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
    engine = torch.cuda.current_stream()
    try:
        copier.gather([1, 2], [h.numpy().data for h in host])
        torch.cuda._sleep(2_000_000_000)  # the engine's next kernels: ~1 s
        copier.synchronize()
        assert not engine.query(), "the copier's wait waited for the engine's later work"
        copier.scatter([h.numpy().data for h in host], [3, 4])
        torch.cuda._sleep(2_000_000_000)
        copier.synchronize()
        assert not engine.query()
    finally:
        engine.synchronize()
    grouped = [c.view(torch.int16).unflatten(0, (BLOCKS, -1)) for c in caches]
    assert all(torch.equal(g[3], g[1]) and torch.equal(g[4], g[2]) for g in grouped)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["LBHNC", "LHBNC", "BLNHC"])
def test_a_layerwise_restore_on_gpu_caches_lands_each_layer_the_engine_waits_for(name: str) -> None:
    _, caches = layout_views(name, None, None, "cuda")
    layouts = [kv_layout.describe(cache, BLOCKS) for cache in caches]
    copier = kv_layout.BlockCopier(caches, layouts, BLOCKS)
    source = [c.view(torch.int16).clone() for c in caches]
    host = [torch.empty(copier.block_bytes, dtype=torch.uint8).pin_memory() for _ in range(3)]
    copier.gather([0, 1, 2], [h.numpy().data for h in host])
    copier.synchronize()
    copy = copier.start_by_layer([h.numpy().data for h in host], [5, 3, 4], loader=None)  # type: ignore[arg-type]
    assert copy.num_layers == LAYERS
    for layer, cache in enumerate(caches):
        copy.wait_for(layer + 1)  # the engine's stream waits; what it reads next sees the layer
        for dst, src in ((5, 0), (3, 1), (4, 2)):
            assert torch.equal(cache.view(torch.int16)[dst], source[layer][src])
    assert copy.wait() >= 0.0
    assert copy.layers_done() == LAYERS
