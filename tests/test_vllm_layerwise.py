"""Layer-wise loads in the connector's worker (``layerwise_load``), against a real sidecar: the
blocks are resolved before the forward pass, copied a layer at a time on the loader thread, each
attention layer waits for its own; a layer read without waiting turns the load into load errors
(vLLM recomputes those blocks), and the slots are released either way."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator

import pytest
import torch

from engine_plugin import kv_layout
from engine_plugin.sidecar import SidecarLink
from engine_plugin.vllm_metadata import KvstoreConnectorMetadata, TransferJob
from engine_plugin.vllm_stats import KvstoreConnectorStats
from engine_plugin.vllm_worker import WorkerSide
from kvstore.address import parse_address
from kvstore.client import connect
from kvstore.keys import block_keys
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from tests.service_fixtures import MODEL, settings_for

BLOCKS = 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL.num_layers)]


@pytest.fixture(scope="module")
def sidecar() -> Iterator[RunningServer]:
    server = start_server(
        load_settings(env={}, overrides=settings_for(tempfile.mkdtemp(prefix="kvl-", dir="/tmp")))
    )
    yield server
    server.stop()


def caches() -> dict[str, torch.Tensor]:
    """vLLM CPU's layout: [num_blocks, kv_heads, block_size, 2 * head_dim] per layer."""
    shape = (BLOCKS, MODEL.num_kv_heads, MODEL.tokens_per_block, 2 * MODEL.head_dim)
    return {name: torch.randn(shape).to(torch.bfloat16) for name in LAYERS}


def worker(sidecar: RunningServer, kv: dict[str, torch.Tensor], layerwise: bool = True) -> WorkerSide:
    stats = KvstoreConnectorStats()
    address = sidecar.unix_address
    link = SidecarLink(parse_address(address), lambda: connect(address), [MODEL], stats.add_unreachable)
    side = WorkerSide(link, stats, MODEL, 0, True, BLOCKS, layerwise=layerwise)
    side.register_kv_caches(kv)
    return side


def stored_prefix(sidecar: RunningServer, seed: int) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    """Three blocks stored from one engine's caches (blocks 0-2): their keys and those caches."""
    source = caches()
    keys = block_keys(
        MODEL.fingerprint(), list(range(seed, seed + 3 * MODEL.tokens_per_block)), MODEL.tokens_per_block
    )
    saver = worker(sidecar, source)
    save = TransferJob("save", [keys], [0, 1, 2], 5.0, parents=[None])
    saver.wait_for_save(KvstoreConnectorMetadata(saves=[save]))
    saver.shutdown()
    return keys, source


def loading(keys: list[bytes], block_ids: list[int], req_id: str = "r") -> KvstoreConnectorMetadata:
    """A step's metadata that loads ``keys`` (seen in dram) into ``block_ids``."""
    job = TransferJob(req_id, [keys], block_ids, 5.0, tiers=("dram",) * len(block_ids))
    return KvstoreConnectorMetadata(loads=[job])


def forward(side: WorkerSide) -> None:
    """The forward pass: every attention layer waits for its load, then the step ends."""
    for name in LAYERS:
        side.wait_for_layer_load(name)
    side.wait_for_save(KvstoreConnectorMetadata())


def leases_after_release(sidecar: RunningServer) -> int:
    """The sidecar's leases once the worker's releases have landed: a release after a load is
    sent without waiting for its answer (off the restore's path), so it may trail the test."""
    deadline = time.monotonic() + 5.0
    with connect(sidecar.unix_address) as kv:
        while (leases := int(kv.stats()["leases"])) and time.monotonic() < deadline:
            time.sleep(0.01)
    return leases


def test_a_layerwise_load_lands_every_layer_once_each_is_awaited(sidecar: RunningServer) -> None:
    keys, source = stored_prefix(sidecar, 1000)
    target = caches()
    side = worker(sidecar, target)
    try:
        side.step_started()
        side.start_load_kv(loading(keys, [5, 3, 4]))
        for name in LAYERS:
            side.wait_for_layer_load(name)
            for dst, src in ((5, 0), (3, 1), (4, 2)):
                assert torch.equal(target[name][dst], source[name][src])
        side.wait_for_save(KvstoreConnectorMetadata())
        assert side.get_block_ids_with_load_errors() == set()
        assert leases_after_release(sidecar) == 0  # released after the forward pass
    finally:
        side.shutdown()


def test_layerwise_loads_ask_vllm_for_piecewise_cuda_graphs() -> None:
    """A full CUDA graph replays the forward without the waits between its layers."""
    from engine_plugin.vllm_connector import KvstoreConnector

    assert KvstoreConnector.requires_piecewise_for_cudagraph({"layerwise_load": True})
    assert not KvstoreConnector.requires_piecewise_for_cudagraph({})


@pytest.mark.gpu
def test_a_layerwise_load_into_gpu_caches_lands_each_layer_its_event_orders(sidecar: RunningServer) -> None:
    """On a GPU the copy is issued on the copy stream before the forward; each wait makes the
    engine's stream wait for that layer's event (what it reads next sees the layer), and the
    slots go only after the copy's last event, at the step's end."""
    keys, source = stored_prefix(sidecar, 3000)
    target = {name: cache.cuda() for name, cache in caches().items()}
    side = worker(sidecar, target)
    try:
        side.step_started()
        side.start_load_kv(loading(keys, [5, 3, 4]))
        assert side._loading is not None  # loading a layer at a time, not whole
        for name in LAYERS:
            side.wait_for_layer_load(name)
            for dst, src in ((5, 0), (3, 1), (4, 2)):
                assert torch.equal(target[name][dst].cpu(), source[name][src])
        side.wait_for_save(KvstoreConnectorMetadata())
        assert side.get_block_ids_with_load_errors() == set()
        assert leases_after_release(sidecar) == 0
    finally:
        side.shutdown()


def test_a_layer_read_without_waiting_makes_its_blocks_load_errors(sidecar: RunningServer) -> None:
    keys, _ = stored_prefix(sidecar, 2000)
    side = worker(sidecar, caches())
    try:
        side.step_started()
        side.start_load_kv(loading(keys, [1, 2, 6]))
        side.wait_for_layer_load(LAYERS[0])  # the others never waited for
        side.wait_for_save(KvstoreConnectorMetadata())
        assert side.get_block_ids_with_load_errors() == {1, 2, 6}
        assert leases_after_release(sidecar) == 0
    finally:
        side.shutdown()


def test_blocks_the_sidecar_lacks_are_load_errors_before_the_forward_starts(sidecar: RunningServer) -> None:
    keys, _ = stored_prefix(sidecar, 3000)
    missing = block_keys(
        MODEL.fingerprint(), list(range(9000, 9000 + MODEL.tokens_per_block)), MODEL.tokens_per_block
    )
    side = worker(sidecar, caches())
    try:
        side.step_started()
        side.start_load_kv(loading(keys[:2] + missing, [0, 1, 2]))
        forward(side)
        assert side.get_block_ids_with_load_errors() == {2}
    finally:
        side.shutdown()


@pytest.mark.parametrize("where", ["at its start", "in the numpy fallback's copy"])
def test_a_copy_that_fails_ends_every_wait_and_its_blocks_are_load_errors(
    sidecar: RunningServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A copy that fails (a fault injected into the copier: refused as it starts, or raising on
    the loader thread in the fallback without the C copier) leaves no attention layer waiting,
    its blocks go to vLLM's recompute, and the slots are released."""
    keys, _ = stored_prefix(sidecar, 4000 + 100 * len(where))
    if where != "at its start":
        monkeypatch.setattr(kv_layout, "_blockcopy", None)  # the copier built below: numpy's
    side = worker(sidecar, caches())

    def broken(*args: object, **kwargs: object) -> None:
        raise (ValueError if where == "at its start" else OSError)("injected: the copy failed")

    try:
        copier = side._registered()._copier
        assert copier.native is (where == "at its start")
        monkeypatch.setattr(copier, "start_by_layer" if where == "at its start" else "scatter", broken)
        side.step_started()
        side.start_load_kv(loading(keys, [0, 4, 2]))
        forward(side)
        assert side.get_block_ids_with_load_errors() == {0, 4, 2}
        assert leases_after_release(sidecar) == 0
    finally:
        side.shutdown()


def test_a_second_load_before_the_first_steps_end_lets_the_first_copy_finish(sidecar: RunningServer) -> None:
    """A step's loads bound before the last step's ``wait_for_save`` (vLLM keeps that order, but
    a connector must not corrupt memory if it did not): the first copy ends and lands, its slots
    are released, and the second load lands as well."""
    keys, source = stored_prefix(sidecar, 5000)
    target = caches()
    side = worker(sidecar, target)
    try:
        side.step_started()
        side.start_load_kv(loading(keys, [1, 2, 3], "a"))
        side.start_load_kv(loading(keys, [5, 6, 7], "b"))
        forward(side)
        assert side.get_block_ids_with_load_errors() == {1, 2, 3}  # its layers were never awaited
        for name in LAYERS:
            for dst, src in ((1, 0), (2, 1), (3, 2), (5, 0), (6, 1), (7, 2)):
                assert torch.equal(target[name][dst], source[name][src])
        assert leases_after_release(sidecar) == 0
    finally:
        side.shutdown()
