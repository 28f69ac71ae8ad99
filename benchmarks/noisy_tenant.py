"""A noisy tenant for the fairness row and its test (``benchmarks.fairness``): processes that
hold many data-port connections, each keeping lookups pipelined and reading every answer.

The worker processes import nothing but the standard library (a spawned process imports the
module of its target: a second or more of CPU each for gRPC and the rest, on two CPUs), and end
by themselves at a deadline fixed when they start, whatever becomes of the process that started
them. 127.0.0.1 only.
"""

from __future__ import annotations

import multiprocessing
import selectors
import socket
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType


@dataclass(frozen=True)
class Load:
    """What each connection sends: ``hello`` once (answered by ``hello_answer_bytes``), then
    ``depth`` copies of ``request`` in flight, each answered by ``answer_bytes`` (the bytes made
    by ``kvstore.wire`` in the parent: the workers import only the standard library)."""

    hello: bytes
    hello_answer_bytes: int
    request: bytes
    answer_bytes: int
    depth: int


def _flood(
    port: int, load: Load, connections: int, until: float, ready: EventType, answered: EventType
) -> None:
    selector = selectors.DefaultSelector()
    socks = []
    try:
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
            s.sendall(load.hello)
            status = s.recv(load.hello_answer_bytes, socket.MSG_WAITALL)
            if status[:1] != b"\0":
                raise RuntimeError(f"the noisy tenant's hello was refused: {status!r}")
        ready.set()
        pending = dict.fromkeys(socks, 0)  # answer bytes received past the last whole answer
        last = dict.fromkeys(socks, b"")  # what each received last, to say why it ended
        for s in socks:
            s.sendall(load.request * load.depth)
            selector.register(s, selectors.EVENT_READ)
        while time.time() < until:
            for key, _ in selector.select(timeout=0.5):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                data = conn.recv(1 << 16)
                if not data:
                    raise RuntimeError(f"the server closed a noisy connection after {last[conn][-200:]!r}")
                last[conn] = data
                whole, pending[conn] = divmod(pending[conn] + len(data), load.answer_bytes)
                if whole:
                    answered.set()
                    conn.sendall(load.request * whole)
    finally:
        selector.close()
        for s in socks:
            s.close()


class Flood:
    """``processes`` processes flooding the data port on ``port`` over ``connections``
    connections until ``stop``, or ``duration_s`` at the most."""

    def __init__(self, port: int, load: Load, connections: int, processes: int, duration_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        until = time.time() + duration_s
        self._ready = [ctx.Event() for _ in range(processes)]
        self._answered = [ctx.Event() for _ in range(processes)]
        share = [connections // processes] * processes
        share[0] += connections - sum(share)
        self._procs = [
            ctx.Process(target=_flood, args=(port, load, n, until, r, a), daemon=True)
            for n, r, a in zip(share, self._ready, self._answered, strict=True)
        ]
        for p in self._procs:
            p.start()

    def wait_flowing(self, timeout_s: float = 60.0) -> None:
        """Until every connection is open and every process has had answers."""
        deadline = time.monotonic() + timeout_s
        while not all(event.is_set() for event in self._ready + self._answered):
            if time.monotonic() > deadline or not all(p.is_alive() for p in self._procs):
                self.stop()
                raise RuntimeError("the noisy tenant's connections did not all open and get answers")
            time.sleep(0.05)
        time.sleep(0.5)  # every connection in its steady state

    def stop(self) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.join(30)

    def __enter__(self) -> Flood:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
