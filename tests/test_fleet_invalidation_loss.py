"""A lost invalidation on real ``kvstore serve`` processes over a shared kvstore node, then a
Redis Cluster (the fleet of ``tests/test_fleet_invalidation.py``): the sidecar that finds the
loss refuses the remote's copies born before it too, not only its own local ones, and goes on
refusing them after a restart (``kvstore.store.invalidations``, ``FleetInvalidations._settle``)."""

from __future__ import annotations

import struct
import time

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import BlockKey, Fingerprint
from kvstore.store.invalidations import mark_key
from kvstore.store.ledger import entry_key, head_key, read_values
from kvstore.store.model import Scope, tier_key
from tests.service_fixtures import blocks_for, chain
from tests.test_fleet_invalidation import (
    _registered,
    _remote_of,
    _store_and_share,
    cluster,
    fleet,
    shared_node,
)
from tiers.remote import RemoteBlock, RemoteTier

__all__ = ["cluster", "fleet", "shared_node"]  # the fixtures, shared with that module's tests


def _plant(remote: RemoteTier, fp: Fingerprint, name: str, born_s: float) -> list[BlockKey]:
    """A chain of tenant "local" put straight into the remote tier, born at ``born_s``."""
    keys = chain(4, name)
    scope = Scope("t/local", fp)
    blocks = [
        RemoteBlock(tier_key(scope, key), fp, payload, born_s)
        for key, payload in zip(keys, blocks_for(keys), strict=True)
    ]
    assert remote.put_many(blocks) == 4
    return keys


def _restored(sidecar: ServerProcess, fp: Fingerprint, keys: list[BlockKey]) -> int:
    outs = [memoryview(bytearray(len(b))) for b in blocks_for(keys)]
    with connect(sidecar.unix) as kv:
        return kv.read_into(fp, keys, outs)


@pytest.mark.parametrize("evicted", ["entry", "head"])
def test_a_sidecar_that_finds_a_lost_mark_refuses_the_remotes_copies_born_before_it(
    fleet: list[ServerProcess], evicted: str
) -> None:
    """C down while A invalidates a model; a chain of it C never held is put into the remote,
    born before the invalidation (a lagging sidecar's late write: C's drop deletes the remote
    keys of the blocks it held, not these), and the mark and its ledger entry, or the ledger's
    head, go as an eviction would take them. C, started again, restores none of that chain
    through the remote; a copy born after C found the loss is restored (the planting works).
    Another such chain, and C restarted again: still none (the refused copies were deleted)."""
    a, _, c = fleet
    fp = _registered([a, c])
    dead = _store_and_share(a, [c], fp, f"loss-remote-{evicted}")
    c.proc.terminate()
    assert c.proc.wait(30) == 0
    with connect(a.unix) as kv:
        assert kv.invalidate(fp) >= 4
    born = time.time() - 5.0  # before the invalidation
    remote = _remote_of(a)
    try:
        late = _plant(remote, fp, f"loss-late-{evicted}", born)
        head = read_values(remote, [head_key("t/local")])[head_key("t/local")]
        (number,) = struct.unpack("<Q", head)
        record = entry_key("t/local", number) if evicted == "entry" else head_key("t/local")
        assert remote.delete_many([mark_key("t/local", fp), record]) == 2
        c.start()
        with connect(c.unix) as kv:
            assert kv.stats()["counters"]["invalidation_ledger_losses"] >= 1
            assert kv.lookup(fp, dead) == 0
        assert _restored(c, fp, late) == 0
        fresh = _plant(remote, fp, f"loss-fresh-{evicted}", time.time())
        assert _restored(c, fp, fresh) == 4  # kept in C's dram: its nvme at the restart
        later = _plant(remote, fp, f"loss-later-{evicted}", born)
        c.proc.terminate()
        assert c.proc.wait(30) == 0
        c.start()
        assert _restored(c, fp, later) == 0
        with connect(c.unix) as kv:
            assert kv.lookup(fp, fresh) == 4
    finally:
        remote.close()
