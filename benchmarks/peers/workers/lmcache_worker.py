"""LMCache worker: starts ``lmcache_server 127.0.0.1 PORT cpu`` and drives its ``lm://`` connector.

Client: LMCache's own ``LMCServerConnector`` (what ``remote_url: lm://host:port`` creates inside
an engine), built here without vLLM from an engine config, a metadata describing one chunk as one
block, and a ``LocalCPUBackend`` whose pool holds the memory objects. Its calls are coroutines on
one asyncio loop; the worker awaits them one after another, as LMCache's remote backend does.

- put: ``put`` sends the header and the block and returns without waiting for the server, so
  each put round ends with one ``exists`` round trip (the server handles a connection in order,
  so its answer means every block is stored).
- get: ``get`` receives into a memory object it allocates from the backend's pool (recycled, so
  warm); the worker releases each one. There is no read into a caller's buffer.
- exists: ``batched_async_contains`` of the 64 keys (one EXIST round trip per key; it answers the
  length of the present prefix). The protocol has no delete: rounds overwrite the same keys.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from benchmarks.peers.workers.peerlib import (
        EXISTS_KEYS,
        Figures,
        MiB,
        PeerFailure,
        Servers,
        Workload,
        free_port,
        measure,
        worker_main,
    )
else:  # run as a script from its own folder, in the peer's interpreter
    from peerlib import (
        EXISTS_KEYS,
        Figures,
        MiB,
        PeerFailure,
        Servers,
        Workload,
        free_port,
        measure,
        worker_main,
    )

START_TIMEOUT_S = 90.0  # the server imports torch and LMCache first: ~10 s on a quiet machine
CHUNK_TOKENS = 256


class MemoryObj(Protocol):
    """The calls used of ``lmcache.v1.memory_management.MemoryObj``."""

    @property
    def data_ptr(self) -> int: ...
    @property
    def byte_array(self) -> memoryview: ...
    def ref_count_down(self) -> None: ...


class Connector(Protocol):
    """The calls used of ``LMCServerConnector`` (LMCache's ``lm://`` remote connector)."""

    meta_shapes: list[object]

    async def put(self, key: object, memory_obj: MemoryObj) -> None: ...
    async def get(self, key: object) -> MemoryObj | None: ...
    async def exists(self, key: object) -> bool: ...
    async def batched_async_contains(self, lookup_id: str, keys: list[object]) -> int: ...
    async def close(self) -> None: ...


class LMCacheOps:
    def __init__(self, conn: Connector, loop: asyncio.AbstractEventLoop, keys: list[object]) -> None:
        self.conn = conn
        self.loop = loop
        self.keys = keys
        self.exists_keys = [keys[i % len(keys)] for i in range(EXISTS_KEYS)]
        self.sources: list[MemoryObj] = []

    def clear(self) -> None:
        """The protocol has no delete; a put overwrites the server's value for that key."""

    def put_all(self) -> None:
        self.loop.run_until_complete(self._put_all())

    async def _put_all(self) -> None:
        for key, obj in zip(self.keys, self.sources, strict=True):
            await self.conn.put(key, obj)
        if not await self.conn.exists(self.keys[-1]):
            raise PeerFailure("lmcache_server does not hold the last block just put")

    def get_all(self) -> None:
        self.loop.run_until_complete(self._get_all())

    async def _get_all(self) -> None:
        for key in self.keys:
            obj = await self.conn.get(key)
            if obj is None:
                raise PeerFailure("lmcache_server missed a block just put (or the client pool is full)")
            obj.ref_count_down()

    def check(self) -> None:
        self.loop.run_until_complete(self._check())

    async def _check(self) -> None:
        for i in {0, len(self.keys) - 1}:
            obj = await self.conn.get(self.keys[i])
            if obj is None or bytes(obj.byte_array) != bytes(self.sources[i].byte_array):
                raise PeerFailure(f"lmcache_server returned different bytes for block {i}")
            obj.ref_count_down()

    def exists64(self) -> None:
        self.loop.run_until_complete(self.conn.batched_async_contains("kvbench", self.exists_keys))


def run(workload: Workload, workdir: Path) -> Figures:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    port = free_port()
    server = Path(sys.executable).parent / "lmcache_server"
    with Servers(workdir) as servers:
        servers.start("lmcache_server", [str(server), "127.0.0.1", str(port), "cpu"])
        servers.wait_port("lmcache_server", port, START_TIMEOUT_S)
        loop = asyncio.new_event_loop()
        try:
            figures = _measure(workload, port, loop)
        finally:
            loop.close()
    figures["client"] = (
        f"lmcache {metadata.version('lmcache')}: LMCServerConnector (lm://) on one asyncio loop, no vLLM"
    )
    figures["notes"] = (
        "put ends with one EXIST round trip; get lands in LMCache's pooled memory objects; "
        "exists = batched_async_contains (64 EXIST round trips); rounds overwrite (no delete)"
    )
    return figures


def _measure(workload: Workload, port: int, loop: asyncio.AbstractEventLoop) -> Figures:
    import torch
    from lmcache.utils import CacheEngineKey  # type: ignore[import-not-found]
    from lmcache.v1.config import load_engine_config_with_overrides  # type: ignore[import-not-found]
    from lmcache.v1.memory_management import MemoryFormat  # type: ignore[import-not-found]
    from lmcache.v1.metadata import LMCacheMetadata  # type: ignore[import-not-found]
    from lmcache.v1.storage_backend.connector.lm_connector import (  # type: ignore[import-not-found]
        LMCServerConnector,
    )
    from lmcache.v1.storage_backend.local_cpu_backend import (  # type: ignore[import-not-found]
        LocalCPUBackend,
    )

    # One chunk of CHUNK_TOKENS tokens of bf16 KV is one block: [K|V] x 1 layer x tokens x hidden.
    hidden = workload.block_bytes // (2 * 2 * CHUNK_TOKENS)
    if hidden * 2 * 2 * CHUNK_TOKENS != workload.block_bytes:
        raise PeerFailure(f"block_bytes must be a multiple of {4 * CHUNK_TOKENS} for the LMCache layout")
    pool_bytes = 2 * workload.total_bytes + 256 * MiB  # the sources plus the blocks being received
    config = load_engine_config_with_overrides(
        overrides={
            "chunk_size": CHUNK_TOKENS,
            "local_cpu": False,
            "max_local_cpu_size": pool_bytes / (1 << 30),
        }
    )
    meta = LMCacheMetadata(
        model_name="kvbench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(1, 2, CHUNK_TOKENS, 1, hidden),
        chunk_size=CHUNK_TOKENS,
    )
    backend = LocalCPUBackend(config, meta)
    conn: Connector = LMCServerConnector("127.0.0.1", port, loop, backend)
    keys: list[object] = [CacheEngineKey("kvbench", 1, 0, i, torch.bfloat16) for i in range(workload.blocks)]
    ops = LMCacheOps(conn, loop, keys)
    source = workload.source_bytes()
    size = workload.block_bytes
    for i in range(workload.blocks):
        obj: MemoryObj | None = backend.allocate(conn.meta_shapes[0], torch.bfloat16, MemoryFormat.KV_2LTD)
        if obj is None:
            raise PeerFailure("LMCache's local CPU pool is too small for the source blocks")
        ctypes.memmove(obj.data_ptr, source[i * size : (i + 1) * size], size)
        ops.sources.append(obj)
    del source
    try:
        figures: Figures = dict(measure(workload, ops))
    finally:
        for obj in ops.sources:
            obj.ref_count_down()
        loop.run_until_complete(conn.close())
    return figures


if __name__ == "__main__":
    sys.exit(worker_main(run))
