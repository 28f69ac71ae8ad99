"""The ``kvstore`` remote tier (``kvstore/remote/nodes.py``) over three real kvstore servers in
the shared role, and the rendezvous placement under it."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvstore.client import connect
from kvstore.keys import BlockKey, Fingerprint
from kvstore.remote.nodes import KvStoreNodesTier
from kvstore.remote.rendezvous import Rendezvous
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from kvstore.store import Scope, tier_key
from tests.service_fixtures import settings_for
from tiers import TierKey
from tiers.remote import RemoteBlock, RemoteConfig

FP = Fingerprint(bytes(range(32)))
OTHER_FP = Fingerprint(bytes(reversed(range(32))))
TOKENS = {"t/tenant-a": "tok-a", "t/tenant-b": "tok-b", "s/public": "tok-a"}


def key(namespace: str, n: int, fingerprint: Fingerprint = FP) -> TierKey:
    return tier_key(Scope(namespace, fingerprint), BlockKey(n.to_bytes(32, "big")))


def block(k: TierKey, fingerprint: Fingerprint = FP) -> RemoteBlock:
    return RemoteBlock(k, fingerprint, os.urandom(8192))


class Node:
    def __init__(self) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="kvn-", dir="/tmp")
        self.server: RunningServer | None = start_server(
            load_settings(env={}, overrides=settings_for(self.data_dir))
        )
        assert self.server.tcp_address is not None
        self.address = self.server.tcp_address

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    made = [Node() for _ in range(3)]
    yield made
    for node in made:
        node.close()


@pytest.fixture
def tier(nodes: list[Node]) -> Iterator[KvStoreNodesTier]:
    t = KvStoreNodesTier(RemoteConfig(nodes=tuple(n.address for n in nodes), tokens=TOKENS))
    yield t
    t.close()


def test_rendezvous_moves_only_the_joining_or_leaving_nodes_share() -> None:
    keys = [i.to_bytes(32, "big") for i in range(20_000)]
    four = Rendezvous([f"10.0.0.{i}:7070" for i in range(4)])
    five = Rendezvous([f"10.0.0.{i}:7070" for i in range(5)])
    before = [four.nodes[four.owner(k)] for k in keys]
    after = [five.nodes[five.owner(k)] for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    # a join moves keys only to the new node, about 1/5 of them
    assert all(a == "10.0.0.4:7070" for _, a in moved)
    assert len(moved) / len(keys) <= 1.2 / 5
    # a leave moves only the leaver's keys, each to its runner-up
    three = Rendezvous([n for n in four.nodes if n != "10.0.0.2:7070"])
    for k, b in zip(keys, before, strict=True):
        now = three.nodes[three.owner(k)]
        if b != "10.0.0.2:7070":
            assert now == b
        else:
            assert now == four.nodes[four.owners(k, 2)[1]]
    # and the load is even: every node within 10% of its share
    counts = [before.count(n) for n in four.nodes]
    assert max(counts) / min(counts) < 1.1


def test_blocks_spread_over_the_nodes_and_come_back(tier: KvStoreNodesTier, nodes: list[Node]) -> None:
    blocks = [block(key("t/tenant-a", i)) for i in range(30)]
    assert tier.put_many(blocks) == 30
    held = []
    for node in nodes:  # each node holds its rendezvous share, under tenant-a's own namespace
        with connect(node.address, token="tok-a") as kv:
            held.append(kv.stats()["blocks"])
    assert sum(held) >= 30 and all(h > 0 for h in held)
    asked = [blocks[5].key, key("t/tenant-a", 999), blocks[0].key]
    assert tier.contains(asked) == [True, False, True]
    got = tier.get_many([b.key for b in blocks], FP)
    assert got == [bytes(b.payload) for b in blocks]
    assert tier.get_many([blocks[0].key], OTHER_FP) == [None]  # another model's: never served
    usage = tier.usage()
    assert (usage.puts, usage.failures, usage.nodes, usage.nodes_down) == (30, 0, 3, 0)


def test_tenants_stay_apart_on_the_shared_nodes(nodes: list[Node]) -> None:
    addresses = tuple(n.address for n in nodes)
    a = KvStoreNodesTier(RemoteConfig(nodes=addresses, tokens={"t/tenant-a": "tok-a"}))
    # tenant-b's sidecar, whose configuration maps tenant-a's namespace to tenant-b's token:
    # the nodes still file its blocks under tenant-b, so it cannot reach tenant-a's
    b = KvStoreNodesTier(RemoteConfig(nodes=addresses, tokens={"t/tenant-a": "tok-b"}))
    try:
        secret = block(key("t/tenant-a", 4242))
        assert a.put_many([secret]) == 1
        assert b.contains([secret.key]) == [False]
        assert b.get_many([secret.key], FP) == [None]
        # a namespace with no token is never sent: not pooled by accident
        assert a.put_many([block(key("t/tenant-c", 1))]) == 0
        assert a.unmapped == 1
    finally:
        a.close()
        b.close()


def test_delete_and_invalidate_reach_the_nodes(tier: KvStoreNodesTier) -> None:
    mine = [block(key("t/tenant-b", i)) for i in range(12)]
    other_model = [block(key("t/tenant-b", i, OTHER_FP), OTHER_FP) for i in range(6)]
    assert tier.put_many(mine + other_model) == 18
    assert tier.delete_many([mine[0].key, mine[1].key]) == 2
    assert tier.contains([mine[0].key, mine[2].key]) == [False, True]
    # invalidate one fingerprint of tenant-b: only its blocks go
    ns = b"t/tenant-b"
    assert tier.delete_matching(bytes([len(ns)]) + ns + FP) >= 10
    assert tier.contains([b.key for b in mine]) == [False] * 12
    assert tier.contains([b.key for b in other_model]) == [True] * 6
    assert tier.delete_matching(bytes([len(ns)]) + ns) >= 6
    assert tier.contains([b.key for b in other_model]) == [False] * 6


def test_a_dead_node_means_misses_for_its_share_and_a_backoff() -> None:
    trio = [Node() for _ in range(3)]
    tier = KvStoreNodesTier(
        RemoteConfig(nodes=tuple(n.address for n in trio), tokens=TOKENS, timeout_s=0.5, backoff_s=30.0)
    )
    try:
        blocks = [block(key("t/tenant-a", i)) for i in range(30)]
        assert tier.put_many(blocks) == 30
        ring = Rendezvous(tier.config.nodes)
        dead = 1
        trio[dead].stop()
        started = time.monotonic()
        got = tier.get_many([b.key for b in blocks], FP)
        first_s = time.monotonic() - started
        for b, payload in zip(blocks, got, strict=True):
            if ring.owner(b.key) == dead:
                assert payload is None
            else:
                assert payload == bytes(b.payload)
        assert first_s < 5.0  # bounded by the timeout, not hung
        started = time.monotonic()
        for _ in range(20):  # in backoff: the dead node is not tried again
            present = tier.contains([b.key for b in blocks])
            assert sum(present) == sum(ring.owner(b.key) != dead for b in blocks)
        assert time.monotonic() - started < 2.0
        usage = tier.usage()
        assert usage.failures == 1 and usage.nodes_down == 1
    finally:
        tier.close()
        for node in trio:
            node.close()


def test_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        KvStoreNodesTier(RemoteConfig(nodes=()))
    with pytest.raises(ValueError, match="keyed by namespace"):
        RemoteConfig(nodes=("127.0.0.1:7070",), tokens={"tenant-a": "tok-a"})
    with pytest.raises(ValueError, match="distinct"):
        Rendezvous(["a", "a"])
