"""Attacks on ``kvstore route``'s front door, on 127.0.0.1 in front of real HTTP replicas
(``tests/router_fleet.py``): malformed bodies, a slowloris, a trickled body, a caller that leaves
mid-request, and TLS on the listener."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from benchmarks.tls_certs import make_certs
from kvstore.tls import ClientTls, ServerTls
from tests.router_fleet import OPS, A, Fleet, with_fleet

DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
MALFORMED: list[tuple[str, bytes]] = [
    ("not JSON", b"{not json"),
    ("not UTF-8", b'{"prompt": "\xff\xfe"}'),
    ("not an object", b"[1, 2]"),
    ("nested 100k deep", DEEP),
    ("nested 65 deep", b'{"x": ' + b"[" * 65 + b"]" * 65 + b"}"),
    ("a token id of 2^31", b'{"prompt": [1, 2147483648]}'),
    ("a negative token id", b'{"prompt": [1, -1]}'),
    ("1e400", b'{"prompt": [1e400]}'),
    ("1e400 elsewhere", b'{"prompt": "x", "temperature": 1e400}'),
    ("NaN", b'{"prompt": "x", "top_p": NaN}'),
    ("a 30-digit integer", b'{"prompt": [100000000000000000000000000000]}'),
    ("a 5000-digit integer", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
    ("a float token id", b'{"prompt": [1.5]}'),
    ("a boolean token id", b'{"prompt": [true]}'),
    ("a prompt object", b'{"prompt": {"a": 1}}'),
    ("mixed prompt list", b'{"prompt": ["a", 1]}'),
    ("a bad id in a batch", b'{"prompt": [[1, 2], [-5]]}'),
    ("a number for a salt", b'{"prompt": "x", "cache_salt": 5}'),
]
MALFORMED_CHATS: list[tuple[str, bytes]] = [
    ("messages a string", b'{"messages": "hi"}'),
    ("no messages", b'{"model": "m"}'),
    ("a message a number", b'{"messages": [5]}'),
    ("content a number", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("role a list", b'{"messages": [{"role": [], "content": "x"}]}'),
]


def test_every_malformed_body_is_a_400_with_a_json_error() -> None:
    async def test(fleet: Fleet) -> None:
        cases = [(c, "/v1/completions", b) for c, b in MALFORMED]
        cases += [(c, "/v1/chat/completions", b) for c, b in MALFORMED_CHATS]
        for case, path, body in cases:
            async with fleet.session.post(
                fleet.url + path, data=body, headers={**A, "Content-Type": "application/json"}
            ) as r:
                answer = await r.json()
                assert r.status == 400, (case, r.status, answer)
                assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == 400
        assert fleet.router.stats().routed == 0
        status, _ = await fleet.post({"prompt": [0, 2147483647]})  # the edges of the range are fine
        assert status == 200

    with_fleet(test)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(0.05)
    return s


def _closed(s: socket.socket) -> bytes | None:
    """What the router sent before closing (read to the end: an answer not followed by a close
    within 3 s fails), or None while nothing has come."""
    try:
        data = s.recv(65536)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""
    s.settimeout(3)
    while data and (chunk := s.recv(65536)):  # TimeoutError here: the connection was left open
        data += chunk
    return data


def test_a_slowloris_head_is_cut_and_a_trickled_body_is_a_408() -> None:
    async def test(fleet: Fleet) -> None:
        def trickle(opening: bytes, drip: bytes) -> tuple[float, bytes]:
            s = _connect(fleet.port)
            start = time.monotonic()
            try:
                s.sendall(opening)
                while time.monotonic() - start < 10:  # a byte every 0.05 s, for ever if let
                    answered = time.monotonic() - start
                    if (seen := _closed(s)) is not None:
                        return answered, seen
                    try:
                        s.sendall(drip)
                    except (BrokenPipeError, ConnectionResetError):
                        return time.monotonic() - start, b""
                    time.sleep(0.05)
                return time.monotonic() - start, b"still open"
            finally:
                s.close()

        loop = asyncio.get_running_loop()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        took, seen = await loop.run_in_executor(None, trickle, head, b"X")  # a header that never ends
        assert took < 3 and seen == b"", (took, seen)  # header_timeout_s is 1
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
        head += b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        took, seen = await loop.run_in_executor(None, trickle, head + b'{"prompt": "', b"x")
        assert took < 3 and seen.startswith(b"HTTP/1.1 408"), (took, seen[:80])  # body_timeout_s is 1
        assert b'"invalid_request_error"' in seen
        assert fleet.router.stats().routed == 0

    with_fleet(test)


def test_a_caller_that_leaves_cancels_its_upstream_request() -> None:
    async def test(fleet: Fleet) -> None:
        with pytest.raises(TimeoutError):
            async with fleet.session.post(
                fleet.url + "/v1/completions",
                json={"prompt": "slow"},
                headers=A,
                timeout=aiohttp.ClientTimeout(total=0.5),
            ):
                pass
        assert fleet.seen.running == 0 or await _settled(fleet)
        assert len(fleet.seen.cancelled) == 1  # the replica saw the caller go, long before its 30 s
        assert fleet.router.stats().in_flight == (0, 0, 0)
        status, metrics = await fleet.get("/metrics", OPS)
        assert (
            status == 200
            and 'kvstore_router_in_flight{replica="' + fleet.seen.cancelled[0] + '"} 0.0' in metrics
        )

    with_fleet(test)


async def _settled(fleet: Fleet) -> bool:
    for _ in range(100):
        if fleet.seen.running == 0 and fleet.seen.cancelled:
            return True
        await asyncio.sleep(0.05)
    return False


def test_tls_on_the_listener(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    server = ServerTls(str(certs.server_cert), str(certs.server_key)).ssl_context()
    client = ClientTls(ca_file=str(certs.ca)).ssl_context()

    async def test(fleet: Fleet) -> None:
        async with fleet.session.post(
            fleet.url + "/v1/completions", json={"prompt": "x"}, headers=A, ssl=client
        ) as r:
            assert r.status == 200 and (await r.json())["served_by"]
        with pytest.raises(aiohttp.ClientError):  # plain HTTP gets no answer from a TLS listener
            async with fleet.session.post(
                fleet.url.replace("https", "http") + "/v1/completions", json={"prompt": "x"}, headers=A
            ) as r:
                json.loads(await r.text())

    with_fleet(test, tls=server)
