"""``kvstore bench tiers``' memory rows: the dram tier and the tiered store's get against memcpy of
the same bytes, hbm (CUDA only) against torch copies, SGLang's page restore, and the native
block copy at destinations off a cache line."""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.common import Result, gbps, interleaved, size_label
from benchmarks.tiers_working import (
    COPY_ROUNDS,
    FP,
    KiB,
    MiB,
    Working,
    aligned_zeros,
    shmem_huge_pages,
    timed,
)
from kvstore.keys import block_keys
from kvstore.store import Scope, StoreConfig, TieredStore
from tiers import Tier
from tiers.dram import Arena, DramConfig, DramTier


def _slots_of(tier: DramTier) -> list[memoryview]:
    """Every block's slot in the arena, in arena order (the order the blocks were put)."""
    slots = [slot for b in tier.scan() if (slot := tier.locate(b.key)) is not None]
    return [tier.slot_view(slot) for slot in sorted(slots, key=lambda slot: slot.offset)]


def bench_dram(w: Working, rounds: int) -> list[Result]:
    tier = DramTier(
        DramConfig(capacity_bytes=w.total + 2 * max(w.size, 32 * MiB), page_bytes=max(w.size, 32 * MiB))
    )
    # The same bytes in warm shared memory, the kind the arena is: the gets' memcpy reads this.
    shm = Arena.create_unnamed(w.total)
    shm.array[:] = w.src
    get_rounds = COPY_ROUNDS * rounds
    try:

        def memcpy_shm() -> float:
            return w.memcpy(shm.view)

        def put_all() -> float:
            for k in w.keys:
                tier.delete(k)
            start = time.perf_counter()
            for i, k in enumerate(w.keys):
                tier.put(k, w.block(i), FP)
            return time.perf_counter() - start

        def get_all() -> None:
            for k in w.keys:
                tier.get_into(k, w.dst_view)

        put_s, ref_put = interleaved(put_all, w.memcpy_spread, rounds)
        slots = _slots_of(tier)
        get_s, ref_get = interleaved(timed(get_all), lambda: w.memcpy_each(slots), get_rounds)
        shm_s, anon_s = interleaved(memcpy_shm, w.memcpy, get_rounds)

        for k in w.keys:  # the raw rounds' blocks: the store would find them unnamed and warn
            tier.delete(k)
        store = TieredStore([tier], StoreConfig(persist_on_close=False))
        scope = Scope("bench", FP)
        keys = block_keys(FP, np.arange(w.count * 4), 4)
        store.put(scope, keys, [w.block(i) for i in range(w.count)])

        outs = [w.dst_view] * len(keys)
        slots = _slots_of(tier)
        assert len(slots) == len(keys), "the raw rounds' blocks are gone: only the store's are left"

        def store_get_all() -> None:
            store.get_into_many(scope, keys, outs)

        sget_s, ref_sget = interleaved(timed(store_get_all), lambda: w.memcpy_each(slots), get_rounds)
    finally:
        tier.close()
        shm.close()
    label = size_label(w.size)

    def row(
        metric: str, s: float, ref: str, ref_s: float, target: str | None = None, note: str = ""
    ) -> Result:
        return Result(f"{metric} {label}", gbps(w.total, s), "GB/s", ref, gbps(w.total, ref_s), target, note)

    return [
        row("dram put", put_s, "memcpy", ref_put, note="reference copies into distinct warm memory too"),
        row(
            "memcpy out of /dev/shm",
            shm_s,
            "memcpy (anonymous)",
            anon_s,
            note="the arena's medium against numpy's buffers (transparent huge pages); "
            f"shared-memory huge pages here: {shmem_huge_pages()}",
        ),
        row("dram get", get_s, "memcpy (its slots)", ref_get, ">= 0.8"),
        row(
            "store get (dram)",
            sget_s,
            "memcpy (its slots)",
            ref_sget,
            ">= 0.9",
            "one get_into_many call per restore, through the index and lock",
        ),
    ]


def bench_hbm(w: Working, rounds: int) -> list[Result]:
    label = size_label(w.size)
    if not torch.cuda.is_available():
        return [Result(f"hbm put/get {label}", None, "GB/s", note="skipped: no CUDA device on this machine")]
    from tiers.hbm import HbmConfig, HbmTier

    tier: Tier = HbmTier(HbmConfig(capacity_bytes=w.total + 64 * MiB, page_bytes=max(w.size, 32 * MiB)))
    host = torch.from_numpy(w.src).pin_memory()
    dev = torch.empty(w.total, dtype=torch.uint8, device="cuda")

    def ref() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(w.count):
            dev[i * w.size : (i + 1) * w.size].copy_(host[i * w.size : (i + 1) * w.size])
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def put_all() -> float:
        start = time.perf_counter()
        for i, k in enumerate(w.keys):
            tier.put(k, w.block(i), FP)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def get_all() -> float:
        start = time.perf_counter()
        for k in w.keys:
            tier.get_into(k, w.dst_view)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    try:
        put_s, ref_s = interleaved(put_all, ref, rounds)
        get_s, ref_g = interleaved(get_all, ref, rounds)
    finally:
        tier.close()
    return [
        Result(f"hbm put {label}", gbps(w.total, put_s), "GB/s", "pinned H2D copy", gbps(w.total, ref_s)),
        Result(f"hbm get {label}", gbps(w.total, get_s), "GB/s", "pinned H2D copy", gbps(w.total, ref_g)),
    ]


def bench_sglang_pages(rounds: int, pages: int = 64, pieces: int = 64) -> list[Result]:
    """SGLang HiCache's page restore (``engine_plugin.sglang_pages``): 2 MiB blocks copied into
    the pages of a layer-first host pool, ``pieces`` pieces a page (K and V of each of 32
    layers, each in its layer's own region), through the backend's own copy, against memcpy of
    the same bytes into one contiguous buffer a page; and one numpy copy a piece (what the
    native call replaces) on the same pages."""
    from engine_plugin.sglang_pages import PageTransfer

    size = 2 * MiB
    piece = size // pieces
    rng = np.random.default_rng(5)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(pages)]
    host = np.zeros(pages * size, dtype=np.uint8)  # piece j of page p: j * pages * piece + p * piece
    targets = [
        [host[(j * pages + p) * piece : (j * pages + p + 1) * piece] for j in range(pieces)]
        for p in range(pages)
    ]
    flat = np.zeros(pages * size, dtype=np.uint8)
    transfer = PageTransfer(FP, size, same_host=False)

    def restore() -> None:
        if transfer._scatter(blocks, targets) != pages:
            raise RuntimeError("the page restore copied fewer pages than blocks")

    def piece_by_piece() -> None:
        for block, page in zip(blocks, targets, strict=True):
            source = np.frombuffer(block, dtype=np.uint8)
            for j, target in enumerate(page):
                np.copyto(target, source[j * piece : (j + 1) * piece])

    def memcpy() -> None:
        for i, block in enumerate(blocks):
            np.copyto(flat[i * size : (i + 1) * size], np.frombuffer(block, dtype=np.uint8))

    restore_s, ref_s = interleaved(timed(restore), timed(memcpy), rounds)
    before_s, _ = interleaved(timed(piece_by_piece), timed(memcpy), rounds)
    if not np.array_equal(host[:piece], np.frombuffer(blocks[0], dtype=np.uint8)[:piece]):
        raise RuntimeError("the page restore wrote wrong bytes")
    note = f"{pages} pages of {pieces} pieces ({piece // KiB} KiB each), a layer-first host pool"
    total = pages * size
    return [
        Result(
            f"sglang page restore 2 MiB, {pieces} pieces",
            gbps(total, restore_s),
            "GB/s",
            "memcpy into one buffer a page",
            gbps(total, ref_s),
            note=note + "; one native call a page (kvstore.client.inplace)",
        ),
        Result(
            f"sglang page restore 2 MiB, {pieces} pieces (one numpy copy a piece)",
            gbps(total, before_s),
            "GB/s",
            "memcpy into one buffer a page",
            gbps(total, ref_s),
            note=note + "; the copy the native call replaces",
        ),
    ]


COPY_OFFSETS = (0, 8, 16, 32, 48)  # bytes past a line the destinations start at


def bench_copy_offsets(rounds: int, size: int = 256 * KiB, count: int = 512) -> list[Result]:
    """The native block copy (``tiers/native/copy.h``'s kv_copy, through ``tiers._gather``, as
    the dram tier, the client and the connector copy) against memcpy (memoryview assignment),
    ``count`` blocks of ``size`` out of page-aligned slots into destinations starting ``offset``
    bytes past a line: glibc's memcpy slows down where the two differ in line offset, kv_copy
    copies those with a loop of its own. No target: what the machine's memcpy does, and what
    the native copy does about it."""
    try:
        from tiers import _gather  # type: ignore[attr-defined]
    except ImportError:
        return []
    stride = size + 4 * KiB
    source = aligned_zeros(count * size)
    source[:] = np.random.default_rng(3).integers(0, 256, count * size, dtype=np.uint8)
    region = memoryview(source.data)
    offsets, sizes = [i * size for i in range(count)], [size] * count
    dest = aligned_zeros(count * stride)
    results = []
    for offset in COPY_OFFSETS:
        outs = [memoryview(dest[i * stride + offset : i * stride + offset + size].data) for i in range(count)]
        ins = [region[at : at + size] for at in offsets]

        def native(outs: list[memoryview] = outs) -> None:
            _gather.gather(region, offsets, sizes, outs)

        def memcpy(outs: list[memoryview] = outs, ins: list[memoryview] = ins) -> None:
            for out, block in zip(outs, ins, strict=True):
                out[:] = block

        native_s, ref_s = interleaved(timed(native), timed(memcpy), rounds)
        if bytes(outs[-1]) != bytes(ins[-1]):
            raise RuntimeError("the native copy wrote wrong bytes")
        results.append(
            Result(
                f"copy {size_label(size)}, destination {offset} B past a line",
                gbps(count * size, native_s),
                "GB/s",
                "memcpy, the same blocks",
                gbps(count * size, ref_s),
                note="kv_copy (tiers._gather) against memoryview assignment (memcpy), out of "
                "page-aligned slots",
            )
        )
    return results
