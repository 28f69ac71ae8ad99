"""``kvstore bench service``'s same-host rows: restore and store through the mapped arena against
copies of the same bytes, and writes into a full arena with the cleaner and without it."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.common import Result, interleaved
from benchmarks.server_process import ServerProcess
from benchmarks.service_setup import (
    BLOCK,
    MODEL,
    SMALL_BLOCK,
    SMALL_MODEL,
    bench_server,
    make_blocks,
    make_keys,
)
from kvstore.client import Client, ResolvedBlocks, connect
from kvstore.client.inplace import Slots, gather_from_slots, scatter_into_slots
from kvstore.keys import BlockKey
from tiers.dram import Arena


def bench_same_host(server: ServerProcess, count: int, rounds: int, small: bool = False) -> list[Result]:
    """The references copy the same bytes block by block out of, and into, slots of the very
    arena the service hands out (mapped the same way, in this process), through the client's
    own copy loop: what a row's ratio leaves out is the data movement, what it shows is what
    the service adds. A copy's speed depends on which memory it touches, and the server's arena
    (a /dev/shm file both processes map) copied slower on the machines measured than a region
    this process created itself: a copy into such a region is shown beside each row as a second
    reference, for what it says about the machine, not about the service.
    ``small``: 256 KiB blocks (the same model in 2-token blocks), eight times as many, so the
    service's per-block work weighs eight times as much against the copy."""
    model, size = (SMALL_MODEL, SMALL_BLOCK) if small else (MODEL, BLOCK)
    count = count * (BLOCK // size)
    fp = model.fingerprint()
    keys, blocks = make_blocks(count, 11, model, size)
    engine = np.zeros(count * size, dtype=np.uint8)  # the engine's KV buffer, warm
    outs = [memoryview(engine[i * size : (i + 1) * size].data) for i in range(count)]
    source = np.frombuffer(b"".join(blocks), dtype=np.uint8)
    with contextlib.ExitStack() as stack:
        # A private shared-memory region, the same size, for the second reference of each row.
        shm = Arena.create_unnamed(count * size)
        stack.callback(shm.close)
        shm.array[:] = source
        kv = stack.enter_context(connect(server.unix))
        settle_mapping(kv)
        kv.register(model)
        if kv.write(fp, keys, blocks) != count:
            raise RuntimeError("same-host write stored fewer blocks than sent")
        # The references' slots: the stored blocks, under a resolve held while a reference
        # copies (see _same_host_rounds).
        held = kv.resolve(fp, keys, ttl_s=600)
        if len(held.views) != count:
            raise RuntimeError("the arena gave the references fewer slots than blocks")
        results = _same_host_rounds(kv, fp, keys, blocks, engine, outs, shm.array, held, rounds)
        kv.invalidate(fp)  # room for the next rows
        return results


def settle_mapping(kv: Client) -> None:
    """Map the arena and wait until this process's page tables for it are filled: that runs on
    a thread for ~0.2 s a GiB after the first attach (``Arena.populate_in_background``), and
    copies timed meanwhile share their CPUs with it (the first writes of a 512 MiB arena ran at
    half speed here), a one-time cost of attaching, not what a row measures."""
    if not kv.attach().wait_populated(timeout_s=120):
        raise RuntimeError("the arena's mapping was still being populated after 120 s")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _same_host_rounds(
    kv: Client,
    fp: bytes,
    keys: list[BlockKey],
    blocks: list[bytes],
    engine: np.ndarray,
    outs: list[memoryview],
    private: np.ndarray,
    held: ResolvedBlocks,
    rounds: int,
) -> list[Result]:
    count = len(keys)
    size = len(blocks[0])
    label = "2 MiB" if size == BLOCK else f"{size // 1024} KiB"
    arena_out = held.views

    def restore() -> float:
        start = time.perf_counter()
        if kv.read_into(fp, keys, outs) != count:
            raise RuntimeError("same-host restore found fewer blocks than stored")
        return time.perf_counter() - start

    # The references' copies run through the client's own copy loop (one native call over all
    # blocks when tiers._gather is built), so that a ratio shows what the service adds to it.
    region = kv.attach().view
    base = _address(region)
    slots_out = [(_address(v) - base, len(v)) for v in arena_out]
    # A store's reference copies the same bytes into the very slots that store used: a copy's
    # speed here depends on where in the arena it lands (copies into different 128 MiB ranges of
    # one arena differed by up to 1.18x on the same machine), so slots elsewhere would show the
    # machine, not the service. Each store round pins what it stored (a resolve, outside its timing), and the
    # reference after it writes those blocks' own bytes over them under that pin.
    slots_in = list(slots_out)
    pinned = [held.lease_id]
    private_slots = [(i * size, size) for i in range(count)]
    private_view = memoryview(private.data)

    def copying(
        copy: Callable[[memoryview, Slots, Sequence[Any]], None],
        source: memoryview,
        slots: Slots,
        bufs: Sequence[Any],
    ) -> Callable[[], float]:
        """A reference: the same bytes, block by block, through the client's own copy loop."""

        def run() -> float:
            start = time.perf_counter()
            copy(source, slots, bufs)
            return time.perf_counter() - start

        return run

    # out of the arena's slots into the engine's buffer: the data movement of a restore
    copy_out = copying(gather_from_slots, region, slots_out, outs)
    copy_out_private = copying(gather_from_slots, private_view, private_slots, outs)
    # The plain get's reference copies into the very buffers that get returned (its receive
    # pool's), kept until then and dropped after, so that the next get reuses them: buffers
    # elsewhere in memory would copy at another speed (as the store rows' slots, below).
    got: list[memoryview] = []

    def copy_out_got() -> float:
        start = time.perf_counter()
        gather_from_slots(region, slots_out, got)
        elapsed = time.perf_counter() - start
        got.clear()
        return elapsed

    def copy_out_whole() -> float:
        start = time.perf_counter()
        np.copyto(engine, private)
        return time.perf_counter() - start

    def storing(store: Callable[[bytes, list[BlockKey], list[bytes]], int]) -> Callable[[], float]:
        """A round of ``store`` (``kv.write``, or ``kv.put``: in place too on the same host)
        into an arena emptied first; the slots it used become the reference's."""

        def run() -> float:
            kv.release(pinned.pop())
            kv.invalidate(fp)
            start = time.perf_counter()
            stored = store(fp, keys, blocks)
            elapsed = time.perf_counter() - start
            if stored != count:
                raise RuntimeError(f"same-host store stored {stored} of {count} blocks")
            now = kv.resolve(fp, keys, ttl_s=600)
            pinned.append(now.lease_id)
            slots_in[:] = [(_address(v) - base, len(v)) for v in now.views]
            return elapsed

        return run

    write_round, put_round = storing(kv.write), storing(kv.put)

    copy_in = copying(scatter_into_slots, region, slots_in, blocks)  # a store's data movement
    copy_in_private = copying(scatter_into_slots, private_view, private_slots, blocks)

    def plain_get() -> float:
        """What a script writes: ``kv.get``, views of the thread's receive pool, dropped (after
        the reference's copy into them)."""
        start = time.perf_counter()
        views = kv.get(fp, keys)
        elapsed = time.perf_counter() - start
        if len(views) != count:
            raise RuntimeError("same-host get found fewer blocks than stored")
        got[:] = views
        return elapsed

    restore()
    restore_s, ref_s = interleaved(restore, copy_out, rounds)
    plain_get()
    copy_out_got()
    plain_get()
    get_s, ref_get = interleaved(plain_get, copy_out_got, rounds)
    got.clear()
    _, ref_private = interleaved(restore, copy_out_private, rounds)
    _, ref_whole = interleaved(restore, copy_out_whole, rounds)
    if bytes(outs[-1]) != blocks[-1]:
        raise RuntimeError("same-host restore returned wrong bytes")
    write_s, ref_w = interleaved(write_round, copy_in, rounds)
    _, ref_w_private = interleaved(write_round, copy_in_private, rounds)
    put_s, ref_put = interleaved(put_round, copy_in, rounds)
    kv.release(pinned.pop())
    gbps = count * size / 1e9
    return [
        Result(
            f"same-host restore {label}",
            gbps / restore_s,
            "GB/s",
            "memcpy out of the arena's slots, block by block",
            gbps / ref_s,
            ">= 0.9",
            "lookup naming the arena slots (pins) + copy from the mapped arena + release, Unix socket",
        ),
        Result(
            f"same-host get {label} (plain client.get)",
            gbps / get_s,
            "GB/s",
            "memcpy out of the arena's slots into the buffers the get returned",
            gbps / ref_get,
            ">= 0.9",
            "lookup naming the arena slots (pins) + copy into the thread's receive pool + release",
        ),
        Result(
            f"same-host restore {label} (vs a private region)",
            gbps / restore_s,
            "GB/s",
            "memcpy out of a region this process made",
            gbps / ref_private,
            note="the same copy out of shared memory this process created itself: faster here "
            "than out of any other process's arena",
        ),
        Result(
            f"same-host restore {label} (vs one big copy)",
            gbps / restore_s,
            "GB/s",
            "memcpy, one call",
            gbps / ref_whole,
            note="a single memcpy of all blocks at once out of the private region",
        ),
        Result(
            f"same-host store {label}",
            gbps / write_s,
            "GB/s",
            "memcpy into the slots the store used",
            gbps / ref_w,
            ">= 0.9",
            "Reserve + copy into the mapped arena + Commit over the Unix data socket, pipelined in chunks",
        ),
        Result(
            f"same-host put {label} (plain client.put)",
            gbps / put_s,
            "GB/s",
            "memcpy into the slots the store used",
            gbps / ref_put,
            ">= 0.9",
            "the same in-place write as the row above, reached through put",
        ),
        Result(
            f"same-host store {label} (vs a private region)",
            gbps / write_s,
            "GB/s",
            "memcpy into a region this process made",
            gbps / ref_w_private,
            note="the same copy into shared memory this process created itself",
        ),
    ]


FULL_ARENA_PAUSE_S = 0.6  # between the writes into a full arena: the disk's time for a chain


def bench_full_arena(count: int, writes: int = 6) -> list[Result]:
    """Same-host writes of ``count``-block chains (2 MiB blocks) into a server whose arena holds
    three of them and is full, each write after a pause of FULL_ARENA_PAUSE_S (the bursts of a
    serving engine, the disk idle in between): the median write against the same writes, after
    the same pause, into the empty arena of the same server; once with the cleaner (``store.clean_ahead``, the default)
    and once without (``clean_ahead=0``: every victim is demoted on the write's path)."""
    results = []
    for label, settings in (("", {}), (" (clean_ahead=0)", {"store.clean_ahead": "0"})):
        empty, full, counters = _full_arena_writes(count, writes, settings)
        gb = count * BLOCK / 1e9
        results.append(
            Result(
                f"same-host store 2 MiB into a full arena{label}",
                gb / statistics.median(full),
                "GB/s",
                "the same writes, as far apart, into the empty arena",
                gb / statistics.median(empty),
                ">= 0.7" if not label else None,
                f"{writes} writes of {count} x 2 MiB, {FULL_ARENA_PAUSE_S} s apart, into an arena of "
                f"{3 * count}; cleaned ahead {counters.get('cleaned_blocks', 0)}, demoted on the write's "
                f"path {counters.get('demotions', 0)}, dropped for a busy disk "
                f"{counters.get('nvme_busy_skipped_blocks', 0)}",
            )
        )
    return results


def _full_arena_writes(
    count: int, writes: int, settings: Mapping[str, str]
) -> tuple[list[float], list[float], Mapping[str, int]]:
    """(seconds of each write into the empty arena, of each into the full one, the counters)."""
    server = bench_server(arena_bytes=3 * count * BLOCK, settings=settings)
    try:
        fp = MODEL.fingerprint()
        _, payloads = make_blocks(count, 100, MODEL, BLOCK)
        chains = [make_keys(count, 300 + i) for i in range(3 + writes)]
        with connect(server.unix) as kv:
            settle_mapping(kv)
            kv.register(MODEL)

            def write(keys: list[BlockKey]) -> float:
                start = time.perf_counter()
                if kv.write(fp, keys, payloads) != count:
                    raise RuntimeError("a write into the arena stored fewer blocks than sent")
                return time.perf_counter() - start

            # The empty-arena writes come after the same pause as the full ones: a write after
            # 0.6 s idle ran 20-28% slower than one straight after another here, which is the
            # machine waking, not the arena being full.
            empty = []
            for _ in range(3):
                time.sleep(FULL_ARENA_PAUSE_S)
                empty.append(write(chains[0]))
                kv.invalidate(fp)
            for keys in chains[:3]:  # full from here on
                write(keys)
            full = []
            for keys in chains[3:]:
                time.sleep(FULL_ARENA_PAUSE_S)
                full.append(write(keys))
            return empty, full, kv.stats()["counters"]
    finally:
        server.stop()
