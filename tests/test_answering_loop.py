"""The data port's answering loop (kvstore.server.answering): one thread answers the small
requests of every connection between its other requests. Pipelined lookups are answered in
order by that thread; one whose bytes trickle is still answered (a worker reads the rest);
a client that never reads its answers holds up no one else; an error answered there reaches its
client and closes that connection only; a connection idle past IDLE_S is closed; a drain hands
every parked connection back at once; a lookup that waits on the remote tier is never the
loop's."""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable

import pytest

import kvstore.server.answering as answering
from kvstore.client import connect
from kvstore.keys import BlockKey
from kvstore.server.config import load_settings
from kvstore.server.serve import start_server
from kvstore.status import Status
from kvstore.stream import recv_exact
from kvstore.wire import (
    END,
    MAGIC,
    OP_GET,
    OP_LEASE_HELD,
    OP_LOOKUP,
    OP_LOOKUP_SLOTS,
    read_status,
)
from tests.service_fixtures import MODEL, Served, blocks_for, chain, settings_for
from tests.service_fixtures import served as served  # the fixture


def lookup_request(keys: list[BlockKey], op: int = OP_LOOKUP) -> bytes:
    return struct.pack("<B32sI", op, MODEL.fingerprint(), len(keys)) + b"".join(keys) + struct.pack("<d", 0.0)


def read_lookup(sock: socket.socket) -> int:
    """The hit count of one lookup answer (its tiers and lease read past)."""
    code, message = read_status(sock)
    assert code == Status.OK, message
    (hit,) = struct.unpack("<I", recv_exact(sock, 4))
    recv_exact(sock, hit + 8)
    return int(hit)


def unix_hello(served: Served) -> socket.socket:
    port = served.server.data_socket
    assert port is not None and port.unix_path
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(port.unix_path)
    sock.sendall(MAGIC + struct.pack("<HH", 0, 0))
    assert read_status(sock)[0] == Status.OK
    return sock


def stored(served: Served, n: int, salt: str) -> list[BlockKey]:
    keys = chain(n, salt=salt)
    with connect(served.unix) as kv:
        kv.register(MODEL)
        kv.put(MODEL.fingerprint(), keys, blocks_for(keys))
    return keys


def recording_threads(served: Served, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread that served each data-port lookup from now on (only lookups: a
    request served before, the put that stored the keys, may be recorded just after)."""
    port = served.server.data_socket
    assert port is not None
    names: list[str] = []
    inner: Callable[[str, float], None] | None = port.on_request

    def record(method: str, seconds: float) -> None:
        if method == "Lookup":
            names.append(threading.current_thread().name)
        if inner is not None:
            inner(method, seconds)

    monkeypatch.setattr(port, "on_request", record)
    return names


def settled(names: list[str], n: int) -> bool:
    """Whether ``n`` requests were recorded within a second (each is recorded just after its
    answer went out, so a client can read the answer first)."""
    deadline = time.monotonic() + 1
    while len(names) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return len(names) == n


def test_pipelined_lookups_are_answered_in_order_by_the_loop(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = stored(served, 3, "pipelined")
    sock = unix_hello(served)
    names = recording_threads(served, monkeypatch)
    # 40 lookups in one send: prefixes of 0..4 keys of a chain of 3 stored blocks
    sock.sendall(b"".join(lookup_request(keys[: i % 5] + chain(1, salt=f"miss-{i}")) for i in range(40)))
    assert [read_lookup(sock) for _ in range(40)] == [min(i % 5, 3) for i in range(40)]
    assert settled(names, 40) and names == ["kvstore-answering"] * 40
    sock.close()


def test_a_lookup_whose_bytes_trickle_is_answered(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = stored(served, 2, "trickle")
    sock = unix_hello(served)
    names = recording_threads(served, monkeypatch)
    request = lookup_request(keys)
    for cut in (1, 20, 40, len(request) - 3):  # mid-header, mid-keys, before the pin's ttl
        sock.sendall(request[:cut])
        time.sleep(0.05)
        sock.sendall(request[cut:])
        assert read_lookup(sock) == 2
    assert settled(names, 4) and "kvstore-answering" not in names  # each finished by its own thread
    sock.sendall(request)
    assert read_lookup(sock) == 2  # and the next whole one is the loop's again
    assert settled(names, 5) and names[-1] == "kvstore-answering"
    sock.close()


def test_the_rest_of_a_pipelined_lookup_is_awaited_by_the_loop_then_by_its_thread(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup begun behind another in the same send: the loop keeps its start and answers it
    when the rest comes (no thread woken for it); one whose rest takes past PARTIAL_S goes to
    a worker, which reads it under the request's deadline."""
    keys = stored(served, 2, "pipelined-rest")
    sock = unix_hello(served)
    names = recording_threads(served, monkeypatch)
    request = lookup_request(keys)
    for pause_s in (0.05, answering.PARTIAL_S + answering.IDLE_CHECK_S + 0.3):
        sock.sendall(request + request[:20])
        assert read_lookup(sock) == 2
        time.sleep(pause_s)
        sock.sendall(request[20:])
        assert read_lookup(sock) == 2
    assert settled(names, 4)
    assert names[:3] == ["kvstore-answering"] * 3  # the first rest awaited in the loop
    assert names[3] != "kvstore-answering"  # the late one: its own thread
    sock.close()


def test_after_a_request_of_another_kind_its_thread_waits_for_the_next_one_itself(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get (bytes over the socket) is a worker's; that worker then waits (FOLLOW_S) for
    the connection's next request itself (a write's next chunk comes soon, and a hand-over
    through the loop each time cost it), and gives the connection back to the loop after one
    the loop would have answered."""
    keys = stored(served, 1, "own-thread")
    sock = unix_hello(served)
    names = recording_threads(served, monkeypatch)
    sock.sendall(lookup_request(keys))
    assert read_lookup(sock) == 1
    sock.sendall(struct.pack("<B32sI", OP_GET, MODEL.fingerprint(), 1) + keys[0])
    assert read_status(sock)[0] == Status.OK
    size, _checksum = struct.unpack("<QQ", recv_exact(sock, 16))
    recv_exact(sock, size)
    assert struct.unpack("<Q", recv_exact(sock, 8))[0] == END and read_status(sock)[0] == Status.OK
    for _ in range(2):
        sock.sendall(lookup_request(keys))
        assert read_lookup(sock) == 1
    assert settled(names, 3)
    assert names[0] == "kvstore-answering" and names[1] != "kvstore-answering"
    assert names[2] == "kvstore-answering"
    sock.close()


def test_a_client_that_never_reads_its_answers_holds_up_no_one(served: Served) -> None:
    """Lease checks sent one by one, never read: the answers fill the socket until the loop
    cannot send one at once, which it then leaves to a worker (blocked in its
    send until the request's deadline or the client's leaving) instead of waiting itself. (Nine
    bytes a request: a backlog of them never ends the loop's buffer mid-request, so every one
    is the loop's to answer.)"""
    keys = stored(served, 2, "hog")
    hog = unix_hello(served)
    hog.setblocking(False)
    request = struct.pack("<BQ", OP_LEASE_HELD, 12345)
    sent = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until the server stops taking requests from it
        try:
            hog.send(request)
        except BlockingIOError:
            time.sleep(0.2)
            try:
                hog.send(request)
            except BlockingIOError:
                break
        sent += 1
    assert sent > 100, "the server's answers never filled the socket"
    with connect(served.unix) as other:
        started = time.monotonic()
        for _ in range(20):
            assert other.lookup(MODEL.fingerprint(), keys) == 2
        assert time.monotonic() - started < 5
    hog.close()
    with connect(served.unix) as other:  # the hog's worker let go with its connection
        assert other.lookup(MODEL.fingerprint(), keys) == 2


def test_a_client_pipelining_many_requests_takes_its_turn_with_the_others(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thousand lease checks in one send: the loop answers ANSWERS_PER_TURN of them, then the
    other connections' requests, then the next ones. The first check is held until the other
    client's lookup is waiting, so that the order is the loop's alone."""
    keys = stored(served, 1, "turns")
    port = served.server.data_socket
    assert port is not None
    hog, other = unix_hello(served), unix_hello(served)
    started, go = threading.Event(), threading.Event()
    lease_held = port.plane.lease_held

    def first_waits(*args: object) -> bool:
        if not started.is_set():
            started.set()
            go.wait(10)
        return lease_held(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(port.plane, "lease_held", first_waits)
    methods: list[str] = []

    def record(method: str, seconds: float) -> None:
        if method in ("Lookup", "LeaseHeld"):  # the put before may be recorded after
            methods.append(method)

    monkeypatch.setattr(port, "on_request", record)
    hog.sendall(struct.pack("<BQ", OP_LEASE_HELD, 12345) * 1000)
    assert started.wait(10)
    other.sendall(lookup_request(keys))
    time.sleep(0.2)  # in the other's socket before the loop goes on
    go.set()
    assert read_lookup(other) == 1
    for _ in range(1000):
        assert read_status(hog)[0] == Status.OK and recv_exact(hog, 1) == b"\0"
    assert settled(methods, 1001)
    assert methods.index("Lookup") == answering.ANSWERS_PER_TURN  # right after the hog's first turn
    hog.close()
    other.close()


def test_an_error_answered_by_the_loop_closes_that_connection_only(served: Served) -> None:
    keys = chain(2, salt="slots-over-tcp")
    with connect(served.tcp, token="tok-a") as a:
        a.register(MODEL)
        a.put(MODEL.fingerprint(), keys, blocks_for(keys))
        assert served.server.data_port is not None
        sock = socket.create_connection(("127.0.0.1", served.server.data_port.port), timeout=10)
        sock.sendall(MAGIC + struct.pack("<H", 5) + b"tok-a" + struct.pack("<H", 0))
        assert read_status(sock)[0] == Status.OK
        sock.sendall(lookup_request(keys, OP_LOOKUP_SLOTS))  # arena slots are for the Unix socket
        code, message = read_status(sock)
        assert code == Status.FAILED_PRECONDITION and "Unix socket" in message
        assert sock.recv(1) == b""  # closed after its error
        sock.close()
        assert a.lookup(MODEL.fingerprint(), keys) == 2


def test_a_parked_connection_idle_past_idle_s_is_closed(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(answering, "IDLE_S", 0.3)
    monkeypatch.setattr(answering, "IDLE_CHECK_S", 0.1)
    keys = stored(served, 1, "idle")
    sock = unix_hello(served)
    sock.sendall(lookup_request(keys))
    assert read_lookup(sock) == 1
    started = time.monotonic()
    sock.settimeout(5)
    assert sock.recv(1) == b""
    assert time.monotonic() - started < 3  # IDLE_S, then at most a loop timeout (1 s) and a check
    sock.close()


def test_a_drain_hands_every_parked_connection_back_at_once(served: Served) -> None:
    socks = [unix_hello(served) for _ in range(8)]
    time.sleep(0.2)  # all parked
    started = time.monotonic()
    served.server.stop()
    took = time.monotonic() - started
    for sock in socks:
        sock.settimeout(5)
        assert sock.recv(1) == b""
        sock.close()
    assert took < 2, f"the drain took {took:.1f} s with only parked connections"


def test_with_a_remote_tier_a_lookup_that_waits_on_it_holds_up_no_one_else() -> None:
    """Past the local prefix a lookup asks the fleet's remote tier, a network call: here a node
    that accepts and never answers, so that lookup takes the remote timeout. It is not the
    loop's to answer then (lookups go to the workers on such a server), and another
    client's lookups, all local hits, are answered meanwhile."""
    silent = socket.create_server(("127.0.0.1", 0))
    data_dir = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    overrides = settings_for(
        data_dir,
        **{
            "remote.backend": "kvstore",
            "remote.nodes": f"127.0.0.1:{silent.getsockname()[1]}",
            "remote.timeout_s": "2",
            "remote.tokens": "t/local=tok-a",
        },
    )
    server = start_server(load_settings(env={}, overrides=overrides))
    try:
        served = Served(server, data_dir)
        keys = stored(served, 2, "remote-local")
        missing = chain(2, salt="remote-missing")
        slow_s: list[float] = []

        def look_past_the_local_prefix() -> None:
            with connect(served.unix) as kv:
                started = time.monotonic()
                kv.lookup(MODEL.fingerprint(), missing)
                slow_s.append(time.monotonic() - started)

        slow = threading.Thread(target=look_past_the_local_prefix)
        with connect(served.unix) as other:
            assert other.lookup(MODEL.fingerprint(), keys) == 2  # connected, warm
            slow.start()
            time.sleep(0.3)  # the slow lookup is waiting on the silent node
            worst = 0.0
            for _ in range(10):
                started = time.monotonic()
                assert other.lookup(MODEL.fingerprint(), keys) == 2
                worst = max(worst, time.monotonic() - started)
        slow.join(30)
        assert slow_s and slow_s[0] > 1.0, "the remote tier answered: nothing was waited on"
        assert worst < 0.5, f"a local lookup waited {worst:.2f} s behind one on the remote tier"
    finally:
        server.stop()
        silent.close()
        shutil.rmtree(data_dir, ignore_errors=True)
