"""The raw data port under slow and hostile clients: a whole request has one deadline, however
its bytes trickle; a slot is never touched after its lease; the hello has a deadline; the
acceptor survives a thread that cannot start; a drain takes one grace, not one per client."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import xxhash

import kvstore.server.dataport as dataport
from kvstore.client import connect
from kvstore.status import Status
from kvstore.wire import MAGIC, OP_GET, OP_RESERVE, read_status
from tests.service_fixtures import BLOCK, MODEL, Served, blocks_for, chain
from tests.service_fixtures import served as served  # the fixture
from tests.test_service import put_header


def hello(served: Served, token: str, rcvbuf: int = 0) -> socket.socket:
    assert served.server.data_port is not None
    host = served.tcp.rpartition(":")[0]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # before connecting: the window is agreed then
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((host, served.server.data_port.port))
    sock.sendall(MAGIC + struct.pack("<H", len(token)) + token.encode() + struct.pack("<H", 0))
    assert read_status(sock)[0] == Status.OK
    return sock


def test_a_trickled_put_is_cut_and_touches_nothing(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataport, "REQUEST_S", 1.0)
    fp = MODEL.fingerprint()
    mine = chain(1, salt="beta")
    sock = hello(served, "tok-b")
    sock.sendall(put_header(mine[0], BLOCK) + b"b" * (BLOCK // 2))
    started = time.monotonic()
    cut = False
    while time.monotonic() - started < 5:  # a byte every 0.1 s: each recv is quick, the whole is not
        try:
            sock.sendall(b"b")
        except OSError:
            cut = True
            break
        time.sleep(0.1)
    assert cut or read_status(sock)[0] != Status.OK, "the server kept waiting for a trickle"
    assert time.monotonic() - started < 3
    sock.close()
    alpha_keys = chain(8, salt="alpha")
    alpha = blocks_for(alpha_keys)
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-b") as b:
        a.put(fp, alpha_keys, alpha)  # the slots beta had reserved are free and reused now
        assert a.get(fp, alpha_keys) == alpha
        assert b.lookup(fp, mine) == 0


def test_a_slow_reader_gets_its_own_bytes_or_nothing(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataport, "REQUEST_S", 1.0)
    fp = MODEL.fingerprint()
    keys = chain(400, salt="slow-reader")  # 3.2 MiB: more than the socket buffers hold
    blocks = blocks_for(keys)
    with connect(served.tcp, token="tok-b") as b:
        b.put(fp, keys, blocks)
    sock = hello(served, "tok-b", rcvbuf=4096)
    sock.sendall(struct.pack("<B", OP_GET) + fp + struct.pack("<I", len(keys)) + b"".join(keys))
    sock.settimeout(5)
    received = bytearray()
    started = time.monotonic()
    while time.monotonic() - started < 6:
        try:
            chunk = sock.recv(4096)  # 4 KiB every 50 ms: far slower than the deadline allows
        except OSError:
            break
        if not chunk:
            break
        received += chunk
        time.sleep(0.05)
    sock.close()
    # Whatever arrived is a prefix of beta's own stream: the status, then size, checksum and bytes
    # of its blocks.
    expected = bytearray(struct.pack("<BI", 0, 0))
    for block in blocks:
        expected += struct.pack("<QQ", len(block), xxhash.xxh3_64_intdigest(block)) + block
    assert len(received) < len(expected), "a reader that slow cannot have finished: it was cut"
    assert received == expected[: len(received)]
    with connect(served.tcp, token="tok-a") as a:  # meanwhile others are served
        other = chain(2, salt="other")
        a.put(fp, other, blocks_for(other))


def test_a_silent_connection_is_closed_after_the_hello_deadline(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dataport, "HELLO_S", 0.5)
    assert served.server.data_port is not None
    sock = socket.create_connection((served.tcp.rpartition(":")[0], served.server.data_port.port), timeout=5)
    sock.sendall(MAGIC[:2])  # and then nothing
    started = time.monotonic()
    assert sock.recv(64) == b""  # closed by the server
    assert time.monotonic() - started < 3
    sock.close()


def test_the_acceptor_survives_a_thread_that_cannot_start(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_start = threading.Thread.start
    failed: list[bool] = []

    def start_once_failing(self: threading.Thread) -> None:
        if self.name != "kvstore-dataport" and not failed and getattr(self, "_target", None) is not None:
            target = self._target  # type: ignore[attr-defined]
            if getattr(target, "__name__", "") == "_greet":  # a connection's hello thread
                failed.append(True)
                raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    fp = MODEL.fingerprint()
    keys = chain(2, salt="acceptor")
    with pytest.raises(Exception), connect(served.tcp, token="tok-a") as a:  # noqa: B017 - refused
        a.put(fp, keys, blocks_for(keys))
    assert failed
    monkeypatch.setattr(threading.Thread, "start", real_start)
    with connect(served.tcp, token="tok-a") as a:  # the port still accepts
        a.put(fp, keys, blocks_for(keys))
        assert a.lookup(fp, keys) == 2


def test_a_drain_takes_one_grace_whatever_the_clients_do(served: Served) -> None:
    socks = []
    for i in range(8):  # eight puts that announce a block and send half of it
        sock = hello(served, "tok-a")
        sock.sendall(put_header(chain(1, salt=f"drain-{i}")[0], BLOCK) + b"d" * (BLOCK // 2))
        socks.append(sock)
    time.sleep(0.3)
    started = time.monotonic()
    served.server.stop()  # drain_grace_s is 2 in these fixtures
    took = time.monotonic() - started
    for sock in socks:
        sock.close()
    assert took < 2 + 3, f"the drain took {took:.1f} s for a 2 s grace"


def reserve_request(keys: Sequence[bytes], size: int) -> bytes:
    tail = struct.pack("<B32sd", 0, bytes(32), 30.0) + struct.pack(f"<{len(keys)}Q", *[size] * len(keys))
    return struct.pack("<B32sI", OP_RESERVE, MODEL.fingerprint(), len(keys)) + b"".join(keys) + tail


def test_a_reservation_is_for_same_host_callers_only(served: Served) -> None:
    with connect(served.tcp, token="tok-a") as a:
        a.register(MODEL)
    sock = hello(served, "tok-a")
    sock.sendall(reserve_request(chain(2, salt="tcp-reserve"), BLOCK))
    code, message = read_status(sock)
    assert code == Status.FAILED_PRECONDITION and "same-host" in message
    sock.close()


def test_a_reservation_whose_caller_left_before_its_answer_is_aborted(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that hangs up while the store makes room (its deadline passed) never learns its
    reservation: the server aborts it, or the keys would stay claimed, unwritable by anyone,
    until the reservation's TTL. The store's reserve is held until the caller has hung up."""
    keys = chain(3, salt="left-reserve")
    port = served.server.data_socket
    assert port is not None and port.unix_path
    hung_up = threading.Event()
    reserve = port.plane.reserve

    def slow_reserve(*args: Any, **kwargs: Any) -> Any:
        reservation = reserve(*args, **kwargs)
        hung_up.wait(10)  # the store made room slowly: the caller is gone by now
        return reservation

    monkeypatch.setattr(port.plane, "reserve", slow_reserve)
    with connect(served.unix) as kv:
        kv.register(MODEL)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(port.unix_path)
        sock.sendall(MAGIC + struct.pack("<HH", 0, 0))
        assert read_status(sock)[0] == Status.OK
        sock.sendall(reserve_request(keys, BLOCK))
        sock.close()  # gone before the answer
        hung_up.set()
        monkeypatch.setattr(port.plane, "reserve", reserve)
        deadline = time.monotonic() + 5
        while True:  # the server aborts it as soon as it has reserved and looked
            pending = kv.reserve(MODEL.fingerprint(), keys, [BLOCK] * len(keys))
            if all(v is not None for v in pending.views) or time.monotonic() > deadline:
                break
            kv.abort(pending.reservation_id)
            time.sleep(0.05)
        assert all(v is not None for v in pending.views), (
            "the departed caller's reservation still holds the keys"
        )
        for view in pending.views:
            assert view is not None
            view[:] = b"r" * BLOCK
        assert kv.commit(pending.reservation_id) == len(keys)
        assert kv.get(MODEL.fingerprint(), keys) == [b"r" * BLOCK] * len(keys)
