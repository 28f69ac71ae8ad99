"""``kvstore bench service``'s remote rows: get and put of 2 MiB blocks over loopback TCP (the data
port, and gRPC for orientation) and over TLS, against a raw TCP socket moving the same bytes
between two processes; and ``ours_now``, the pass that brackets each peer's."""

from __future__ import annotations

import multiprocessing
import socket
import ssl
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import Result, interleaved
from benchmarks.server_process import ServerProcess
from benchmarks.service_setup import BLOCK, MODEL, TOKEN, bench_server, make_blocks
from kvstore.client import Client, connect
from kvstore.tls import ClientTls

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


def _remote_rounds(
    kv: Client, count: int, outs: list[memoryview]
) -> tuple[Callable[[], float], Callable[[], float], Callable[[], float], list[bytes]]:
    """Timers of one remote round of ``count`` blocks through ``kv``: put, ``get_into`` ``outs``,
    plain ``get``; and the blocks."""
    fp = MODEL.fingerprint()
    kv.register(MODEL)
    put_keys, put_blocks = make_blocks(count, 7)

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
            note="a kinder reference: the same 2 MiB sent and received over and over, warm in the caches",
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
