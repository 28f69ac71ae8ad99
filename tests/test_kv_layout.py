"""How a kvstore block maps onto vLLM's paged KV caches: the CPU layout, the CUDA layouts (as
tensors of the same shape on the CPU here; on a CUDA device in the ``gpu``-marked tests), and
refusal of anything else."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine_plugin import kv_layout

BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 6, 4, 2, 8, 3


def cpu_caches(device: str = "cpu") -> list[torch.Tensor]:
    """vLLM CPU: [num_blocks, kv_heads, block_size, 2 * head_dim] per layer."""
    return [
        torch.randn(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM, device=device).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def kv_split_caches(device: str = "cpu") -> list[torch.Tensor]:
    """FlashAttention: [2, num_blocks, block_size, kv_heads, head_dim] per layer."""
    return [
        torch.randn(2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def block_major_caches(device: str = "cpu") -> list[torch.Tensor]:
    """FlashInfer NHD: [num_blocks, 2, block_size, kv_heads, head_dim] per layer."""
    return [
        torch.randn(BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2


def layouts_of(caches: list[torch.Tensor]) -> list[kv_layout.LayerLayout]:
    return [kv_layout.describe(c, BLOCKS) for c in caches]


@pytest.mark.parametrize(
    ("make", "kind"),
    [(cpu_caches, "block-major"), (block_major_caches, "block-major"), (kv_split_caches, "kv-split")],
)
def test_a_block_round_trips_through_host_bytes(make: Callable[[], list[torch.Tensor]], kind: str) -> None:
    caches = make()
    layouts = layouts_of(caches)
    assert {lay.kind for lay in layouts} == {kind}
    assert sum(lay.block_bytes for lay in layouts) == BLOCK_BYTES
    stored = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
    kv_layout.gather(kv_layout.block_views(caches, layouts, 2), stored)
    before = [c.clone() for c in caches]
    kv_layout.scatter(stored, kv_layout.block_views(caches, layouts, 5))  # into another block
    kv_layout.synchronize(caches)
    for cache, old in zip(caches, before, strict=True):
        if kind == "kv-split":
            assert torch.equal(cache[:, 5], old[:, 2])  # K and V both moved
            assert torch.equal(cache[:, :5], old[:, :5])  # nothing else touched
        else:
            assert torch.equal(cache[5], old[2])
            assert torch.equal(cache[:5], old[:5])


def test_kv_split_and_block_major_nhd_store_the_same_bytes() -> None:
    split = kv_split_caches()
    major = [c.transpose(0, 1).contiguous() for c in split]  # same values, block-major
    a, b = torch.empty(BLOCK_BYTES, dtype=torch.uint8), torch.empty(BLOCK_BYTES, dtype=torch.uint8)
    kv_layout.gather(kv_layout.block_views(split, layouts_of(split), 3), a)
    kv_layout.gather(kv_layout.block_views(major, layouts_of(major), 3), b)
    assert torch.equal(a, b)


def test_layer_bytes_are_k_then_v_in_layer_order() -> None:
    caches = kv_split_caches()
    stored = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
    kv_layout.gather(kv_layout.block_views(caches, layouts_of(caches), 1), stored)
    side = BLOCK_SIZE * HEADS * HEAD_DIM * 2
    v_of_layer_1 = stored[3 * side : 4 * side]  # layer 0: K, V; layer 1: K, V
    assert torch.equal(v_of_layer_1, caches[1][1, 1].reshape(-1).view(torch.uint8))


def test_unsupported_layouts_are_refused_with_their_shape() -> None:
    permuted = torch.randn(BLOCK_SIZE, BLOCKS, HEADS, HEAD_DIM).transpose(0, 1)  # blocks not contiguous
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        kv_layout.describe(permuted, BLOCKS)
    with pytest.raises(ValueError, match="shape"):
        kv_layout.describe(torch.zeros(3, 4), BLOCKS)
    caches = cpu_caches()
    with pytest.raises(ValueError, match="does not fill"):
        kv_layout.scatter(
            torch.zeros(BLOCK_BYTES + 2, dtype=torch.uint8),
            kv_layout.block_views(caches, layouts_of(caches), 0),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("make", [cpu_caches, block_major_caches, kv_split_caches])
def test_cuda_caches_restore_from_pinned_host_bytes(make: Callable[[str], list[torch.Tensor]]) -> None:
    caches = make("cuda")
    layouts = layouts_of(caches)
    host = torch.empty(BLOCK_BYTES, dtype=torch.uint8).pin_memory()
    kv_layout.gather(kv_layout.block_views(caches, layouts, 1), host)
    kv_layout.synchronize(caches)
    expected = torch.cat([v.cpu() for v in kv_layout.block_views(caches, layouts, 1)])
    assert torch.equal(host, expected)
    kv_layout.scatter(host, kv_layout.block_views(caches, layouts, 4))
    kv_layout.synchronize(caches)
    for a, b in zip(
        kv_layout.block_views(caches, layouts, 4), kv_layout.block_views(caches, layouts, 1), strict=True
    ):
        assert torch.equal(a, b)


def test_an_audit_difference_is_zero_for_the_same_block_and_large_for_another() -> None:
    from engine_plugin.transfer import _difference

    block = torch.randn(4, 64, dtype=torch.bfloat16)
    same = block.view(torch.uint8).flatten().clone()
    assert _difference(same, same.clone(), torch.bfloat16) == 0.0
    nudged = block.clone()
    nudged[0, 0] = nudged[0, 0] + block.abs().max() * 0.5
    assert 0.2 < _difference(nudged.view(torch.uint8).flatten(), same, torch.bfloat16) < 1.0
    other = torch.randn(4, 64, dtype=torch.bfloat16).view(torch.uint8).flatten()
    assert _difference(other, same, torch.bfloat16) > 0.1
    assert _difference(same[:-2], same, torch.bfloat16) == float("inf")  # not the same size
    nan = block.clone()
    nan[1, 1] = float("nan")
    assert _difference(nan.view(torch.uint8).flatten(), same, torch.bfloat16) == float("inf")
    assert _difference(same, same, torch.int8) == 0.0  # not a float: bytes, exactly
    flipped = same.clone()
    flipped[3] ^= 1
    assert _difference(flipped, same, torch.int8) == float("inf")


@pytest.mark.parametrize("address", ["tcp", "unix"])
def test_a_block_transfer_stores_fetches_and_compares_through_a_real_server(address: str) -> None:
    """``BlockTransfer`` both ways (the data port, the mapped arena) on the CPU layout: blocks
    gathered out of one set of caches come back into another byte for byte, and ``compare``
    says 0 for the same KV, more for other KV, None past what kvstore holds."""
    import shutil
    import tempfile

    from engine_plugin.transfer import BlockTransfer
    from kvstore.client import connect
    from kvstore.keys import block_keys
    from kvstore.server.config import load_settings
    from kvstore.server.serve import start_server
    from tests.service_fixtures import MODEL, settings_for

    def caches() -> list[torch.Tensor]:  # [num_blocks, kv_heads, block_size, 2 * head_dim] per layer
        return [torch.randn(6, 2, 16, 64, dtype=torch.bfloat16) for _ in range(MODEL.num_layers)]

    def transfer(layers: list[torch.Tensor]) -> BlockTransfer:
        layouts = [kv_layout.describe(c, 6) for c in layers]
        return BlockTransfer(layers, layouts, MODEL.fingerprint(), MODEL.block_bytes, address == "unix")

    data_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    server = start_server(load_settings(env={}, overrides=settings_for(data_dir)))
    try:
        where = server.unix_address if address == "unix" else server.tcp_address
        with connect(where, token=None if address == "unix" else "tok-a") as kv:
            kv.register(MODEL)
            keys = block_keys(MODEL.fingerprint(), list(range(64)), 16)  # 4 blocks
            source, target = caches(), caches()
            transfer(source).store(kv, keys[:3], [0, 2, 4], None)
            assert transfer(target).fetch(kv, keys[:3], [1, 3, 5]) == 3
            for s, t in zip(source, target, strict=True):
                assert torch.equal(s[[0, 2, 4]], t[[1, 3, 5]])
            differences = transfer(source).compare(kv, keys, [0, 2, 1, 3])
            assert differences[:2] == [0.0, 0.0] and differences[2] is not None and differences[2] > 0.1
            assert differences[3] is None  # kvstore holds 3 of the 4
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
