"""A get that fails after its blocks began ends its connection; it never writes a status frame
where the client reads the next block's size."""

from __future__ import annotations

import socket
import time

import pytest

from kvstore import wire
from kvstore.client import connect
from kvstore.server import dataplane
from tests.service_fixtures import MODEL, Served, blocks_for, chain, served

__all__ = ["served"]

N_BLOCKS = 600  # 4.7 MiB of 8 KiB blocks: more than the sockets' buffers hold, so the server waits


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at the end of the stream before all came."""
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            return None
        got += chunk
    return bytes(got)


def test_a_get_whose_leases_run_out_mid_answer_ends_on_a_block_boundary(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    with connect(served.tcp, token="tok-a", data_plane="grpc") as kv:
        fp = kv.register(MODEL)
        keys = chain(N_BLOCKS, "cut")
        stored = 0
        for first in range(0, N_BLOCKS, 100):
            stored += kv.put(fp, keys[first : first + 100], blocks_for(keys[first : first + 100]))
        assert stored == N_BLOCKS
        port = kv.server_info()["data_port"]
    monkeypatch.setattr(dataplane, "LEASE_S", 0.5)  # a slow reader outlives its pins

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(wire.hello(b"tok-a", b""))
        assert wire.read_status(sock)[0] == 0
        sock.sendall(wire.keys_request(wire.OP_GET, bytes(fp), keys))
        assert wire.read_status(sock)[0] == 0
        received, ended_by = 0, "close"
        while True:
            head = _recv_exactly(sock, 8)
            if head is None:
                break  # closed between blocks: the answer cut short, as it should be
            (size,) = wire.SIZE.unpack(head)
            if size == wire.END:
                ended_by = "end"
                break
            assert size <= MODEL.block_bytes, f"block {received}: a size of {size} bytes is no block's"
            body = _recv_exactly(sock, 8 + size)
            assert body is not None, f"the stream ended inside block {received}"
            received += 1
            if received == 1:
                time.sleep(1.0)  # the server fills the socket and waits; its leases run out
    finally:
        sock.close()
    assert ended_by == "close" and received < N_BLOCKS
