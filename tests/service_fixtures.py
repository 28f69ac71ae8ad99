"""A real kvstore server on 127.0.0.1 and a Unix socket, for the service tests."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvstore.client import Client
from kvstore.keys import BlockKey, Fingerprint, ModelIdentity, block_keys
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from kvstore.store import TieredStore

TOKENS = {"tok-a": "tenant-a", "tok-b": "tenant-b", "tok-c": "tenant-c", "tok-ops": "ops"}
MODEL = ModelIdentity("test/tiny", "aa" * 32, num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=16)
BLOCK = MODEL.block_bytes  # 8 KiB


@dataclass
class Served:
    server: RunningServer
    data_dir: str

    @property
    def unix(self) -> str:
        return self.server.unix_address

    @property
    def tcp(self) -> str:
        assert self.server.tcp_address is not None
        return self.server.tcp_address


def settings_for(data_dir: str, **extra: str) -> dict[str, str]:
    overrides = {
        "data_dir": data_dir,
        "dram.capacity_bytes": str(64 * BLOCK),
        "dram.page_bytes": str(16 * BLOCK),
        "dram.prefault": "false",
        "nvme.capacity_bytes": "64MiB",
        "server.tcp_address": "127.0.0.1:0",
        "server.metrics_address": "127.0.0.1:0",
        "server.tokens": ",".join(f"{k}={v}" for k, v in TOKENS.items()),
        "server.admins": "local,ops",
        "server.shared_scopes.public": "tenant-a,tenant-b",
        "server.drain_grace_s": "2",
        "server.max_message_bytes": "4MiB",
        "store.quota_bytes.tenant-c": str(4 * BLOCK),
    }
    overrides.update(extra)
    return overrides


def process_settings(**extra: str) -> dict[str, str]:
    """``settings_for`` a ``ServerProcess``, which chooses its own folder and ports."""
    settings = settings_for("", **extra)
    for own in ("data_dir", "server.tcp_address", "server.metrics_address"):
        settings.pop(own)
    return settings


@pytest.fixture
def served() -> Iterator[Served]:
    # A short folder: Unix socket paths are limited to about 100 bytes.
    data_dir = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    server = start_server(load_settings(env={}, overrides=settings_for(data_dir)))
    try:
        yield Served(server, data_dir)
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def chain(n: int, salt: str = "s", start: int = 0) -> list[BlockKey]:
    return block_keys(MODEL.fingerprint(), list(range(start, start + n * 16)), 16, cache_salt=salt)


def blocks_for(keys: list[BlockKey]) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in keys]


def stored_chain(kv: Client, n: int, salt: str) -> tuple[Fingerprint, list[BlockKey], list[bytes]]:
    """A chain of ``n`` random blocks written through ``kv``: (fingerprint, keys, blocks)."""
    fp = kv.register(MODEL)
    keys = chain(n, salt=salt)
    blocks = blocks_for(keys)
    kv.write(fp, keys, blocks)
    return fp, keys, blocks


def leases_drop_to_zero(store: TieredStore, within_s: float = 5.0) -> bool:
    """Whether the store holds no lease within ``within_s`` (a release sent without waiting
    lands when the server reads it)."""
    deadline = time.monotonic() + within_s
    while store.stats().leases and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.stats().leases == 0
