"""A block changed on its way from a node over a gRPC Get stream is a counted miss for the
receiver: each frame carries the block's checksum (``BlockFrame.checksum``), and the client
checks it as the data port's get does. The node is a real ``kvstore serve``; a TCP relay in
between flips one byte of a block's payload once, as a faulty link or middlebox would."""

from __future__ import annotations

import contextlib
import socket
import threading

import numpy as np

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import block_keys
from tests.service_fixtures import MODEL, process_settings


class FlippingRelay:
    """Forwards TCP connections to ``target``; in the answers, the last byte of the first
    occurrence of ``pattern`` is flipped, once."""

    def __init__(self, target: str, pattern: bytes) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._pattern = pattern
        self.flipped = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                down, _ = self._listener.accept()
                up = socket.create_connection(self._target)
                self._sockets += [down, up]
                threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
                threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        tail = b""  # the end of what went before: a pattern may straddle two reads
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                chunk = bytearray(data)
                if answers and not self.flipped:
                    joined = tail + data
                    at = joined.find(self._pattern)
                    if at >= 0:
                        chunk[at + len(self._pattern) - 1 - len(tail)] ^= 0xFF
                        self.flipped += 1
                    tail = joined[-(len(self._pattern) - 1) :]
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in self._sockets:
            s.close()


def test_a_block_changed_on_its_way_over_grpc_is_a_counted_miss_for_the_receiver() -> None:
    blocks = [np.random.default_rng(40 + i).bytes(MODEL.block_bytes) for i in range(3)]
    server = ServerProcess(process_settings(), tcp=True)
    relay: FlippingRelay | None = None
    try:
        with connect(server.tcp, token="tok-a") as kv:
            fp = kv.register(MODEL)
            keys = block_keys(fp, list(range(3 * MODEL.tokens_per_block)), MODEL.tokens_per_block)
            assert kv.put(fp, keys, blocks) == 3
        relay = FlippingRelay(server.tcp, blocks[1][1000:1032])
        with connect(relay.address, token="tok-a", data_plane="grpc") as kv:
            got = kv.get(fp, keys)
            assert relay.flipped == 1
            assert [bytes(b) for b in got] == blocks[:1], "a miss from the changed block on"
            assert kv.checksum_failures == 1
            assert [bytes(b) for b in kv.get(fp, keys)] == blocks  # unchanged on the node
            assert kv.checksum_failures == 1
    finally:
        if relay is not None:
            relay.close()
        server.stop()
