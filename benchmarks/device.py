"""``kvstore bench device``: the copies between the tiers and a GPU, each against the same bytes
moved by torch between a pinned host tensor and device memory in the same run. Needs CUDA;
without it every row says so and nothing is measured.

For 256 KiB and 2 MiB blocks and a working set of ``total`` bytes, block by block:

- arena -> GPU and GPU -> arena through a second mapping of the arena, as an engine attaches it
  (``Arena.attach``): registered with CUDA by that mapping (``Arena.pin_with_cuda``, what the
  connector does), and not registered (what the engine had before: the server's registration
  covers the server's mapping alone). Target: the pinned mapping >= 0.9x the pinned tensor.
- The connector's restore and save of 2 MiB blocks into FlashAttention's kv-split caches of a
  32-layer model (``BlockCopier`` on GPU caches: whole blocks staged on the device, one kernel a
  slice of the batch, a full batch's kernels replayed from a CUDA graph after its first run),
  out of and into adjacent slots of the pinned arena, block ids shuffled;
  the reference is one copy of the same bytes between a pinned tensor and the device. The copy
  the connector made before (one ``copy_`` per layer slice of every block) has its own row.
- The connector's remote restore (the data port of a ``kvstore serve`` on 127.0.0.1) into those
  caches through its pinned staging buffer, against the same through pageable buffers.
- A layer-wise restore beside a stand-in forward against the whole restore before it
  (``benchmarks.device_layerwise``).
- The ``hbm`` tier: put from and get into pinned host memory, against the pinned tensor's copies;
  a slot copied into another device buffer (device to device) against torch's copy of the same
  bytes between two device buffers.
- How long registering a 4 GiB arena with CUDA takes (it pins every page): informational.

Subject and reference are measured alternately, medians reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.common import Result, gbps, interleaved, print_results, size_label, write_json
from benchmarks.device_layerwise import bench_layerwise
from benchmarks.tiers_working import timed
from engine_plugin import kv_layout
from tiers import TierKey
from tiers.dram import Arena, DramConfig, DramTier

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FP = b"\x42" * 32
# A 32-layer model with 8 KV heads of 128, 16-token blocks, bf16: 2 MiB a block.
LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16


def _timed(fn: Callable[[], None]) -> Callable[[], float]:
    return timed(fn, settle=torch.cuda.synchronize)


def _blockwise(dst: torch.Tensor, src: torch.Tensor, size: int) -> Callable[[], None]:
    """Copy ``src`` into ``dst`` (same length) one block of ``size`` at a time, asynchronously."""

    def copy() -> None:
        for offset in range(0, src.numel(), size):
            dst[offset : offset + size].copy_(src[offset : offset + size], non_blocking=True)

    return copy


def bench_arena_copies(size: int, total: int, rounds: int) -> list[Result]:
    label = size_label(size)
    tier = DramTier(DramConfig(capacity_bytes=total, page_bytes=max(size, 32 * MiB), pin_with_cuda="off"))
    pinned_map, plain_map = Arena.attach(tier.arena.name), Arena.attach(tier.arena.name)
    try:
        assert pinned_map.pin_with_cuda(), "cudaHostRegister refused the arena"
        tier.arena.array[:] = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
        host = torch.empty(total, dtype=torch.uint8).pin_memory()
        host.copy_(torch.from_numpy(tier.arena.array))
        device = torch.empty(total, dtype=torch.uint8, device="cuda")
        pinned = torch.frombuffer(pinned_map.view, dtype=torch.uint8)
        plain = torch.frombuffer(plain_map.view, dtype=torch.uint8)
        ref_in = _timed(_blockwise(device, host, size))
        ref_out = _timed(_blockwise(host, device, size))
        results = []
        for name, mapping, target in (
            ("pinned by the engine", pinned, ">= 0.9"),
            ("not pinned (before)", plain, None),
        ):
            h2d, ref = interleaved(_timed(_blockwise(device, mapping, size)), ref_in, rounds)
            results.append(
                Result(
                    f"arena -> GPU {label}, mapping {name}",
                    gbps(total, h2d),
                    "GB/s",
                    "pinned tensor -> GPU",
                    gbps(total, ref),
                    target,
                )
            )
            d2h, ref = interleaved(_timed(_blockwise(mapping, device, size)), ref_out, rounds)
            results.append(
                Result(
                    f"GPU -> arena {label}, mapping {name}",
                    gbps(total, d2h),
                    "GB/s",
                    "GPU -> pinned tensor",
                    gbps(total, ref),
                    target,
                )
            )
        if not torch.equal(device.cpu(), torch.from_numpy(tier.arena.array.copy())):
            raise AssertionError("the bytes copied do not match the arena's")
        return results
    finally:
        pinned_map.close()
        plain_map.close()
        tier.close()


def _per_slice_scatter(
    copier_caches: list[torch.Tensor], sources: list[torch.Tensor], block_ids: list[int]
) -> Callable[[], None]:
    """The connector's copy before the staged one: a ``copy_`` per layer slice of every block."""

    def copy() -> None:
        for src, block_id in zip(sources, block_ids, strict=True):
            offset = 0
            for cache in copier_caches:
                for half in (cache[0, block_id], cache[1, block_id]):
                    flat = half.reshape(-1).view(torch.uint8)
                    flat.copy_(src[offset : offset + flat.numel()], non_blocking=True)
                    offset += flat.numel()

    return copy


def bench_connector(blocks: int, rounds: int) -> list[Result]:
    shape = (2, blocks, BLOCK_TOKENS, HEADS, HEAD_DIM)
    caches = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    layouts = [kv_layout.describe(c, blocks) for c in caches]
    copier = kv_layout.BlockCopier(caches, layouts, blocks)
    size = copier.block_bytes
    total = blocks * size
    tier = DramTier(DramConfig(capacity_bytes=total, page_bytes=max(size, 32 * MiB), pin_with_cuda="off"))
    engine_map = Arena.attach(tier.arena.name)
    try:
        engine_map.pin_with_cuda()
        slots = [engine_map.view[i * size : (i + 1) * size] for i in range(blocks)]
        block_ids = [int(b) for b in np.random.default_rng(2).permutation(blocks)]
        # Every byte first: random slots in, back out into other buffers, compared.
        tier.arena.array[:] = np.random.default_rng(3).integers(0, 256, total, dtype=np.uint8)
        copier.scatter(slots, block_ids)
        back = [bytearray(size) for _ in range(blocks)]
        copier.gather(block_ids, back)
        copier.synchronize()
        if any(bytes(b) != bytes(s) for b, s in zip(back, slots, strict=True)):
            raise AssertionError("the staged copy lost or moved bytes")
        host = torch.empty(total, dtype=torch.uint8).pin_memory()
        device = torch.empty(total, dtype=torch.uint8, device="cuda")

        def copy_in() -> None:
            device.copy_(host, non_blocking=True)

        def copy_out() -> None:
            host.copy_(device, non_blocking=True)

        ref_in, ref_out = _timed(copy_in), _timed(copy_out)
        gather = _timed(lambda: copier.gather(block_ids, slots))
        scatter = _timed(lambda: copier.scatter(slots, block_ids))
        save_s, ref_save = interleaved(gather, ref_out, rounds)
        restore_s, ref_restore = interleaved(scatter, ref_in, rounds)
        sources = [torch.frombuffer(s, dtype=torch.uint8) for s in slots]
        before_s, ref_before = interleaved(
            _timed(_per_slice_scatter(caches, sources, block_ids)), ref_in, rounds
        )
        label = f"{size_label(size)} blocks, {LAYERS} layers kv-split"
        staged = copier._staged
        assert staged is not None  # caches on a GPU are copied staged
        return [
            Result(
                f"connector restore into GPU caches, {label}",
                gbps(total, restore_s),
                "GB/s",
                "pinned tensor -> GPU, one copy",
                gbps(total, ref_restore),
                ">= 0.9",
                note=f"{blocks} blocks staged {staged.stage_blocks} at a time; {staged.replays} full "
                "batches (both rows) replayed from CUDA graphs",
            ),
            Result(
                f"connector save from GPU caches, {label}",
                gbps(total, save_s),
                "GB/s",
                "GPU -> pinned tensor, one copy",
                gbps(total, ref_save),
                ">= 0.9",
            ),
            Result(
                f"connector restore, a copy per layer slice (before), {label}",
                gbps(total, before_s),
                "GB/s",
                "pinned tensor -> GPU, one copy",
                gbps(total, ref_before),
                note=f"{blocks * LAYERS * 2} copies",
            ),
        ]
    finally:
        engine_map.close()
        tier.close()


def bench_remote_restore(blocks: int, rounds: int) -> Result:
    """The connector's remote restore (a ``kvstore serve`` on 127.0.0.1, the data port) into GPU
    caches through its pinned staging buffer, against the same restore through the client's
    pageable receive buffers (what it did before)."""
    from benchmarks.service_setup import MODEL, TOKEN, bench_server
    from engine_plugin.transfer import BlockTransfer
    from kvstore.client import connect
    from kvstore.keys import block_keys

    shape = (2, blocks, MODEL.tokens_per_block, MODEL.num_kv_heads, MODEL.head_dim)
    caches = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(MODEL.num_layers)]
    layouts = [kv_layout.describe(c, blocks) for c in caches]
    fp, size = MODEL.fingerprint(), MODEL.block_bytes
    keys = block_keys(fp, list(range(blocks * MODEL.tokens_per_block)), MODEL.tokens_per_block)
    block_ids = [int(b) for b in np.random.default_rng(4).permutation(blocks)]
    server = bench_server(arena_bytes=(blocks + 64) * size)
    try:
        with connect(server.tcp, token=TOKEN) as kv:
            kv.register(MODEL)
            staged = BlockTransfer(caches, layouts, fp, size, False, blocks)
            plain = BlockTransfer(caches, layouts, fp, size, False, blocks, remote_staging=False)
            staged.store(kv, keys, block_ids, None)

            def restore(transfer: BlockTransfer) -> Callable[[], None]:
                def run() -> None:
                    if transfer.fetch(kv, keys, block_ids) != blocks:
                        raise AssertionError("the remote restore came back short")

                return run

            staged_s, plain_s = interleaved(_timed(restore(staged)), _timed(restore(plain)), rounds)
    finally:
        server.stop()
    return Result(
        f"connector remote restore into GPU caches, {size_label(size)} blocks",
        gbps(blocks * size, staged_s),
        "GB/s",
        "the same through pageable buffers (before)",
        gbps(blocks * size, plain_s),
        note=f"{blocks} blocks over the data port, 127.0.0.1; pinned staging of this side's",
    )


def bench_hbm(size: int, total: int, rounds: int) -> list[Result]:
    from tiers.hbm import HbmConfig, HbmTier

    label = size_label(size)
    tier = HbmTier(HbmConfig(capacity_bytes=total + 64 * MiB, page_bytes=max(size, 32 * MiB)))
    try:
        count = total // size
        keys = [TierKey(i.to_bytes(32, "little")) for i in range(count)]
        host = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
        back = torch.empty(total, dtype=torch.uint8).pin_memory()
        views = [host.numpy().data[i * size : (i + 1) * size] for i in range(count)]
        outs = [back.numpy().data[i * size : (i + 1) * size] for i in range(count)]
        device = torch.empty(total, dtype=torch.uint8, device="cuda")
        other = torch.empty(total, dtype=torch.uint8, device="cuda")

        def put_all() -> None:
            for key, view in zip(keys, views, strict=True):
                tier.put(key, view, FP)

        def get_all() -> None:
            for key, out in zip(keys, outs, strict=True):
                tier.get_into(key, out)

        def device_copies() -> None:
            for i, key in enumerate(keys):
                slot = tier.locate(key)
                assert slot is not None
                device[i * size : (i + 1) * size].copy_(tier.slot_tensor(slot), non_blocking=True)

        put_s, ref_put = interleaved(_timed(put_all), _timed(_blockwise(device, host, size)), rounds)
        for key in keys:  # put again replaces: keep one copy of each for the reads
            tier.delete(key)
        put_all()
        get_s, ref_get = interleaved(_timed(get_all), _timed(_blockwise(back, device, size)), rounds)
        if not torch.equal(back, host):
            raise AssertionError("the hbm tier gave back other bytes")
        d2d_s, ref_d2d = interleaved(_timed(device_copies), _timed(_blockwise(other, device, size)), rounds)
        return [
            Result(
                f"hbm put {label}", gbps(total, put_s), "GB/s", "pinned tensor -> GPU", gbps(total, ref_put)
            ),
            Result(
                f"hbm get {label}", gbps(total, get_s), "GB/s", "GPU -> pinned tensor", gbps(total, ref_get)
            ),
            Result(
                f"hbm slot -> GPU buffer {label}",
                gbps(total, d2d_s),
                "GB/s",
                "GPU -> GPU, torch",
                gbps(total, ref_d2d),
                note="bytes read; the copy writes as many",
            ),
        ]
    finally:
        tier.close()


def bench_registration(size_bytes: int) -> Result:
    tier = DramTier(DramConfig(capacity_bytes=size_bytes, page_bytes=32 * MiB, pin_with_cuda="off"))
    attached = Arena.attach(tier.arena.name)
    try:
        start = time.perf_counter()
        ok = attached.pin_with_cuda()
        seconds = time.perf_counter() - start
    finally:
        attached.close()
        tier.close()
    return Result(
        f"registering a {size_bytes // GiB} GiB arena mapping with CUDA",
        seconds if ok else None,
        "s",
        note="once per engine process (the connector does it at register_kv_caches)",
    )


def run_device_bench(quick: bool, json_path: str | None) -> int:
    title = f"kvstore bench device{' --quick' if quick else ''}"
    if not torch.cuda.is_available():
        results = [Result("device copies", None, "GB/s", note="skipped: no CUDA device on this machine")]
    else:
        total = 256 * MiB if quick else 1 * GiB
        rounds = 5 if quick else 15
        results = []
        for size in (256 * KiB, 2 * MiB):
            results += bench_arena_copies(size, total, rounds)
        results += bench_connector(64 if quick else 256, rounds)
        results.append(bench_remote_restore(64 if quick else 256, rounds))
        results.append(bench_layerwise(64 if quick else 256, rounds, _timed))
        for size in (256 * KiB, 2 * MiB):
            results += bench_hbm(size, total, rounds)
        results.append(bench_registration(4 * GiB))
    print_results(title, results)
    if json_path:
        write_json(json_path, results, {"command": title})
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(run_device_bench("--quick" in sys.argv, None))
