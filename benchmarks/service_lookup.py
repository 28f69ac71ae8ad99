"""``kvstore bench service``'s lookup rows: 64-key lookup latency from one client and from four,
beside a writer that overflows the arena, and beside a noisy tenant (``benchmarks.fairness``)."""

from __future__ import annotations

import multiprocessing
import time

from benchmarks.common import Result
from benchmarks.fairness import bench_fairness, fairness_settings
from benchmarks.server_process import ServerProcess
from benchmarks.service_setup import BLOCK, MODEL, TOKEN, MiB, bench_server, make_blocks, make_keys
from kvstore.client import Client, connect
from kvstore.keys import block_keys


def _lookup_worker(
    address: str, calls: int, start_at: float, queue: multiprocessing.Queue[list[float]]
) -> None:
    fp = MODEL.fingerprint()  # once, as an engine does (it costs ~20 us of Python here)
    keys = block_keys(fp, list(range(64 * 16)), 16)
    with Client(address) as kv:
        for _ in range(50):
            kv.lookup(fp, keys)  # warm the channel
        while time.time() < start_at:
            time.sleep(0.001)
        latencies = []
        for _ in range(calls):
            t = time.perf_counter()
            kv.lookup(fp, keys)
            latencies.append(time.perf_counter() - t)
    queue.put(latencies)


def lookup_p50_ms(address: str, calls: int, token: str | None = None) -> float:
    """p50 of a lookup of 64 present keys from one client calling in turn: the way the peers'
    existence checks are timed (``benchmarks.peers``)."""
    fp = MODEL.fingerprint()
    keys = block_keys(fp, list(range(64 * 16)), 16, cache_salt="all-present")
    with connect(address, token=token) as kv:
        kv.register(MODEL)
        if kv.lookup(fp, keys) != 64:
            kv.put(fp, keys, [b"\0" * BLOCK] * 64)
        for _ in range(50):
            kv.lookup(fp, keys)  # warm the connection
        latencies = []
        for _ in range(calls):
            start = time.perf_counter()
            if kv.lookup(fp, keys) != 64:
                raise RuntimeError("lookup found fewer of the 64 keys than stored")
            latencies.append(time.perf_counter() - start)
    return sorted(latencies)[len(latencies) // 2] * 1e3


def bench_lookup(server: ServerProcess, calls: int, clients: int = 4) -> list[Result]:
    fp = MODEL.fingerprint()
    keys = block_keys(fp, list(range(64 * 16)), 16)
    with connect(server.unix) as kv:
        kv.register(MODEL)
        kv.write(fp, keys[:48], [b"\0" * BLOCK] * 48)  # 48 of 64 hit: a realistic partial prefix
    ctx = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue[list[float]] = ctx.Queue()
    start_at = time.time() + 3
    procs = [
        ctx.Process(target=_lookup_worker, args=(server.unix, calls, start_at, queue)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    latencies = sorted(x for _ in procs for x in queue.get(timeout=300))
    for p in procs:
        p.join(30)
    p50 = latencies[len(latencies) // 2] * 1e3
    p99 = latencies[int(len(latencies) * 0.99)] * 1e3
    note = f"{clients} client processes x {calls} calls, Unix socket"
    one = "one client, 64 of 64 present"
    return [
        Result("lookup 64 keys p50, one client (Unix)", lookup_p50_ms(server.unix, calls), "ms", note=one),
        Result(
            "lookup 64 keys p50, one client (TCP)",
            lookup_p50_ms(server.tcp, calls, TOKEN),
            "ms",
            note=one + ", token auth",
        ),
        Result("lookup 64 keys p50", p50, "ms", note=note),
        Result("lookup 64 keys p99", p99, "ms", "target", 2.0, "<= 1.0", note + "; ratio = p99 / 2 ms"),
    ]


def bench_lookup_under_writes(count: int, writes: int = 8) -> list[Result]:
    """One client's 64-key lookups (1 ms apart) while another writes 128 MiB chains in place into
    a server whose arena holds three of them, so that from the fourth write on every write
    demotes its room's worth into nvme, faster than the disk takes it: the lookups' p99 against
    the same lookups before the writes began, on the same server."""
    import threading

    server = bench_server(arena_bytes=3 * count * BLOCK)
    try:
        fp = MODEL.fingerprint()
        hot, hot_blocks = make_blocks(64, 1, MODEL, BLOCK)
        _, payloads = make_blocks(count, 100, MODEL, BLOCK)  # one set of bytes under every chain's keys
        chains = [(make_keys(count, 101 + i), payloads) for i in range(3 + writes)]
        latencies: dict[str, list[float]] = {"quiet": [], "writes": []}
        phase = "quiet"
        done = threading.Event()
        with connect(server.unix) as kv, connect(server.unix) as other:
            kv.register(MODEL)
            kv.write(fp, hot, hot_blocks)
            for keys, blocks in chains[:3]:  # the arena is full from here on
                kv.write(fp, keys, blocks)

            def look() -> None:
                while not done.is_set():
                    start = time.perf_counter()
                    other.lookup(fp, hot)
                    latencies[phase].append(time.perf_counter() - start)
                    time.sleep(0.001)

            looker = threading.Thread(target=look)
            looker.start()
            try:
                time.sleep(1.0)
                phase = "writes"
                for keys, blocks in chains[3:]:
                    kv.write(fp, keys, blocks)
            finally:
                done.set()
                looker.join(30)
            counters = kv.stats()["counters"]
    finally:
        server.stop()
    quiet, busy = sorted(latencies["quiet"]), sorted(latencies["writes"])
    p99_quiet, p99_busy = quiet[int(len(quiet) * 0.99)] * 1e3, busy[int(len(busy) * 0.99)] * 1e3
    return [
        Result(
            "lookup 64 keys p99, a writer overflowing the arena",
            p99_busy,
            "ms",
            "the same lookups before the writes",
            p99_quiet,
            note=f"{len(busy)} lookups during {writes} writes of {count} x 2 MiB into a full arena; "
            f"demoted {counters.get('demotions', 0)}, dropped for a busy disk "
            f"{counters.get('nvme_busy_skipped_blocks', 0)}, pace timeouts {counters.get('pace_timeouts', 0)}",
        )
    ]


def fairness_rows(runs: int) -> list[Result]:
    """The fairness rows (``benchmarks.fairness``), on a server of their own."""
    server = bench_server(arena_bytes=64 * MiB, settings=fairness_settings())
    try:
        return bench_fairness(server, runs)
    finally:
        server.stop()
