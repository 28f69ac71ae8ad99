"""Redis 7 worker: starts ``redis-server`` on 127.0.0.1 (no persistence), measures it with redis-py.

Client: redis-py with hiredis parsing the replies but redis-py's pure-Python command packer, which
sends a ``memoryview`` value as its own chunk instead of copying it into the command (hiredis's
packer copies every value, ~0.4 GB/s for 2 MiB SETs). Puts go in pipelines of ``PIPELINE``
SETs; gets are one GET per key (measured faster than MGET for 2 MiB values); redis-py returns a new
``bytes`` per value and offers no read into a caller's buffer. The existence check is one
multi-key ``EXISTS`` (it answers a count, not one bit per key).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import redis  # type: ignore[import-not-found]
from redis._parsers import Encoder  # type: ignore[import-not-found]
from redis.connection import (  # type: ignore[import-not-found]
    HIREDIS_AVAILABLE,
    ConnectionPool,
    PythonRespSerializer,
)

if TYPE_CHECKING:
    from benchmarks.peers.workers.peerlib import (
        Figures,
        PeerFailure,
        Servers,
        Workload,
        free_port,
        measure,
        worker_main,
    )
else:  # run as a script from its own folder, in the peer's interpreter
    from peerlib import Figures, PeerFailure, Servers, Workload, free_port, measure, worker_main

PIPELINE = 8
START_TIMEOUT_S = 15.0


class RedisOps:
    def __init__(self, client: redis.Redis, workload: Workload) -> None:
        self.r = client
        self.w = workload
        self.keys = workload.keys()
        self.exists_keys = workload.exists_keys()
        self.src = memoryview(workload.source_bytes())
        self.got: list[bytes | None] = [None] * workload.blocks

    def block(self, i: int) -> memoryview:
        return self.src[i * self.w.block_bytes : (i + 1) * self.w.block_bytes]

    def clear(self) -> None:
        self.r.flushall()

    def put_all(self) -> None:
        for start in range(0, self.w.blocks, PIPELINE):
            pipe = self.r.pipeline(transaction=False)
            for i in range(start, min(self.w.blocks, start + PIPELINE)):
                pipe.set(self.keys[i], self.block(i))
            pipe.execute()

    def get_all(self) -> None:
        for i, key in enumerate(self.keys):
            self.got[i] = self.r.get(key)  # type: ignore[assignment]

    def check(self) -> None:
        for i in {0, self.w.blocks - 1}:
            if self.got[i] != bytes(self.block(i)):
                raise PeerFailure(f"redis returned different bytes for block {i}")

    def exists64(self) -> None:
        self.r.exists(*self.exists_keys)


def run(workload: Workload, workdir: Path) -> Figures:
    server = shutil.which("redis-server")
    if server is None:
        raise PeerFailure("redis-server is not installed: apt-get install -y redis-server")
    port = free_port()
    argv = [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(workdir), "--daemonize", "no"]
    with Servers(workdir) as servers:
        servers.start("redis-server", argv)
        servers.wait_port("redis-server", port, START_TIMEOUT_S)
        encoder = Encoder("utf-8", "strict", False)
        pool = ConnectionPool(
            host="127.0.0.1", port=port, command_packer=PythonRespSerializer(6000, encoder.encode)
        )
        client = redis.Redis(connection_pool=pool)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(client):
            if time.monotonic() > deadline:
                raise PeerFailure(f"redis-server did not answer PING; {servers.log_tail('redis-server')}")
            time.sleep(0.05)
        version = client.info("server").get("redis_version", "?")
        figures: Figures = dict(measure(workload, RedisOps(client, workload)))
        pool.disconnect()
    parser = "hiredis" if HIREDIS_AVAILABLE else "pure-Python"
    figures["client"] = (
        f"redis-py {redis.__version__} ({parser} reply parser, pure-Python packer), redis-server {version}"
    )
    figures["notes"] = (
        f"SET in pipelines of {PIPELINE}, one GET per key (a new bytes object each), "
        "multi-key EXISTS (a count)"
    )
    return figures


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.BusyLoadingError:
        return False


if __name__ == "__main__":
    sys.exit(worker_main(run))
