"""`kvstore serve` as a process: it drains on SIGTERM and exits 0 with nvme flushed, the cache
survives the restart, and `kvstore stats` / `kvstore invalidate` talk to it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.ports import free_port
from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import ModelIdentity, block_keys
from tests.service_fixtures import MODEL

BLOCK = MODEL.block_bytes


def _serve(data_dir: str) -> ServerProcess:
    settings = {
        "dram.capacity_bytes": "4MiB",
        "dram.page_bytes": "1MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "64MiB",
    }
    return ServerProcess(settings, data_dir)


@pytest.fixture
def data_dir() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="kvp-", dir="/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _cli(data_dir: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args, "--data-dir", data_dir],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sigterm_drains_flushes_and_the_cache_survives(data_dir: str) -> None:
    server = _serve(data_dir)
    address = server.unix
    keys = block_keys(MODEL.fingerprint(), list(range(16 * 40)), 16)
    blocks = [os.urandom(BLOCK) for _ in keys]
    with connect(address) as kv:
        fp = kv.register(MODEL)
        assert kv.write(fp, keys, blocks) == 40
    assert server.stop() == 0  # SIGTERM: a drain
    assert not Path(data_dir, "kvstore.sock").exists()
    server = _serve(data_dir)
    try:
        with connect(address) as kv:
            assert kv.lookup(fp, keys) == 40
            assert kv.get(fp, keys) == blocks
    finally:
        assert server.stop() == 0


def test_stats_and_invalidate_commands(data_dir: str) -> None:
    server = _serve(data_dir)
    try:
        keys = block_keys(MODEL.fingerprint(), list(range(16 * 3)), 16)
        with connect(f"unix://{data_dir}/kvstore.sock") as kv:
            fp = kv.register(MODEL)
            kv.put(fp, keys, [os.urandom(BLOCK) for _ in keys])
        stats = json.loads(_cli(data_dir, "stats", "--json").stdout)
        assert stats["tenant"] == "local"
        assert [t["name"] for t in stats["tiers"]] == ["dram", "nvme"]
        assert stats["counters"]["put_blocks"] == 3
        table = _cli(data_dir, "stats").stdout
        assert "dram" in table and "nvme" in table
        moved = _cli(data_dir, "demote", "--tier", "dram")
        assert moved.returncode == 0 and "moved 3 blocks out of dram" in moved.stdout
        with connect(f"unix://{data_dir}/kvstore.sock") as kv:
            assert kv.lookup_tiers(fp, keys).tiers == ("nvme",) * 3
        assert _cli(data_dir, "demote", "--tier", "nvme").returncode != 0  # the slowest tier
        refused = _cli(data_dir, "invalidate", "--everything", stdin="no\n")
        assert refused.returncode == 1 and "nothing removed" in refused.stdout
        done = _cli(data_dir, "invalidate", "--fingerprint", fp.hex())
        assert done.returncode == 0 and "removed 3 blocks" in done.stdout
        done = _cli(data_dir, "invalidate", "--everything", "--yes")
        assert "removed 0 blocks" in done.stdout
        bad = _cli(data_dir, "invalidate", "--fingerprint", "zz")
        assert bad.returncode == 2
    finally:
        assert server.stop() == 0


def _gc_collections(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'^python_gc_collections_total\{generation="(\d)"\} (\S+)$', text, re.M)
    return {gen: float(n) for gen, n in found}


def test_a_serving_process_runs_no_full_garbage_collection(data_dir: str) -> None:
    """A full collection holds the GIL while it walks every object (0.1 s in a fresh server,
    0.6 s with 500k blocks indexed): `kvstore serve` runs the young ones only. Tens of
    thousands of blocks stored make CPython's default start several full ones."""
    port = free_port()
    settings = {
        "dram.capacity_bytes": "16MiB",
        "dram.page_bytes": "1MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "64MiB",
        "server.metrics_address": f"127.0.0.1:{port}",
    }
    server = ServerProcess(settings, data_dir)
    try:
        tiny = ModelIdentity(
            "test/gc", "cd" * 32, num_layers=1, num_kv_heads=1, head_dim=16, tokens_per_block=1
        )
        keys = block_keys(tiny.fingerprint(), list(range(40_000)), 1)
        block = os.urandom(tiny.block_bytes)
        before = _gc_collections(port)
        assert before["0"] > 0  # the counters are there, and young collections have run
        with connect(server.tcp or server.unix) as kv:
            fp = kv.register(tiny)
            for start in range(0, len(keys), 2000):
                part = keys[start : start + 2000]
                assert kv.put(
                    fp, part, [block] * len(part), parent=keys[start - 1] if start else None
                ) == len(part)
            assert kv.lookup(fp, keys[:64]) == 64
        after = _gc_collections(port)
        assert after["0"] > before["0"] + 100 and after["1"] > before["1"] + 10  # garbage was collected
        assert after["2"] == before["2"]
    finally:
        server.stop()


def test_sigusr1_dumps_every_threads_stack_and_the_server_goes_on(data_dir: str) -> None:
    """A drain that hangs can be seen: `kill -USR1` writes each thread's stack to the log (what
    the benchmarks' and tests' harness sends before it kills a server that did not drain)."""
    settings = {"dram.capacity_bytes": "16MiB", "dram.page_bytes": "1MiB", "dram.prefault": "false"}
    server = ServerProcess({**settings, "nvme.capacity_bytes": "64MiB"}, data_dir)
    try:
        os.kill(server.pid, signal.SIGUSR1)
        log = Path(data_dir) / "serve.log"
        # A thread of the store's and the main thread, read once the dump has been written out
        # (it goes to the log a thread at a time: a read may land mid-dump).
        wanted = ("kvstore/store/cleaner.py", "Current thread", "kvstore/server/serve.py")
        deadline = time.monotonic() + 10
        while not all(w in log.read_text(errors="replace") for w in wanted):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        with connect(server.unix) as kv:
            assert kv.stats()["tiers"]  # still serving
    finally:
        assert server.stop() == 0
