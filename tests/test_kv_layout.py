"""How a kvstore block maps onto vLLM's paged KV caches: the CPU layout, the CUDA layouts (as
tensors of the same shape on the CPU here; on a CUDA device in the ``gpu``-marked tests), and
refusal of anything else."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from engine_plugin import device_copy, host_buffers, kv_layout
from engine_plugin.transfer import BlockTransfer
from kvstore.client import Client
from kvstore.store import TieredStore

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
    strided = torch.randn(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)[..., ::2]  # no two elements adjacent
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        kv_layout.describe(strided, BLOCKS)
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


@contextlib.contextmanager
def served_client(address: str) -> Iterator[tuple[Client, TieredStore]]:
    """A client of a real server of its own, registered with ``MODEL``, and the server's store:
    over TCP (a tenant's token) or the Unix socket (the mapped arena)."""
    from kvstore.client import connect
    from kvstore.server.config import load_settings
    from kvstore.server.serve import start_server
    from tests.service_fixtures import MODEL, settings_for

    data_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    server = start_server(load_settings(env={}, overrides=settings_for(data_dir)))
    try:
        where = server.unix_address if address == "unix" else server.tcp_address
        with connect(where, token=None if address == "unix" else "tok-a") as kv:
            kv.register(MODEL)
            yield kv, server.store
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def block_transfer(layers: list[torch.Tensor], same_host: bool, staging: bool | None = None) -> BlockTransfer:
    from tests.service_fixtures import MODEL

    layouts = [kv_layout.describe(c, 6) for c in layers]
    return BlockTransfer(layers, layouts, MODEL.fingerprint(), MODEL.block_bytes, same_host, 6, staging)


@pytest.mark.parametrize("address", ["tcp", "unix"])
def test_a_block_transfer_stores_fetches_and_compares_through_a_real_server(address: str) -> None:
    """``BlockTransfer`` both ways (the data port, the mapped arena) on the CPU layout: blocks
    gathered out of one set of caches come back into another byte for byte, and ``compare``
    says 0 for the same KV, more for other KV, None past what kvstore holds."""
    from kvstore.keys import block_keys
    from tests.service_fixtures import MODEL

    def caches() -> list[torch.Tensor]:  # [num_blocks, kv_heads, block_size, 2 * head_dim] per layer
        return [torch.randn(6, 2, 16, 64, dtype=torch.bfloat16) for _ in range(MODEL.num_layers)]

    with served_client(address) as (kv, _):
        keys = block_keys(MODEL.fingerprint(), list(range(64)), 16)  # 4 blocks
        source, target = caches(), caches()
        block_transfer(source, address == "unix").store(kv, keys[:3], [0, 2, 4], None)
        assert block_transfer(target, address == "unix").fetch(kv, keys[:3], [1, 3, 5]) == 3
        for s, t in zip(source, target, strict=True):
            assert torch.equal(s[[0, 2, 4]], t[[1, 3, 5]])
        differences = block_transfer(source, address == "unix").compare(kv, keys, [0, 2, 1, 3])
        assert differences[:2] == [0.0, 0.0] and differences[2] is not None and differences[2] > 0.1
        assert differences[3] is None  # kvstore holds 3 of the 4


def test_a_remote_staged_restore_refuses_a_block_shorter_than_its_layout() -> None:
    """A chain stored under an unregistered fingerprint (the server checks sizes only against a
    registered layout) with a block 64 B short: the staged restore refuses it as it arrives,
    rather than load the block with the staging buffer's stale tail."""
    from kvstore.errors import InvalidArgument
    from kvstore.keys import Fingerprint, block_keys
    from tests.service_fixtures import MODEL

    def caches() -> list[torch.Tensor]:
        return [torch.randn(6, 2, 16, 64, dtype=torch.bfloat16) for _ in range(MODEL.num_layers)]

    foreign = Fingerprint(b"\x07" * 32)
    with served_client("tcp") as (kv, _):
        keys = block_keys(foreign, list(range(48)), 16)
        whole = [bytes([i + 1]) * MODEL.block_bytes for i in range(2)]
        kv.put(foreign, keys, [*whole, b"\x09" * (MODEL.block_bytes - 64)])
        layers = caches()
        load = BlockTransfer(
            layers, [kv_layout.describe(c, 6) for c in layers], foreign, MODEL.block_bytes, False, 6, True
        )
        before = [c.clone() for c in layers]
        assert load.fetch(kv, keys[:2], [0, 1]) == 2  # whole blocks: loaded
        with pytest.raises(InvalidArgument, match="does not match"):
            load.fetch(kv, keys, [3, 4, 5])
        for now, then in zip(layers, before, strict=True):
            assert torch.equal(now[5], then[5])  # the short block's place untouched
        from kvstore.client import connect

        with connect(kv.address, token="tok-a", data_plane="grpc") as over_grpc:  # the same refusal
            outs = [memoryview(bytearray(MODEL.block_bytes)) for _ in range(3)]
            assert over_grpc.get_into(foreign, keys, outs) == 3  # a short block fits its buffer
            with pytest.raises(InvalidArgument, match="does not match"):
                over_grpc.get_into(foreign, keys, outs, exact=True)


def test_a_copy_that_fails_midway_waits_for_the_device_before_giving_its_slots_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same host: a save whose copy fails gives its reservation back, and a restore whose copy
    fails lets its lease go, only after waiting for what the device had started (on a GPU the
    copies are asynchronous: a slot handed back while a copy still reads or writes it would
    lose or corrupt another block); the failure is what the caller sees."""
    from kvstore.keys import block_keys
    from tests.service_fixtures import MODEL

    def caches() -> list[torch.Tensor]:  # [num_blocks, kv_heads, block_size, 2 * head_dim] per layer
        return [torch.randn(6, 2, 16, 64, dtype=torch.bfloat16) for _ in range(MODEL.num_layers)]

    with served_client("unix") as (kv, _):
        keys = block_keys(MODEL.fingerprint(), list(range(64)), 16)
        events: list[str] = []

        def broken(name: str) -> Callable[..., None]:
            def fail(*args: object, **kwargs: object) -> None:
                events.append(name)
                raise RuntimeError(f"{name} failed on the device")

            return fail

        for call in ("abort", "release"):
            original = getattr(kv, call)
            monkeypatch.setattr(
                kv, call, lambda *a, _o=original, _c=call, **k: (events.append(_c), _o(*a, **k))[1]
            )
        save = block_transfer(caches(), True)
        monkeypatch.setattr(save._copier, "gather", broken("gather"))
        monkeypatch.setattr(save._copier, "synchronize", lambda: events.append("synchronize"))
        with pytest.raises(RuntimeError, match="gather failed"):
            save.store(kv, keys[:2], [0, 1], None)
        assert events == ["gather", "synchronize", "abort"]
        assert kv.lookup(MODEL.fingerprint(), keys) == 0  # nothing half-written was kept

        block_transfer(caches(), True).store(kv, keys[:2], [0, 1], None)
        events.clear()
        load = block_transfer(caches(), True)
        monkeypatch.setattr(load._copier, "scatter", broken("scatter"))
        monkeypatch.setattr(load._copier, "synchronize", lambda: events.append("synchronize"))
        with pytest.raises(RuntimeError, match="scatter failed"):
            load.fetch(kv, keys[:2], [2, 3])
        assert events == ["scatter", "synchronize", "release"]


def test_a_remote_transfer_through_a_staging_buffer_moves_chunk_by_chunk_and_stops_at_a_miss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The remote path caches on a GPU take (a staging buffer of two blocks here, unpinned on
    the CPU): a save of five blocks goes in three chained puts, a restore comes back chunk by
    chunk byte for byte, and a chain missing its fourth block restores three."""
    from kvstore.keys import block_keys
    from tests.service_fixtures import MODEL

    monkeypatch.setattr(device_copy, "STAGE_BYTES", 2 * MODEL.block_bytes)

    def caches() -> list[torch.Tensor]:  # [2, num_blocks, block_size, kv_heads, head_dim] per layer
        shape = (2, 6, MODEL.tokens_per_block, MODEL.num_kv_heads, MODEL.head_dim)
        return [torch.randn(shape).to(torch.bfloat16) for _ in range(MODEL.num_layers)]

    with served_client("tcp") as (kv, store):
        keys = block_keys(MODEL.fingerprint(), list(range(96)), 16)  # 6 blocks
        source, target = caches(), caches()
        save = block_transfer(source, False, staging=True)
        assert len(save._staging) == 2
        save.store(kv, keys[:5], [5, 0, 2, 4, 1], None)
        assert kv.lookup(MODEL.fingerprint(), keys) == 5
        found = {b.key: b for b in store._index.blocks.values()}  # one chain across the chunks
        assert [(found[k].depth, found[k].parent) for k in keys[:5]] == [
            (0, None),
            *((i, keys[i - 1]) for i in range(1, 5)),
        ]
        load = block_transfer(target, False, staging=True)
        assert load.fetch(kv, keys[:5], [0, 1, 2, 3, 4]) == 5
        for s, t in zip(source, target, strict=True):
            assert torch.equal(s[:, [5, 0, 2, 4, 1]], t[:, [0, 1, 2, 3, 4]])
        kv.delete(MODEL.fingerprint(), keys[3:4])
        assert block_transfer(caches(), False, staging=True).fetch(kv, keys[:5], [0, 1, 2, 3, 4]) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("address", ["tcp", "unix"])
def test_a_block_transfer_on_gpu_caches_round_trips_and_pins_the_engines_mapping(address: str) -> None:
    """``BlockTransfer`` with FlashAttention's kv-split caches on the GPU, through a real server:
    blocks saved out of one set of caches come back into another byte for byte (the staged
    copy, asynchronous out of and into the pinned arena, synchronized before each commit and
    release); on the same host the client's own mapping of the arena got pinned."""
    from kvstore.keys import block_keys
    from tests.service_fixtures import MODEL

    def caches() -> list[torch.Tensor]:  # [2, num_blocks, block_size, kv_heads, head_dim] per layer
        shape = (2, 6, MODEL.tokens_per_block, MODEL.num_kv_heads, MODEL.head_dim)
        return [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(MODEL.num_layers)]

    with served_client(address) as (kv, _):
        keys = block_keys(MODEL.fingerprint(), list(range(64)), 16)
        source, target = caches(), caches()
        block_transfer(source, address == "unix").store(kv, keys[:4], [5, 0, 2, 4], None)
        assert block_transfer(target, address == "unix").fetch(kv, keys[:4], [1, 3, 5, 0]) == 4
        for s, t in zip(source, target, strict=True):
            assert torch.equal(s[:, [5, 0, 2, 4]], t[:, [1, 3, 5, 0]])
        if address == "unix":
            assert kv.attach().pinned
            assert block_transfer(target, True).compare(kv, keys[:4], [1, 3, 5, 0]) == [0.0] * 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("address", ["tcp", "unix"])
def test_a_restore_from_a_sidecar_killed_mid_call_fails_at_once_and_the_restarted_one_serves_it(
    address: str, device: str
) -> None:
    """``kill -9`` of the sidecar while a restore into kv-split caches waits on it (stopped
    first, so the kill lands mid-call): remote through the staging buffer, or same host out of
    the arena. The restore raises ``Unavailable`` on the kill, not at its deadline, and writes
    no block of the caches; the sidecar restarted on its folder (the arena's blocks salvaged
    into nvme) serves the same blocks byte for byte."""
    import threading
    import time

    from benchmarks.server_process import ServerProcess
    from kvstore.client import connect
    from kvstore.errors import Unavailable
    from kvstore.keys import block_keys
    from tests.service_fixtures import MODEL

    def caches() -> list[torch.Tensor]:  # [2, num_blocks, block_size, kv_heads, head_dim] per layer
        shape = (2, 6, MODEL.tokens_per_block, MODEL.num_kv_heads, MODEL.head_dim)
        return [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(MODEL.num_layers)]

    server = ServerProcess(
        {
            "dram.capacity_bytes": "16MiB",
            "dram.page_bytes": "1MiB",
            "dram.prefault": "false",
            "nvme.capacity_bytes": "64MiB",
            "server.tokens": "tok-a=tenant-a",
        },
        tcp=True,
    )
    same_host = address == "unix"
    where, token = (server.unix, None) if same_host else (server.tcp, "tok-a")
    keys = block_keys(MODEL.fingerprint(), list(range(64)), 16)  # 4 blocks
    source, target = caches(), [torch.zeros_like(c) for c in caches()]
    try:
        with connect(where, token=token, timeout_s=60) as kv:
            kv.register(MODEL)
            block_transfer(source, same_host, staging=not same_host).store(kv, keys, [5, 0, 2, 4], None)
            server.freeze()
            killer = threading.Timer(0.5, server.kill)
            killer.start()
            started = time.monotonic()
            with pytest.raises(Unavailable):
                block_transfer(target, same_host, staging=not same_host).fetch(kv, keys, [1, 3, 5, 0])
            assert time.monotonic() - started < 30  # the kill ended it, not the 60 s deadline
            killer.join()
        assert not any(c.any() for c in target)  # nothing landed
        server.start()
        with connect(where, token=token, timeout_s=60) as kv:
            kv.register(MODEL)
            assert block_transfer(target, same_host, staging=not same_host).fetch(kv, keys, [1, 3, 5, 0]) == 4
        for s, t in zip(source, target, strict=True):
            assert torch.equal(s[:, [5, 0, 2, 4]], t[:, [1, 3, 5, 0]])
    finally:
        server.stop()


# (by_address, native): the native C copier where it is built, numpy's, and torch's copy_ per slice
COPY_PATHS = [*([(True, True)] if kv_layout._blockcopy is not None else []), (True, False), (False, None)]


def test_the_native_copier_was_built_by_the_install() -> None:
    """scripts/setup.sh installs with a C compiler at hand: the copier the connector uses is the
    native one (without a compiler the install still succeeds, and this says so)."""
    assert kv_layout._blockcopy is not None, "engine_plugin._blockcopy is not built: no C compiler?"
    caches = cpu_caches()
    assert kv_layout.BlockCopier(caches, layouts_of(caches), BLOCKS).native


@pytest.mark.skipif(kv_layout._blockcopy is None, reason="the native copier is not built")
@pytest.mark.parametrize("make", [cpu_caches, kv_split_caches])
def test_the_native_copier_splits_a_large_copy_between_threads_and_lands_every_byte(
    make: Callable[[], list[torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every copy goes to threads here (the threshold at 0, three threads for six blocks in an
    order vLLM could hand out): the caches end as numpy's copy leaves them, and gathering on
    threads reads the same bytes back."""
    monkeypatch.setattr(kv_layout, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(kv_layout, "COPY_THREADS", 3)
    rng = np.random.default_rng(5)
    stored = [bytes(rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)) for _ in range(6)]
    block_ids = [5, 0, 3, 1, 4, 2]
    results = []
    for native in (True, False):
        caches = [torch.zeros_like(c) for c in make()]
        copier = kv_layout.BlockCopier(caches, layouts_of(caches), BLOCKS, native=native)
        copier.scatter(stored, block_ids)
        back = [bytearray(BLOCK_BYTES) for _ in stored]
        copier.gather(block_ids, back)
        assert [bytes(b) for b in back] == stored
        results.append(caches)
    for a, b in zip(*results, strict=True):
        assert a.view(torch.uint8).equal(b.view(torch.uint8))  # random bytes: NaNs among them


@pytest.mark.parametrize("make", [cpu_caches, block_major_caches, kv_split_caches])
def test_the_copier_moves_many_blocks_by_address_as_the_torch_path_does(
    make: Callable[[], list[torch.Tensor]],
) -> None:
    """By address (libc memmove) and through torch, the same stored blocks land on the same bytes,
    block by block and one layer at a time (layer-wise loading)."""
    source = make()
    stored = [bytearray(BLOCK_BYTES) for _ in range(3)]
    kv_layout.BlockCopier(source, layouts_of(source), BLOCKS, by_address=False).gather(
        [4, 0, 2], [memoryview(b) for b in stored]
    )
    for b, block_id in zip(stored, [4, 0, 2], strict=True):  # gather agrees with block_views
        expected = torch.cat(kv_layout.block_views(source, layouts_of(source), block_id))
        assert bytes(b) == expected.numpy().tobytes()
    results = []
    for by_address, native in COPY_PATHS:
        caches = [torch.zeros_like(c) for c in source]
        copier = kv_layout.BlockCopier(
            caches, layouts_of(caches), BLOCKS, by_address=by_address, native=native
        )
        assert copier.by_address is by_address and copier.native is bool(native)
        copier.scatter([bytes(b) for b in stored], [1, 3, 5], layers=[2, 0])
        copier.scatter([memoryview(b) for b in stored], [1, 3, 5], layers=[1])
        copier.synchronize()
        results.append(caches)
        back = [bytearray(BLOCK_BYTES) for _ in range(3)]
        copier.gather([1, 3, 5], back)
        assert back == stored
    for other in results[1:]:  # every path leaves the caches alike
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
    for block_id in (0, 2, 4):  # the blocks not written stay as they were
        assert not any(v.any() for v in kv_layout.block_views(results[0], layouts_of(source), block_id))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make", [cpu_caches, block_major_caches, kv_split_caches])
def test_the_staged_copy_moves_runs_of_adjacent_slots_in_batches(
    make: Callable[[str], list[torch.Tensor]], device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged copy (what caches on a GPU use): sources lying end to end in one buffer (an
    arena's slots of one chain) go over as one run, the others one by one, two blocks staged at
    a time here; every byte lands where the CPU's copy by address puts it, in an order vLLM
    could hand out, and gathering back into adjacent slots reads the same bytes."""
    monkeypatch.setattr(device_copy, "STAGE_BYTES", 2 * BLOCK_BYTES)
    rng = np.random.default_rng(11)
    arena = bytearray(rng.integers(0, 256, 6 * BLOCK_BYTES, dtype=np.uint8).tobytes())
    slot = [memoryview(arena)[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES] for i in range(6)]
    sources = [slot[0], slot[1], slot[2], slot[4], bytes(slot[3])]  # a run of three, two alone
    block_ids = [4, 0, 5, 2, 3]
    expected = [torch.zeros_like(c) for c in make("cpu")]
    kv_layout.BlockCopier(expected, layouts_of(expected), BLOCKS, by_address=True, native=False).scatter(
        sources, block_ids
    )
    caches = [torch.zeros_like(c) for c in make(device)]
    copier = kv_layout.BlockCopier(caches, layouts_of(caches), BLOCKS, by_address=False)
    assert not copier.by_address and copier._staged is not None and copier._staged.stage_blocks == 2
    copier.scatter(sources, block_ids)
    copier.synchronize()
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    back = bytearray(6 * BLOCK_BYTES)
    targets = [memoryview(back)[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES] for i in (0, 1, 2, 4, 3)]
    copier.gather(block_ids, targets)
    copier.synchronize()
    assert [bytes(t) for t in targets] == [bytes(s) for s in sources]
    with pytest.raises(ValueError, match="read-only"):
        copier.gather([0], [bytes(BLOCK_BYTES)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("make", [block_major_caches, kv_split_caches])
def test_the_staged_copy_replays_full_batches_byte_for_byte(
    make: Callable[[str], list[torch.Tensor]], device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a full batch's kernels are captured once and replayed after (``replays``); on
    the CPU they are always issued one by one. Either way three calls of five blocks (batches
    of 2, 2 and 1, other blocks and bytes each time) put every byte where the copy by address
    puts it, and a gather reads the same bytes back, a layer-wise restore between them."""
    monkeypatch.setattr(device_copy, "STAGE_BYTES", 2 * BLOCK_BYTES)
    rng = np.random.default_rng(21)
    caches = [torch.zeros_like(c) for c in make(device)]
    copier = kv_layout.BlockCopier(caches, layouts_of(caches), BLOCKS, by_address=False)
    expected = [torch.zeros_like(c) for c in make("cpu")]
    by_address = kv_layout.BlockCopier(expected, layouts_of(expected), BLOCKS, by_address=True, native=False)
    for call in range(3):
        sources = [bytes(rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)) for _ in range(5)]
        block_ids = [int(b) for b in rng.permutation(BLOCKS)[:5]]
        if call == 1:  # layer by layer, as a layer-wise restore: never a graph
            for layer in range(LAYERS):
                copier.scatter(sources, block_ids, layers=(layer,))
        else:
            copier.scatter(sources, block_ids)
        by_address.scatter(sources, block_ids)
        copier.synchronize()
        for got, want in zip(caches, expected, strict=True):
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
        back = [bytearray(BLOCK_BYTES) for _ in range(5)]
        copier.gather(block_ids, back)
        copier.synchronize()
        assert [bytes(b) for b in back] == sources
    assert copier._staged is not None
    # On CUDA: the first call captures each stage's batch, the last replays them (two scatter
    # batches, and four gather batches of the last two calls).
    assert copier._staged.replays == (6 if device == "cuda" else 0)


@pytest.mark.parametrize(("shape", "word"), [((2, 6, 4, 2, 8), torch.int64), ((2, 6, 3, 1, 5), torch.uint8)])
def test_the_staged_copy_moves_the_widest_words_the_layout_allows(
    shape: tuple[int, ...], word: torch.dtype
) -> None:
    """Slices of whole 8-byte words move as int64; a layout of odd byte counts (15 B slices)
    moves byte by byte, and lands the same bytes as the copy by address."""
    rng = np.random.default_rng(3)
    caches = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
    layouts = [kv_layout.describe(c, 6) for c in caches]
    staged = kv_layout.BlockCopier(caches, layouts, 6, by_address=False)
    assert staged._staged is not None and staged._staged.word == word
    stored = [bytes(rng.integers(0, 256, staged.block_bytes, dtype=np.uint8)) for _ in range(3)]
    staged.scatter(stored, [5, 1, 3])
    expected = [torch.zeros_like(c) for c in caches]
    kv_layout.BlockCopier(expected, layouts, 6, by_address=True, native=False).scatter(stored, [5, 1, 3])
    assert all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))
    back = [bytearray(staged.block_bytes) for _ in range(3)]
    staged.gather([5, 1, 3], back)
    assert [bytes(b) for b in back] == stored


@pytest.mark.parametrize("make", [cpu_caches, kv_split_caches])
def test_a_copy_by_layer_lands_what_a_whole_copy_does_and_counts_every_layer(
    make: Callable[[], list[torch.Tensor]],
) -> None:
    """``start_by_layer`` (layer-wise loads: natively a C thread of its own) leaves the caches
    as ``scatter`` does, on the native and numpy paths; its count ends at every layer."""
    rng = np.random.default_rng(9)
    stored = [bytes(rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)) for _ in range(4)]
    block_ids = [5, 2, 3, 0]
    whole = [torch.zeros_like(c) for c in make()]
    kv_layout.BlockCopier(whole, layouts_of(whole), BLOCKS, by_address=False).scatter(stored, block_ids)
    with ThreadPoolExecutor(1) as loader:
        for _, native in COPY_PATHS[:-1]:  # by address: where layer-wise loads run
            caches = [torch.zeros_like(c) for c in whole]
            copier = kv_layout.BlockCopier(caches, layouts_of(caches), BLOCKS, native=native)
            copy = copier.start_by_layer([memoryview(b) for b in stored], block_ids, loader)
            copy.wait_for(1)
            assert copy.layers_done() >= 1
            assert copy.wait() >= 0.0
            assert copy.layers_done() == len(caches) == copy.num_layers
            for a, b in zip(caches, whole, strict=True):
                assert a.view(torch.uint8).equal(b.view(torch.uint8))


@pytest.mark.skipif(kv_layout._blockcopy is None, reason="the native copier is not built")
def test_the_native_layer_copy_refuses_layers_outside_its_parts_and_a_missing_count() -> None:
    """The C entry point checks the layer bounds and the progress buffer before any copy."""
    native = kv_layout._blockcopy
    assert native is not None
    caches = cpu_caches()
    before = [c.clone() for c in caches]
    copier = kv_layout.BlockCopier(caches, layouts_of(caches), BLOCKS)
    target = bytearray(BLOCK_BYTES)
    addresses = np.asarray([host_buffers.address(target)], dtype=np.uint64)
    ids = np.zeros(1, dtype=np.int64)
    parts = copier._all_parts
    with pytest.raises(ValueError, match="outside"):
        native.copy_layers(
            addresses, ids, parts, np.array([0, len(parts) + 1], dtype=np.int64), np.zeros(2, np.int64)
        )
    with pytest.raises(ValueError, match="inconsistent"):
        native.copy_layers(addresses, ids, parts, copier._layer_starts, np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="no count"):
        native.layers_done(b"")
    for a, b in zip(caches, before, strict=True):  # nothing was copied
        assert a.view(torch.uint8).equal(b.view(torch.uint8))


def test_the_copier_refuses_a_block_outside_the_caches_or_a_buffer_of_another_size() -> None:
    caches = cpu_caches()
    before = [c.clone() for c in caches]
    copier = kv_layout.BlockCopier(caches, layouts_of(caches), BLOCKS)
    with pytest.raises(ValueError, match="outside"):
        copier.scatter([bytes(BLOCK_BYTES), bytes(BLOCK_BYTES)], [0, BLOCKS])
    with pytest.raises(ValueError, match="outside"):
        copier.gather([-1], [bytearray(BLOCK_BYTES)])
    with pytest.raises(ValueError, match=f"of {BLOCK_BYTES - 2} B"):
        copier.scatter([bytes(BLOCK_BYTES), bytes(BLOCK_BYTES - 2)], [0, 1])
    with pytest.raises(ValueError, match="2 buffers for 1 blocks"):
        copier.scatter([bytes(BLOCK_BYTES)] * 2, [0])
    for a, b in zip(caches, before, strict=True):  # nothing was copied before the refusal
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [cpu_caches, kv_split_caches])
def test_the_copier_moves_runs_of_evenly_spaced_slots_in_one_strided_copy_per_layer(
    make: Callable[[], list[torch.Tensor]],
) -> None:
    """Slots evenly spaced in one buffer (an arena's) go as strided runs whatever the order of
    their block ids (vLLM's are often descending); another spacing or another buffer starts a new
    run: every block lands where the block-by-block torch path puts it, and gathering reads back
    the same bytes."""
    source = make()
    spacing = BLOCK_BYTES + 512
    arena = bytearray(spacing * 8)
    slots = [memoryview(arena)[i * spacing : i * spacing + BLOCK_BYTES] for i in (0, 1, 2, 3, 5)]
    buffers = [*slots, memoryview(bytearray(BLOCK_BYTES))]
    block_ids = [2, 1, 0, 4, 5, 3]
    kv_layout.BlockCopier(source, layouts_of(source), BLOCKS, by_address=False).gather(block_ids, buffers)
    runs = host_buffers.runs(buffers, [host_buffers.address(b) for b in buffers], BLOCK_BYTES)
    assert [(r.first, r.count, r.stride) for r in runs] == [
        (0, 4, spacing),  # slots 0-3, for blocks 2, 1, 0 and 4
        (4, 1, 0),  # slot 5: twice the spacing, alone before another buffer
        (5, 1, 0),  # another buffer: one memmove per slice
    ]
    results = []
    for by_address, native in COPY_PATHS:
        caches = [torch.zeros_like(c) for c in source]
        copier = kv_layout.BlockCopier(
            caches, layouts_of(caches), BLOCKS, by_address=by_address, native=native
        )
        copier.scatter(buffers, block_ids)
        results.append(caches)
        back = [memoryview(bytearray(BLOCK_BYTES * 2))[:BLOCK_BYTES] for _ in buffers]
        copier.gather(block_ids, back)
        assert [bytes(b) for b in back] == [bytes(b) for b in buffers]
        spaced = memoryview(bytearray(spacing * 6))  # gathered as runs into one buffer too
        copier.gather(block_ids, [spaced[i * spacing : i * spacing + BLOCK_BYTES] for i in range(6)])
        assert [bytes(spaced[i * spacing : i * spacing + BLOCK_BYTES]) for i in range(6)] == [
            bytes(b) for b in buffers
        ]
    for other in results[1:]:  # every path leaves the caches alike
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(results[0], source, strict=True):
        assert torch.equal(a, b)  # every block of the source came back (ids 0-5, all of them)
