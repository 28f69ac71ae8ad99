"""Fairness between tenants (issue 41, item 4): a tenant with many data-port connections slows
itself, not the others. A real ``kvstore serve``; the noisy tenant holds 250 connections over
TCP (under the 256-per-tenant cap), each keeping two 500-key lookups in flight, from processes
of its own (``benchmarks.fairness``); meanwhile the quiet tenant looks up 64 keys over TCP, the
Unix data socket (the default tenant there) and gRPC, one call at a time.

Before the loop shared its turns per tenant, kept a pipelined request's rest to itself and the
request threads took places per tenant, the quiet tenant's lookup took, p50: over TCP 0.5-1.4 s,
over gRPC 5.0-8.7 ms (idle 0.1-0.2, 0.7-0.9 ms); over the Unix socket p90 4.1-8.3 ms (idle
0.3). The places' own test below runs without a server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.fairness import (
    data_port_of,
    fairness_settings,
    flood,
    percentile,
    quiet_latencies,
    store_blocks,
)
from benchmarks.server_process import ServerProcess
from kvstore.errors import ResourceExhausted
from kvstore.server.fairness import TenantShares
from tests.test_store_arena import A, _gated_store, chain, data

CALLS = 100
# (percentile, bound): each bound above what this code gives on two busy CPUs (TCP: 20x its idle
# 0.1 ms; a CI run's Unix p90 was 2.54 ms once) and below what the old code gave: p50 over TCP
# 0.5-1.4 s, over gRPC 5.0-8.7 ms; over the Unix socket, whose p50 the old code sometimes kept
# (0.2 ms), p90 4.1-8.3 ms.
BOUNDS_MS = {"TCP": (0.5, 20.0), "Unix": (0.9, 4.0), "gRPC": (0.5, 4.5)}


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
