"""Fairness between tenants (issue 41, item 4): a tenant with many data-port connections slows
itself, not the others. A real ``kvstore serve``; the noisy tenant holds 250 connections over
TCP (under the 256-per-tenant cap), each keeping two 500-key lookups in flight, from processes
of its own (``benchmarks.fairness``); meanwhile the quiet tenant looks up 64 keys over TCP, the
Unix data socket (the default tenant there) and gRPC, one call at a time.

Before the loop shared its turns per tenant, kept a pipelined request's rest to itself and the
request threads took places per tenant, the quiet tenant's lookup took, p50: over TCP 0.5-1.4 s,
over gRPC 5.0-8.7 ms (idle 0.1-0.2, 0.7-0.9 ms); over the Unix socket p90 4.1-8.3 ms (idle
0.3). The places' own test below runs without a server.

The data port's threads are its workers', not one per connection (issue 43, item 3): the same
server with 250 connections open from one tenant runs about as many threads as with none, each
of those connections is served (a get each, all sent at once: requests for the workers, not the
loop), and another tenant's lookups and gets complete meanwhile (a thread per connection: 250
more threads). And the workers' own bound: one tenant's requests asleep on a disk leave workers
to the others."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.fairness import (
    FINGERPRINT,
    NOISY_KEYS,
    NOISY_TOKEN,
    QUIET_KEYS,
    QUIET_TOKEN,
    data_port_of,
    fairness_settings,
    flood,
    percentile,
    quiet_latencies,
    store_blocks,
    stored_keys,
)
from benchmarks.server_process import ServerProcess
from kvstore import wire
from kvstore.asleep import asleep
from kvstore.client import connect
from kvstore.errors import ResourceExhausted
from kvstore.server.fairness import SERVED_AT_ONCE_PER_TENANT, TenantShares
from kvstore.server.workers import WORKERS_PER_TENANT, Workers
from kvstore.status import Status
from kvstore.stream import Stream
from tests.test_store_arena import A, _gated_store, chain, data

CALLS = 100
# (percentile, bound): each bound above what this code gives on two busy CPUs (TCP: 20x its idle
# 0.1 ms; a CI run's Unix p90 was 2.54 ms once) and below what the old code gave: p50 over TCP
# 0.5-1.4 s, over gRPC 5.0-8.7 ms; over the Unix socket, whose p50 the old code sometimes kept
# (0.2 ms), p90 4.1-8.3 ms.
BOUNDS_MS = {"TCP": (0.5, 20.0), "Unix": (0.9, 4.0), "gRPC": (0.5, 4.5)}
CONNECTIONS = 250
GET_KEYS = 8  # each noisy connection's get: 8 blocks of 4 KiB
# Threads the 250 connections may add: hello threads still ending, say. The workers are there
# before any connection (WORKERS per listener).
MORE_THREADS = 32


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    served = ServerProcess(
        {"dram.capacity_bytes": "64MiB", "nvme.capacity_bytes": "256MiB", **fairness_settings()}, tcp=True
    )
    try:
        store_blocks(served)
        yield served
    finally:
        served.stop()


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line in /proc/<pid>/status")


def noisy_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(wire.hello(NOISY_TOKEN.encode(), b""))
    assert wire.read_status(sock)[0] == Status.OK
    return sock


def read_get(sock: socket.socket) -> int:
    """A get's answer: how many blocks came."""
    stream = Stream(sock, 30.0)
    assert wire.read_stream_status(stream)[0] == Status.OK
    blocks = 0
    while (head := wire.read_block_head(stream.read)) is not None:
        stream.read(head[0])
        blocks += 1
    code, message = wire.read_stream_status(stream)
    assert code == Status.OK, message
    return blocks


def test_250_connections_of_one_tenant_take_no_thread_each_and_hold_up_no_other(
    server: ServerProcess,
) -> None:
    port = data_port_of(server)
    before = threads_of(server.pid)
    noisy = [noisy_connection(port) for _ in range(CONNECTIONS)]
    try:
        with connect(server.tcp, token=NOISY_TOKEN) as kv:
            assert kv.stats()["tenant_connections"] == {"noisy": CONNECTIONS}  # its own only
        open_threads = threads_of(server.pid)
        get = wire.keys_request(wire.OP_GET, FINGERPRINT, stored_keys(NOISY_KEYS, "noisy")[:GET_KEYS])
        for sock in noisy:  # all at once: 250 requests for the workers
            sock.sendall(get)
        busy_threads = threads_of(server.pid)
        quiet = stored_keys(QUIET_KEYS, "quiet")
        with connect(server.tcp, token=QUIET_TOKEN) as kv:
            for _ in range(5):
                assert kv.lookup(FINGERPRINT, quiet) == QUIET_KEYS
                assert len(kv.get(FINGERPRINT, quiet[:4])) == 4
        assert [read_get(sock) for sock in noisy] == [GET_KEYS] * CONNECTIONS
    finally:
        for sock in noisy:
            sock.close()
    grown = max(open_threads, busy_threads) - before
    assert grown <= MORE_THREADS, (
        f"{CONNECTIONS} connections took {grown} more threads ({before} before, "
        f"{open_threads} open, {busy_threads} serving)"
    )


def test_a_tenant_asleep_on_the_disk_leaves_the_others_workers() -> None:
    """A worker asleep on a disk lends its place, so its tenant's next request goes (restores
    behind paced saves); but twenty such saves of one tenant do not put every worker to sleep:
    another tenant's request is served while they all sleep."""
    shares = TenantShares(SERVED_AT_ONCE_PER_TENANT)
    disk = threading.Event()
    asleep_now: list[str] = []
    served: list[str] = []
    lock = threading.Lock()

    def serve(item: str) -> None:
        if item.startswith("save"):
            with lock:
                asleep_now.append(item)
            with asleep():
                disk.wait(10)
        with lock:
            served.append(item)

    pool: Workers[str] = Workers(shares, serve, lambda item: None, timeout_s=10.0)
    try:
        for i in range(20):
            pool.submit("beta", f"save-{i}")
        deadline = time.monotonic() + 5
        while len(asleep_now) < WORKERS_PER_TENANT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(asleep_now) > SERVED_AT_ONCE_PER_TENANT  # lent places served beta's next
        pool.submit("alpha", "lookup")
        deadline = time.monotonic() + 5
        while "lookup" not in served and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served == ["lookup"], f"alpha waited for beta's {len(asleep_now)} sleeping saves"
        assert len(asleep_now) == WORKERS_PER_TENANT
        disk.set()
        deadline = time.monotonic() + 10
        while len(served) < 21 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(served) == 21  # every save went on once the disk did
    finally:
        disk.set()
        pool.close(time.monotonic() + 10)


def test_a_tenant_flooding_the_data_port_slows_itself_not_the_others(server: ServerProcess) -> None:
    with flood(data_port_of(server), duration_s=60.0) as noisy:  # ends by itself at the latest
        noisy.wait_flowing()  # every connection open and answered: the flood is served too
        latencies = quiet_latencies(server, calls=CALLS, phase_s=5.0)
    summary = {
        transport: f"p50 {percentile(ms, 0.5):.2f} p90 {percentile(ms, 0.9):.2f} ms of {len(ms)} calls"
        for transport, ms in latencies.items()
    }
    too_slow = {
        t: summary[t] for t, (at, bound) in BOUNDS_MS.items() if percentile(latencies[t], at) >= bound
    }
    assert not too_slow, f"the quiet tenant's lookups waited for the noisy one: {too_slow}"


def test_a_tenants_places_go_to_its_waiters_in_turn_and_hold_up_no_other_tenant() -> None:
    shares = TenantShares(per_tenant=1)
    served: list[int] = []

    def serve(i: int) -> None:
        with shares.place("beta", 10.0):
            served.append(i)

    with shares.place("beta", 1.0):
        with shares.place("alpha", 0.01):  # beta's full share is beta's alone
            pass
        waiters = []
        for i in range(3):  # each in line before the next starts
            waiters.append(threading.Thread(target=serve, args=(i,)))
            waiters[-1].start()
            deadline = time.monotonic() + 5
            while shares.waiting("beta") < i + 1 and time.monotonic() < deadline:
                time.sleep(0.001)
        assert served == [] and shares.waiting("beta") == 3
    for thread in waiters:
        thread.join(5)
    assert served == [0, 1, 2]  # in line, the place handed from one to the next
    # past its wait: refused, and out of the line
    with shares.place("beta", 1.0), pytest.raises(ResourceExhausted), shares.place("beta", 0.05):
        pass
    assert shares.waiting("beta") == 0
    with shares.place("beta", 0.01):  # the place came back: free again at once
        pass


def test_a_request_asleep_on_the_disk_lends_its_place_to_its_tenants_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar's engine is one tenant with two places: two saves paced by a disk that is
    behind (up to 2 s each) held both, and the engine's restore waited behind them. Asleep on
    the disk, each lends its place; once the disk goes on, each takes one again in line."""
    shares = TenantShares(per_tenant=2)
    s, gate = _gated_store(tmp_path, monkeypatch)
    try:
        s.put(A, chain(4, salt="1"), [data(k) for k in chain(4, salt="1")])  # the arena is full
        s.put(A, chain(2, salt="2"), [data(k) for k in chain(2, salt="2")])  # the disk's queue too

        def save(salt: str) -> None:
            with shares.place("local", 30.0):
                s.put(A, chain(1, salt=salt), [data(chain(1, salt=salt)[0])])

        saves = [threading.Thread(target=save, args=(salt,)) for salt in ("3", "4")]
        for thread in saves:
            thread.start()
        time.sleep(0.3)
        assert all(thread.is_alive() for thread in saves)  # both asleep on the disk
        started = time.monotonic()
        with shares.place("local", 1.0):  # the restore: not behind the saves
            assert s.lookup(A, chain(2, salt="2")).hit_blocks == 2
        assert time.monotonic() - started < 0.5
        gate.set()
        for thread in saves:
            thread.join(10)
            assert not thread.is_alive()
        assert shares.waiting("local") == 0
        with shares.place("local", 0.01), shares.place("local", 0.01):  # both places came back
            pass
    finally:
        gate.set()
        s.close()
