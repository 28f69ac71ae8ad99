"""``kvstore bench service``: the service's data planes against references from the same run.

- remote get and put of 2 MiB blocks over loopback TCP (the data port, token auth), against a
  raw TCP socket moving the same bytes between two processes: the plain ``client.get`` (views
  from the receive pool; target >= 0.7x) and ``get_into`` the caller's buffers (the data-port
  path, target >= 0.85x), put (target >= 0.6x); the same over the gRPC streams, for orientation;
- remote put and get of 2 MiB blocks kept in nvme, encrypted at rest (``nvme.encryption_keys_dir``)
  against the same server without it, rounds alternating (``benchmarks.sealed_costs``);
- same-host restore into a client buffer (Resolve + copy out of the mapped arena + Release),
  against memcpy of the same bytes between warm buffers (target >= 0.8x);
- Lookup of 64 keys (all present), one client calling in turn as Redis's ``EXISTS`` is measured,
  over the Unix socket and over TCP (Redis's socket kind), p50 against Redis ``EXISTS`` of 64 keys
  from the peers below (target <= 1.0x); and from 4 concurrent client processes over the Unix
  socket (48 of 64 present), p50 and p99 (target p99 <= 2 ms);
- same-host writes into a full arena, a pause between them, against the same writes into the
  empty arena (target >= 0.7x), with the cleaner and without it (``store.clean_ahead=0``);
- one tenant's 64-key lookup p99 over TCP, the Unix socket and gRPC while another holds 250
  data-port connections pipelining 500-key lookups (``benchmarks.fairness``; target <= 5 ms;
  ``--fairness`` runs this row alone);
- the pause a full garbage collection would impose with 100k blocks indexed (400k without
  ``--quick``), against what is left of it after the freeze ``kvstore serve`` makes
  (``benchmarks.gc_pause``; the server runs no full collection after start);
- the same put/get workload on Redis, Mooncake Store and LMCache's server (``benchmarks.peers``),
  where they are installed (``--install-peers`` installs them) and start here (target: faster
  than each), ours measured again just before and just after each peer
  (``benchmarks.service_peers``).

The server runs as its own process (``kvstore serve``), as it would be deployed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import ssl
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.common import Result, interleaved, print_results, write_json
from benchmarks.fairness import bench_fairness, fairness_settings
from benchmarks.gc_pause import bench_gc_pause
from benchmarks.sealed_costs import nvme_rows
from benchmarks.server_process import ServerProcess
from benchmarks.service_peers import bench_peers, say_what_peers_need
from kvstore.client import Client, ResolvedBlocks, connect
from kvstore.client.inplace import Slots, gather_from_slots, scatter_into_slots
from kvstore.keys import BlockKey, ModelIdentity, block_keys
from kvstore.tls import ClientTls
from tiers.dram import Arena

MiB = 1 << 20
BLOCK = 2 * MiB
TOKEN = "bench-token"
# 2 MiB per block: 16 tokens x 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes (bf16).
MODEL = ModelIdentity(
    "bench/8b-like", "00" * 32, num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16
)
# The same model cut into 2-token blocks: 256 KiB each, the small-block same-host rows.
SMALL_BLOCK = 256 * 1024
SMALL_MODEL = ModelIdentity(
    "bench/8b-like", "00" * 32, num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=2
)


def bench_server(arena_bytes: int, settings: Mapping[str, str] | None = None) -> ServerProcess:
    """The benchmarks' server: a TCP listener with the bench token, messages up to 64 MiB."""
    return ServerProcess(
        {
            "dram.capacity_bytes": str(arena_bytes),
            "nvme.capacity_bytes": "4GiB",
            "server.tokens": f"{TOKEN}=bench",
            "server.max_message_bytes": "64MiB",
            **(settings or {}),
        },
        tcp=True,
    )


# ----------------------------------------------------------------------------- raw TCP reference


def _tcp_sender(
    port: int, nbytes: int, count: int, rounds: int, tls: tuple[str, str] | None = None, hot: bool = False
) -> None:
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for _ in range(1 if hot else count)]
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s = raw
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            s = context.wrap_socket(raw, server_side=True)
        try:
            for _ in range(rounds):
                if not s.recv(1):  # the receiver asks for a round, or is done with fewer
                    return
                for i in range(count):
                    s.sendall(payloads[i % len(payloads)])
        except OSError:  # the receiver closed mid-round: it has what it measured
            return


def raw_tcp_round_timer(
    count: int, rounds: int, tls: tuple[str, str, str] | None = None, hot: bool = False
) -> tuple[Callable[[], float], Callable[[], None]]:
    """A timer of one round of ``count`` 2 MiB messages over a loopback socket, sender in another
    process (``tls``: (ca, cert, key) for a TLS socket, Python's ssl on both ends); call the
    second function when done. The same bytes a get of ``count`` blocks moves: out of ``count``
    buffers, into ``count`` buffers (``hot``: one buffer each end, the same 2 MiB over and over,
    which stays in the caches and reads here ~13% faster than the memory a store moves)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    sender_tls = (tls[1], tls[2]) if tls is not None else None
    proc = multiprocessing.get_context("spawn").Process(
        target=_tcp_sender, args=(port, BLOCK, count, rounds, sender_tls, hot)
    )
    proc.start()
    conn, _ = listener.accept()
    if tls is not None:  # the sender is the TLS server here: the receiver checks its certificate
        conn = ssl.create_default_context(cafile=tls[0]).wrap_socket(conn, server_hostname="127.0.0.1")
    bufs = [memoryview(bytearray(BLOCK)) for _ in range(1 if hot else count)]
    for b in bufs:
        b[:] = bytes(BLOCK)  # warm, as the caller's buffers of get_into are

    def one_round() -> float:
        start = time.perf_counter()
        conn.sendall(b"g")
        for i in range(count):
            buf = bufs[i % len(bufs)]
            got = 0
            while got < BLOCK:
                n = conn.recv_into(buf[got:], BLOCK - got)
                if not n:
                    raise RuntimeError("raw TCP sender went away")
                got += n
        return time.perf_counter() - start

    def close() -> None:
        conn.close()
        listener.close()
        proc.join(30)

    return one_round, close


# ----------------------------------------------------------------------------- our figures


def _blocks(
    count: int, seed: int, model: ModelIdentity = MODEL, size: int = BLOCK
) -> tuple[list[BlockKey], list[bytes]]:
    rng = np.random.default_rng(seed)
    per = model.tokens_per_block
    keys = block_keys(model.fingerprint(), rng.integers(0, 32000, count * per).tolist(), per)
    return keys, [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in keys]


def _keys(count: int, seed: int, model: ModelIdentity = MODEL) -> list[BlockKey]:
    """The keys of a chain of ``count`` blocks, without their bytes."""
    per = model.tokens_per_block
    tokens = np.random.default_rng(seed).integers(0, 32000, count * per).tolist()
    return block_keys(model.fingerprint(), tokens, per)


def _remote_rounds(
    kv: Client, count: int, outs: list[memoryview]
) -> tuple[Callable[[], float], Callable[[], float], Callable[[], float], list[bytes]]:
    """Timers of one remote round of ``count`` blocks through ``kv``: put, ``get_into`` ``outs``,
    plain ``get``; and the blocks."""
    fp = MODEL.fingerprint()
    kv.register(MODEL)
    put_keys, put_blocks = _blocks(count, 7)

    def put_round() -> float:
        kv.invalidate(fp)
        start = time.perf_counter()
        if kv.put(fp, put_keys, put_blocks) != count:
            raise RuntimeError("remote put stored fewer blocks than sent")
        return time.perf_counter() - start

    def get_round() -> float:
        start = time.perf_counter()
        if kv.get_into(fp, put_keys, outs) != count:
            raise RuntimeError("remote get returned fewer blocks than stored")
        return time.perf_counter() - start

    def plain_get_round() -> float:
        """What a script author writes; the blocks are dropped before the next round, as a
        caller does once it has copied them where they go."""
        start = time.perf_counter()
        blocks = kv.get(fp, put_keys)
        seconds = time.perf_counter() - start
        if len(blocks) != count or blocks[-1] != put_blocks[-1]:
            raise RuntimeError("remote get returned fewer or wrong blocks")
        return seconds

    return put_round, get_round, plain_get_round, put_blocks


def bench_tls(server: ServerProcess, count: int, rounds: int) -> list[Result]:
    """Remote get and put over TLS (a second server with certificates) against the same over
    plaintext, interleaved in the same run."""
    from benchmarks import tls_ceiling
    from benchmarks.tls_certs import make_certs

    certs = make_certs(server.data_dir / "certs")
    tls = {"server.tls_cert_file": str(certs.server_cert), "server.tls_key_file": str(certs.server_key)}
    secure_server = ServerProcess({**server.settings, **tls}, tcp=True)
    plain_outs = [memoryview(bytearray(BLOCK)) for _ in range(count)]
    tls_outs = [memoryview(bytearray(BLOCK)) for _ in range(count)]
    try:
        with (
            connect(server.tcp, token=TOKEN) as plain,
            connect(secure_server.tcp, token=TOKEN, tls=ClientTls(ca_file=str(certs.ca))) as secure,
        ):
            plain_put, plain_get, _, _ = _remote_rounds(plain, count, plain_outs)
            tls_put, tls_get, _, blocks = _remote_rounds(secure, count, tls_outs)
            tls_put(), plain_put()  # warm up both
            put_s, ref_put = interleaved(tls_put, plain_put, rounds)
            get_s, ref_get = interleaved(tls_get, plain_get, rounds)
            if bytes(tls_outs[-1]) != blocks[-1]:
                raise RuntimeError("remote get over TLS returned wrong bytes")
            raw_round, raw_close = raw_tcp_round_timer(
                count, 2 * rounds + 1, (str(certs.ca), str(certs.server_cert), str(certs.server_key))
            )
            try:
                raw_round()
                get_again, raw_tls = interleaved(tls_get, raw_round, rounds)
            finally:
                raw_close()
        ceiling = tls_ceiling.measure(certs.server_cert, certs.server_key)
    finally:
        secure_server.stop()
    total = count * BLOCK
    note = "raw data port over TLS 1.3 (Python ssl), token auth, loopback; same blocks over plaintext"
    native = (
        Result(
            "TLS 1.3 in C (OpenSSL), the machine's ceiling",
            ceiling[0],
            "GB/s",
            "plain TCP in C",
            ceiling[1],
            note="benchmarks/native/tls_ceiling.c: no Python on the path; a TLS/plaintext target"
            " above this ratio cannot be met on this machine",
        )
        if isinstance(ceiling, tuple)
        else Result("TLS 1.3 in C (OpenSSL), the machine's ceiling", None, "GB/s", note=ceiling)
    )
    return [
        Result(
            "remote get 2 MiB over TLS",
            total / get_s / 1e9,
            "GB/s",
            "plaintext",
            total / ref_get / 1e9,
            ">= 0.7",
            note,
        ),
        Result(
            "remote put 2 MiB over TLS",
            total / put_s / 1e9,
            "GB/s",
            "plaintext",
            total / ref_put / 1e9,
            ">= 0.7",
            note,
        ),
        Result(
            "remote get 2 MiB over TLS (vs raw TLS)",
            total / get_again / 1e9,
            "GB/s",
            "raw TLS socket",
            total / raw_tls / 1e9,
            note="the ceiling of Python's ssl here: one 16 KiB record per recv on both ends",
        ),
        native,
    ]


def bench_remote(server: ServerProcess, count: int, rounds: int, data_plane: str) -> list[Result]:
    """Remote put and get through the client's data plane: "auto" (the raw data port) or "grpc"."""
    outs = [memoryview(bytearray(BLOCK)) for _ in range(count)]
    with connect(server.tcp, token=TOKEN, data_plane=data_plane) as kv:
        put_round, get_round, plain_get_round, put_blocks = _remote_rounds(kv, count, outs)
        tcp_round, tcp_close = raw_tcp_round_timer(count, 3 * rounds + 2)
        hot_round, hot_close = raw_tcp_round_timer(count, rounds + 1, hot=True)
        try:
            tcp_round(), hot_round(), put_round(), plain_get_round()  # warm up (and fill the receive pool)
            put_s, ref_put = interleaved(put_round, tcp_round, rounds)
            get_s, ref_get = interleaved(get_round, tcp_round, rounds)
            _, ref_hot = interleaved(get_round, hot_round, rounds)
            plain_s, ref_plain = interleaved(plain_get_round, tcp_round, rounds)
        finally:
            tcp_close()
            hot_close()
        if bytes(outs[-1]) != put_blocks[-1]:
            raise RuntimeError("remote get returned wrong bytes")
    total = count * BLOCK
    if data_plane == "grpc":
        label, note = " (gRPC streams)", "Get/Put gRPC streams with hand-written frames"
        targets: dict[str, str | None] = {"get_into": None, "get": None, "put": None}
    else:
        label, note = "", "raw data port, token auth"
        targets = {"get_into": ">= 0.85", "get": ">= 0.7", "put": ">= 0.6"}
    note += "; loopback TCP, server in its own process"
    return [
        Result(
            f"remote get 2 MiB{label} (get_into)",
            total / get_s / 1e9,
            "GB/s",
            "raw TCP",
            total / ref_get / 1e9,
            targets["get_into"],
            note + "; into the caller's warm buffers; raw TCP moves the same 64 blocks, out of "
            "and into distinct buffers",
        ),
        Result(
            f"remote get 2 MiB{label} (get_into, vs one hot buffer)",
            total / get_s / 1e9,
            "GB/s",
            "raw TCP through one buffer",
            total / ref_hot / 1e9,
            note="the reference before sitting 15: the same 2 MiB sent and received over and over, "
            "warm in the caches",
        ),
        Result(
            f"remote get 2 MiB{label} (plain client.get)",
            total / plain_s / 1e9,
            "GB/s",
            "raw TCP",
            total / ref_plain / 1e9,
            targets["get"],
            note + "; views from the thread's receive pool, dropped after each round",
        ),
        Result(
            f"remote put 2 MiB{label}",
            total / put_s / 1e9,
            "GB/s",
            "raw TCP",
            total / ref_put / 1e9,
            targets["put"],
            note,
        ),
    ]


def bench_same_host(server: ServerProcess, count: int, rounds: int, small: bool = False) -> list[Result]:
    """The references copy the same bytes block by block out of, and into, slots of the very
    arena the service hands out (mapped the same way, in this process), through the client's
    own copy loop: what a row's ratio leaves out is the data movement, what it shows is what
    the service adds. Memory of the
    server's arena copies slower here than a region this process created (see BENCHMARKS.md),
    so that second reference is shown beside each row, for what it says about the machine.
    ``small``: 256 KiB blocks (the same model in 2-token blocks), eight times as many, so the
    service's per-block work weighs eight times as much against the copy."""
    model, size = (SMALL_MODEL, SMALL_BLOCK) if small else (MODEL, BLOCK)
    count = count * (BLOCK // size)
    fp = model.fingerprint()
    keys, blocks = _blocks(count, 11, model, size)
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
    # speed here depends on where in the arena it lands (up to 1.18x between 128 MiB ranges of
    # one arena, BENCHMARKS.md "Service"), so slots elsewhere would show the machine, not the
    # service. Each store round pins what it stored (a resolve, outside its timing), and the
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
        hot, hot_blocks = _blocks(64, 1, MODEL, BLOCK)
        _, payloads = _blocks(count, 100, MODEL, BLOCK)  # one set of bytes under every chain's keys
        chains = [(_keys(count, 101 + i), payloads) for i in range(3 + writes)]
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


def ours_now(count: int, rounds: int) -> dict[str, float]:
    """Our remote put and plain ``get`` in GB/s (median of ``rounds`` each, interleaved) on a
    server of their own: the pass that brackets a peer's."""
    server = bench_server(arena_bytes=(3 * count + 64) * BLOCK)
    try:
        with connect(server.tcp, token=TOKEN) as kv:
            put_round, _, plain_get_round, _ = _remote_rounds(kv, count, [])
            put_round(), plain_get_round()  # warm up (and fill the receive pool)
            put_s, get_s = interleaved(put_round, plain_get_round, rounds)
            kv.invalidate(MODEL.fingerprint())
    finally:
        server.stop()
    gb = count * BLOCK / 1e9
    return {"get": gb / get_s, "put": gb / put_s}


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
        _, payloads = _blocks(count, 100, MODEL, BLOCK)
        chains = [_keys(count, 300 + i) for i in range(3 + writes)]
        with connect(server.unix) as kv:
            settle_mapping(kv)
            kv.register(MODEL)

            def write(keys: list[BlockKey]) -> float:
                start = time.perf_counter()
                if kv.write(fp, keys, payloads) != count:
                    raise RuntimeError("a write into the arena stored fewer blocks than sent")
                return time.perf_counter() - start

            # The empty-arena writes come after the same pause as the full ones: a write after
            # 0.6 s idle ran 20-28% slower than one straight after another here (scratch fa.py),
            # which is the machine waking, not the arena being full.
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


def fairness_rows(runs: int) -> list[Result]:
    """The fairness rows (``benchmarks.fairness``), on a server of their own."""
    server = bench_server(arena_bytes=64 * MiB, settings=fairness_settings())
    try:
        return bench_fairness(server, runs)
    finally:
        server.stop()


def run_service_bench(
    quick: bool,
    json_path: str | None,
    with_peers: bool = True,
    fairness_only: bool = False,
    install_peers: bool = False,
) -> int:
    """``install_peers``: install the peers that are missing (``benchmarks.service_peers``);
    without it nothing is installed and a missing peer is a row saying what it lacks."""
    count = 64 if quick else 256
    rounds = 5 if quick else 9
    console = Console(stderr=True)
    if fairness_only:
        console.print("[dim]lookup latency beside a noisy tenant …[/]")
        rows = fairness_rows(runs=3)
        print_results("kvstore bench service --fairness", rows)
        if json_path:
            write_json(json_path, rows, {"command": "kvstore bench service --fairness"})
        return 0
    server = bench_server(arena_bytes=(3 * count + 64) * BLOCK)
    results: list[Result] = []
    try:
        console.print("[dim]remote get/put against raw TCP …[/]")
        results += bench_remote(server, count, rounds, "auto")
        results += bench_remote(server, count, rounds, "grpc")
        console.print("[dim]remote get/put over TLS against plaintext …[/]")
        results += bench_tls(server, count, rounds)
        console.print("[dim]remote get/put from nvme encrypted at rest against plain …[/]")
        results += nvme_rows(min(count, 64), rounds)
        console.print("[dim]same-host restore against memcpy …[/]")
        # A server of their own: the blocks the rows above left would fill the arena, and each
        # write would then pay for demoting them to nvme, which is not what these rows measure.
        same_host = bench_server(arena_bytes=(3 * count + 64) * BLOCK)
        try:
            # Three times the rounds: a round is ~15 ms of copying here, and five of them, on a
            # machine whose memcpy moved 17-24 GB/s between runs, left the median to chance.
            results += bench_same_host(same_host, count, 3 * rounds)
            results += bench_same_host(same_host, count, 3 * rounds, small=True)
        finally:
            same_host.stop()
        console.print("[dim]lookup latency, 4 clients …[/]")
        results += bench_lookup(server, calls=500 if quick else 2000)
        console.print("[dim]lookup latency while a writer overflows the arena …[/]")
        results += bench_lookup_under_writes(count)
        console.print("[dim]writes into a full arena, with and without the cleaner …[/]")
        results += bench_full_arena(count)
        console.print("[dim]lookup latency beside a noisy tenant …[/]")
        results += fairness_rows(runs=1 if quick else 3)
        console.print("[dim]a full garbage collection's pause …[/]")
        results += bench_gc_pause(100_000 if quick else 400_000)
    finally:
        server.stop()
    if with_peers:
        say_what_peers_need(console, install_peers)
        by_metric = {r.metric: r.value or 0.0 for r in results}
        lookups = {
            "Unix socket": by_metric["lookup 64 keys p50, one client (Unix)"],
            "TCP": by_metric["lookup 64 keys p50, one client (TCP)"],
        }
        results += bench_peers(
            lambda: ours_now(count, rounds), count, rounds, lookups, console, install_peers
        )
    title = f"kvstore bench service{' --quick' if quick else ''}"
    print_results(title, results)
    if json_path:
        write_json(json_path, results, {"command": title})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_service_bench(quick="--quick" in sys.argv, json_path=None, with_peers=False))
