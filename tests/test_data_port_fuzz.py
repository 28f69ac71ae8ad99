"""The raw data port fed garbage: random bytes, truncated frames, huge and negative sizes, wrong
and missing tokens, interleaved with a good client. The port stays up, answers only with the
contract's status codes (never UNKNOWN), and the good client's blocks stay intact."""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore.server.dataport as dataport
from kvstore.client import connect
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from kvstore.status import Status
from kvstore.wire import MAGIC, OP_GET, OP_HEAD, OP_LOOKUP, OP_PUT, OP_RELEASE, OP_RESOLVE
from tests.service_fixtures import MODEL, blocks_for, chain, settings_for

FP = MODEL.fingerprint()
GOOD_KEYS = chain(4, salt="good")
GOOD = blocks_for(GOOD_KEYS)  # once: a second put of the same keys is a no-op
CONTRACT = {
    Status.OK,
    Status.INVALID_ARGUMENT,
    Status.UNAUTHENTICATED,
    Status.PERMISSION_DENIED,
    Status.RESOURCE_EXHAUSTED,
    Status.NOT_FOUND,
    Status.FAILED_PRECONDITION,
    Status.UNAVAILABLE,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    data_dir = tempfile.mkdtemp(prefix="kvdf-", dir="/tmp")
    running = start_server(load_settings(env={}, overrides=settings_for(data_dir)))
    yield running
    running.stop()
    shutil.rmtree(data_dir, ignore_errors=True)


def hello_bytes(token: str | None, scope: str) -> bytes:
    if token is None:
        return b""
    t, s = token.encode(), scope.encode()
    return MAGIC + struct.pack("<H", len(t)) + t + struct.pack("<H", len(s)) + s


key = st.one_of(st.just(chain(1, salt="good")[0]), st.binary(min_size=32, max_size=32))
sizes = st.one_of(st.integers(0, 1 << 20), st.just(2**63), st.just(2**64 - 1), st.integers(0, 2**64 - 1))
counts = st.one_of(st.integers(0, 4), st.just(2**32 - 1), st.integers(0, 2**32 - 1))


@st.composite
def operation(draw: st.DrawFn) -> bytes:
    op = draw(st.sampled_from([OP_GET, OP_PUT, OP_LOOKUP, OP_RESOLVE, OP_RELEASE, OP_HEAD, 0, 7, 255]))
    n = draw(counts)
    listed = draw(st.lists(key, max_size=3))
    if op in (OP_GET, OP_LOOKUP, OP_RESOLVE, OP_HEAD):
        body = FP + struct.pack("<I", n) + b"".join(listed)
        if op == OP_HEAD:  # the bytes asked of each block
            body += struct.pack("<I", draw(counts))
        elif op != OP_GET:
            body += struct.pack("<d", draw(st.floats(allow_nan=True, allow_infinity=True)))
    elif op == OP_PUT:
        body = FP + struct.pack("<B32s", draw(st.integers(0, 1)), b"\1" * 32) + struct.pack("<I", n)
        body += b"".join(k + struct.pack("<Q", draw(sizes)) for k in listed)
        body += draw(st.binary(max_size=64))
    elif op == OP_RELEASE:
        body = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    else:
        body = draw(st.binary(max_size=64))
    raw = struct.pack("<B", op) + body
    cut = draw(st.one_of(st.none(), st.integers(0, max(0, len(raw) - 1))))
    return raw if cut is None else raw[:cut]


requests = st.one_of(
    st.binary(max_size=200),  # garbage instead of a hello
    st.tuples(
        st.sampled_from([None, "tok-a", "tok-b", "nonsense", ""]),
        st.sampled_from(["", "public", "secret"]),
        st.lists(operation(), max_size=3),
    ),
)


def answers(sock: socket.socket) -> list[int]:
    """Every status code the server sent before closing (or going quiet)."""
    codes = []
    data = bytearray()
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    # Only the leading status is parsed: what follows an OK is a reply body.
    if len(data) >= 5:
        code, _length = struct.unpack_from("<BI", data, 0)
        codes.append(code)
    return codes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_garbage_never_hurts_the_port_or_the_blocks(
    server: RunningServer, request: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # short deadlines keep 300 examples quick, yet long enough for the good client's own hello
    # on a busy 2-core machine (0.3 s failed there under load)
    monkeypatch.setattr(dataport, "HELLO_S", 1.5)
    monkeypatch.setattr(dataport, "REQUEST_S", 1.5)
    assert server.data_port is not None and server.tcp_address is not None
    good_keys, good = GOOD_KEYS, GOOD
    with connect(server.tcp_address, token="tok-a") as kv:
        kv.put(FP, good_keys, good)
    raw = request if isinstance(request, bytes) else None
    with socket.create_connection(("127.0.0.1", server.data_port.port), timeout=3) as sock:
        if raw is None:
            token, scope, ops = request  # type: ignore[misc]
            raw = hello_bytes(token, scope) + b"".join(ops)
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed first: fine
        for code in answers(sock):
            assert code in CONTRACT, f"{code} for {raw[:80]!r}"
    with connect(server.tcp_address, token="tok-a") as kv:  # the good client's blocks, intact
        assert kv.get(FP, good_keys) == good
