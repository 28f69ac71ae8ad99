"""``kvstore bench service --address ADDR``: a running deployment, measured from where the
command runs. Nothing is started and nothing installed.

Rows: a lookup of 64 present keys (p50 and p99, one client calling in turn); remote put, plain
``get`` and ``get_into`` of ``blocks`` 2 MiB blocks (the median of ``rounds``) through what the
address offers this client (the data port, its Unix twin, or gRPC); and, on a Unix socket whose
arena this process can map, the same-host rows: a write in place and a ``read_into``, beside
memcpy of the same bytes in this process. Where the arena cannot be mapped (another user, a
container without the server's /dev/shm) the same-host rows say why.

What it leaves: nothing. Its blocks go under models of its own (``kvstore-bench/deployment``,
fingerprints no engine uses) in the caller's tenant and are invalidated after each round and at
the end. Meanwhile they take room (``blocks`` x 2 MiB: a full tier evicts others' blocks for
them as it would for any write), and they show in the server's counters, and its invalidations
in the audit log.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
from rich.console import Console

from benchmarks.common import Result, gbps, print_results, write_json
from kvstore.address import Address
from kvstore.client import Client, connect
from kvstore.errors import FailedPrecondition, Unavailable
from kvstore.keys import BlockKey, ModelIdentity, block_keys
from kvstore.tls import ClientTls

# 2 MiB blocks: 16 tokens x 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes (bf16).
MODEL = ModelIdentity("kvstore-bench/deployment", "", 32, 8, 128, 16)
# 512-byte blocks for the lookup rows: a lookup's cost does not depend on the block size.
LOOKUP_MODEL = ModelIdentity("kvstore-bench/deployment-lookups", "", 1, 1, 8, 16)
LOOKUP_KEYS = 64


def run_deployment_bench(
    address: Address,
    token: str | None,
    tls: ClientTls | None,
    blocks: int,
    rounds: int,
    json_path: str | None,
    lookups: int = 0,
) -> int:
    """Measure the server at ``address``; 0 when every row was measured, 1 when one could not be
    (its note says why)."""
    console = Console(stderr=True)
    lookups = lookups or 100 * rounds
    with connect(address, token=token, tls=tls) as kv:
        info = kv.server_info()
        unix = address.same_host
        if unix:
            path = "data socket" if info["data_socket"] else "gRPC"
        else:
            path = "data port" if info["data_port"] else "gRPC"
        console.print(f"[dim]{address}: lookups, then {blocks} x 2 MiB over the {path} …[/]")
        try:
            results = bench_lookups(kv, lookups, path)
            results += bench_remote(kv, blocks, rounds, path)
            if unix:
                console.print("[dim]same host: the arena mapped here …[/]")
                results += bench_same_host(kv, blocks, rounds)
        finally:
            for model in (MODEL, LOOKUP_MODEL):
                kv.invalidate(model.fingerprint())
    title = f"kvstore bench service --address {address}"
    print_results(title, results)
    if json_path:
        write_json(json_path, results, {"command": title, "address": str(address), "path": path})
    return 0 if all(r.value is not None for r in results) else 1


def bench_lookups(kv: Client, calls: int, path: str) -> list[Result]:
    fp = kv.register(LOOKUP_MODEL)
    keys = _keys(LOOKUP_MODEL, LOOKUP_KEYS, seed=1)
    kv.put(fp, keys, [bytes(LOOKUP_MODEL.block_bytes)] * len(keys))
    for _ in range(20):
        kv.lookup(fp, keys)  # warm the connection
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        found = kv.lookup(fp, keys)
        latencies.append(time.perf_counter() - start)
        if found != len(keys):
            raise RuntimeError(f"a lookup found {found} of the {len(keys)} keys just stored")
    latencies.sort()
    note = f"one client calling in turn, {calls} calls, all {LOOKUP_KEYS} present; over the {path}"
    return [
        Result(f"lookup {LOOKUP_KEYS} keys p50", latencies[len(latencies) // 2] * 1e3, "ms", note=note),
        Result(
            f"lookup {LOOKUP_KEYS} keys p99", latencies[int(len(latencies) * 0.99)] * 1e3, "ms", note=note
        ),
    ]


def bench_remote(kv: Client, count: int, rounds: int, path: str) -> list[Result]:
    """Remote put, plain get and get_into of ``count`` 2 MiB blocks: medians of ``rounds``."""
    fp = kv.register(MODEL)
    keys, payloads = _chain(count, seed=2)
    outs = [memoryview(bytearray(MODEL.block_bytes)) for _ in range(count)]

    def put() -> float:
        kv.invalidate(fp)
        start = time.perf_counter()
        stored = kv.put(fp, keys, payloads)
        seconds = time.perf_counter() - start
        if stored != count:
            raise RuntimeError(f"the server stored {stored} of {count} blocks (is it full of pins?)")
        return seconds

    def get() -> float:
        start = time.perf_counter()
        got = kv.get(fp, keys)
        seconds = time.perf_counter() - start
        if len(got) != count or got[-1] != payloads[-1]:
            raise RuntimeError("a get returned fewer or other blocks than were put")
        return seconds

    def get_into() -> float:
        start = time.perf_counter()
        if kv.get_into(fp, keys, outs) != count:
            raise RuntimeError("get_into returned fewer blocks than were put")
        return time.perf_counter() - start

    total = count * MODEL.block_bytes
    put_s = _median(put, rounds)  # the last round's blocks stay for the gets
    note = f"{count} x 2 MiB, median of {rounds}; over the {path}"
    rows = [Result("remote put 2 MiB", gbps(total, put_s), "GB/s", note=note)]
    rows.append(
        Result("remote get 2 MiB (plain client.get)", gbps(total, _median(get, rounds)), "GB/s", note=note)
    )
    rows.append(
        Result("remote get 2 MiB (get_into)", gbps(total, _median(get_into, rounds)), "GB/s", note=note)
    )
    if bytes(outs[-1]) != payloads[-1]:
        raise RuntimeError("get_into wrote other bytes than were put")
    kv.invalidate(fp)
    return rows


def bench_same_host(kv: Client, count: int, rounds: int) -> list[Result]:
    """A write in place and a ``read_into`` through the mapped arena, beside memcpy here."""
    try:
        if not kv.attach().wait_populated(timeout_s=120):
            raise Unavailable("the arena's mapping was still being populated after 120 s")
    except (Unavailable, FailedPrecondition) as exc:
        why = f"not measured: the arena cannot be mapped by this process ({exc})"
        return [Result(f"same-host {what} 2 MiB", None, "GB/s", note=why) for what in ("write", "read_into")]
    fp = kv.register(MODEL)
    keys, payloads = _chain(count, seed=3)
    engine = np.zeros(count * MODEL.block_bytes, dtype=np.uint8)  # an engine's buffer, warm
    size = MODEL.block_bytes
    outs = [memoryview(engine[i * size : (i + 1) * size].data) for i in range(count)]
    source = np.frombuffer(b"".join(payloads), dtype=np.uint8)

    def write() -> float:
        kv.invalidate(fp)
        start = time.perf_counter()
        stored = kv.write(fp, keys, payloads)
        seconds = time.perf_counter() - start
        if stored != count:
            raise RuntimeError(f"the arena took {stored} of {count} blocks")
        return seconds

    def read() -> float:
        start = time.perf_counter()
        if kv.read_into(fp, keys, outs) != count:
            raise RuntimeError("read_into restored fewer blocks than were written")
        return time.perf_counter() - start

    def memcpy() -> float:
        start = time.perf_counter()
        np.copyto(engine, source)
        return time.perf_counter() - start

    total = count * size
    write_s, read_s, copy_s = _median(write, rounds), _median(read, rounds), _median(memcpy, rounds)
    if not np.array_equal(engine, source):
        raise RuntimeError("read_into restored other bytes than were written")
    note = f"{count} x 2 MiB through the mapped arena, median of {rounds}; memcpy: the same bytes here"
    kv.invalidate(fp)
    return [
        Result(
            "same-host write 2 MiB", gbps(total, write_s), "GB/s", "memcpy", gbps(total, copy_s), note=note
        ),
        Result(
            "same-host read_into 2 MiB", gbps(total, read_s), "GB/s", "memcpy", gbps(total, copy_s), note=note
        ),
    ]


def _median(timer: Callable[[], float], rounds: int) -> float:
    timer()  # warm up: connections, the receive pool, page faults
    return statistics.median(timer() for _ in range(rounds))


def _keys(model: ModelIdentity, count: int, seed: int) -> list[BlockKey]:
    per = model.tokens_per_block
    tokens = np.random.default_rng(seed).integers(0, 32000, count * per).tolist()
    return block_keys(model.fingerprint(), tokens, per)


def _chain(count: int, seed: int) -> tuple[list[BlockKey], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = _keys(MODEL, count, seed)
    return keys, [rng.integers(0, 256, MODEL.block_bytes, dtype=np.uint8).tobytes() for _ in keys]
