"""Per-call deadlines in the client, against a hung server (a ``kvstore serve`` process stopped
with SIGSTOP): every call, over gRPC or the data port, ends at its deadline with
DeadlineExceeded, and the client works again once the server does."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import Client, connect
from kvstore.client.dataport import DataPortClient
from kvstore.errors import DeadlineExceeded
from kvstore.keys import block_keys
from tests.service_fixtures import MODEL

SLACK_S = 0.5  # a loaded 2-core host wakes a timed-out thread this late at worst


@pytest.fixture
def serving() -> Iterator[ServerProcess]:
    server = ServerProcess(
        {
            "dram.capacity_bytes": "8MiB",
            "dram.page_bytes": "1MiB",
            "dram.prefault": "false",
            "nvme.capacity_bytes": "64MiB",
        }
    )
    try:
        yield server
    finally:
        server.stop()


def _times_out(kv: Client, timeout_s: float, call: Callable[[], object]) -> float:
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded), kv.deadline(timeout_s):
        call()
    return time.monotonic() - start


def test_every_call_ends_at_its_deadline_on_a_hung_server(
    serving: ServerProcess,
) -> None:
    address = serving.unix
    keys = block_keys(MODEL.fingerprint(), list(range(16 * 4)), 16)
    with connect(address) as kv, connect(address) as fresh:
        fp = kv.register(MODEL)
        kv.write(fp, keys, [os.urandom(MODEL.block_bytes) for _ in keys])
        assert kv.lookup(fp, keys) == 4  # its data connection is open now
        outs = [memoryview(bytearray(MODEL.block_bytes)) for _ in keys]
        serving.freeze()
        try:
            # The data port (lookups go over it), gRPC, and a first data call's implicit
            # ServerInfo and Attach: each ends at the deadline, not at the client's 30 s.
            calls: dict[str, tuple[Client, Callable[[], object]]] = {
                "read_into": (kv, lambda: kv.read_into(fp, keys, outs)),  # on the open connection
                "lookup": (kv, lambda: kv.lookup(fp, keys)),
                "stats": (kv, kv.stats),
                "same-host get": (kv, lambda: kv.get(fp, keys)),
                "first lookup": (fresh, lambda: fresh.lookup(fp, keys)),
                "first resolve": (fresh, lambda: fresh.resolve(fp, keys)),
            }
            for name, (client, call) in calls.items():
                assert 0.3 <= _times_out(client, 0.3, call) < 0.3 + SLACK_S, name
            with kv.deadline(10.0):  # nested: the inner, earlier end wins
                assert _times_out(kv, 0.2, lambda: kv.lookup(fp, keys)) < 0.2 + SLACK_S
        finally:
            serving.thaw()
        # The timed-out data connection was dropped (its stream is mid-message); a new one works.
        with kv.deadline(5.0):
            assert kv.lookup(fp, keys) == 4
        assert fresh.lookup(fp, keys) == 4 and len(fresh.resolve(fp, keys).views) == 4


def test_the_data_port_connect_has_its_own_timeout(tmp_path: Path) -> None:
    # A listener that never answers the hello, like a stopped server's socket.
    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(path)
        silent.listen(4)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            DataPortClient("", 0, None, unix_path=path, connect_timeout_s=0.2)
        assert 0.2 <= time.monotonic() - start < 0.2 + SLACK_S


def test_a_restore_whose_caller_gave_up_leaves_no_pins() -> None:
    """A same-host restore from a slow tier that outlasts the caller's deadline (the connector
    gives up on a load slower than recomputing): the caller never learns its lease and cannot
    release it, so the server releases the pins itself. Without that, the promoted blocks stay
    pinned in dram (no eviction, no demotion) until the lease's TTL, 30 s here."""
    server = ServerProcess(
        {
            "dram.capacity_bytes": "8MiB",
            "dram.page_bytes": "1MiB",
            "dram.prefault": "false",
            "nvme.capacity_bytes": "64MiB",
            "nvme.throttle_bytes_per_s": "1000000",  # 64 blocks of 8 KiB: ~0.5 s to read back
        }
    )
    keys = block_keys(MODEL.fingerprint(), list(range(16 * 64)), 16)
    try:
        with connect(server.unix) as kv, connect(server.unix) as admin:
            fp = kv.register(MODEL)
            kv.write(fp, keys, [os.urandom(MODEL.block_bytes) for _ in keys])
            assert kv.read_into(fp, keys[:1], [memoryview(bytearray(MODEL.block_bytes))]) == 1  # attached
            deadline = time.monotonic() + 10
            while admin.stats()["leases"] and time.monotonic() < deadline:
                time.sleep(0.01)  # read_into's release goes out without waiting: let it land first
            assert admin.demote("dram") == len(keys)  # a block still pinned would stay in dram
            _times_out(kv, 0.1, lambda: kv.resolve(fp, keys, ttl_s=30.0))
            deadline = time.monotonic() + 10
            while "dram" not in admin.lookup_tiers(fp, keys).tiers and time.monotonic() < deadline:
                time.sleep(0.1)  # the server finishes the restore the caller gave up on
            assert admin.lookup_tiers(fp, keys).tiers.count("dram") == len(keys)  # promoted
            while admin.stats()["leases"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert admin.stats()["leases"] == 0
            assert admin.demote("dram") == len(keys)  # unpinned: they can leave dram again
    finally:
        server.stop()
