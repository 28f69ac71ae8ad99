"""``kvstore route`` (the command, as processes) keys each tenant's cache salt by its salt secret:
what a tenant's requests carry to the engines cannot be computed from the tenant's name, differs
under another secret, and is the same from another router process with the same secret (one from
the file, one from the variable): on two routers of a fleet or after a restart, the engines'
caches stay warm. The replica is
``tests/router_fleet.py``'s, which answers with the salt it was given."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.tiny_model import build_tiny_llama
from kvstore.routing.callers import tenant_salt
from tests.router_fleet import Seen, free_port, replica, serve_replica

KVSTORE = str(Path(sys.executable).parent / "kvstore")
KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
SECRET_1 = "the-first-salt-secret-of-32-char"
SECRET_2 = "the-other-salt-secret-of-32-char"


@dataclass(frozen=True)
class Setup:
    model: Path
    keys: Path
    backend: str  # the echoing replica
    folder: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("route-salt")
    model = build_tiny_llama(folder / "model", seed=0)  # the router reads its tokenizer
    keys = folder / "keys"
    keys.write_text("".join(f"{key}={tenant}\n" for tenant, key in KEYS.items()))
    keys.chmod(0o600)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()
    echo = asyncio.run_coroutine_threadsafe(serve_replica(replica("r0", Seen()), port), loop).result(10)
    try:
        yield Setup(model, keys, f"http://127.0.0.1:{port}", folder)
    finally:
        asyncio.run_coroutine_threadsafe(echo.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class RouteProcess:
    """``kvstore route`` over the echoing replica, its salt secret from a file or the variable."""

    def __init__(self, setup: Setup, secret_file: Path | None = None, secret: str = "") -> None:
        self.port = free_port()
        argv = [KVSTORE, "route", "--model", str(setup.model), "--backend", setup.backend]
        argv += ["--policy", "hash", "--listen", f"127.0.0.1:{self.port}", "--keys-file", str(setup.keys)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        if secret_file is not None:
            argv += ["--salt-secret-file", str(secret_file)]
        if secret:
            env["KVSTORE_ROUTE_SALT_SECRET"] = secret
        self._log = setup.folder / f"route-{self.port}.log"
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def wait_up(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.salt("tenant-a")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"kvstore route did not start: {self._log.read_text()}") from None
                time.sleep(0.2)

    def salt(self, tenant: str, asked: str = "") -> str:
        """The cache_salt the replica got for a request of ``tenant``'s."""
        body: dict[str, str] = {"prompt": "word1 token2 text3", **({"cache_salt": asked} if asked else {})}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tenant]}"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            salt: str = json.loads(r.read())["cache_salt"]
            return salt

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # a router stops at once on SIGTERM: one that does not fails
            self.proc.kill()
            raise


@contextlib.contextmanager
def routers(*processes: RouteProcess) -> Iterator[None]:
    """Started together (each loads its tokenizer), stopped whatever happens."""
    try:
        for p in processes:
            p.wait_up()
        yield
    finally:
        for p in processes:
            p.stop()


def test_a_tenants_salt_is_keyed_by_the_routers_secret(setup: Setup) -> None:
    secret_file = setup.folder / "salt-secret"
    secret_file.write_text(SECRET_1 + "\n")
    secret_file.chmod(0o600)
    first, other = RouteProcess(setup, secret_file=secret_file), RouteProcess(setup, secret=SECRET_2)
    with routers(first, other):
        salts = {t: first.salt(t) for t in KEYS}
        mine = first.salt("tenant-a", "mine")
        # what anyone could compute from a tenant's name (the unkeyed hash): not what is sent
        assert salts["tenant-a"] != tenant_salt(b"", "tenant-a")
        assert salts["tenant-a"] != salts["tenant-b"] and mine not in salts.values()
        assert all(other.salt(t) != salts[t] for t in KEYS)  # another secret: other salts
    # the first router gone, another with its secret (from the variable this time): the same
    # salts, as on two routers of one fleet, or one router restarted; the caches stay warm
    same = RouteProcess(setup, secret=SECRET_1)
    with routers(same):
        assert {t: same.salt(t) for t in KEYS} == salts and same.salt("tenant-a", "mine") == mine
