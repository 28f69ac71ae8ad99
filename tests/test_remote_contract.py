"""The remote tier contract (``tiers/remote.py``), run on every backend against the real thing:
a three-master Redis Cluster started on 127.0.0.1 for the module."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from benchmarks.redis_cluster import RedisClusterProcess
from kvstore.store.model import shared_key_name
from tiers import TierKey
from tiers.redis_cluster import RedisClusterTier
from tiers.remote import Backoff, RemoteBlock, RemoteConfig, RemoteTier, frame, unframe

FP = bytes(range(32))
OTHER_FP = bytes(reversed(range(32)))


def key(namespace: str, n: int, fingerprint: bytes = FP) -> TierKey:
    """A key shaped as the store's: namespace length, namespace, fingerprint, block key."""
    ns = namespace.encode()
    return TierKey(bytes([len(ns)]) + ns + fingerprint + n.to_bytes(32, "big"))


def block(k: TierKey, size: int = 4096) -> RemoteBlock:
    return RemoteBlock(k, FP, os.urandom(size))


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcess]:
    with RedisClusterProcess(masters=3) as c:
        yield c


@pytest.fixture
def make_tier(cluster: RedisClusterProcess) -> Iterator[Callable[..., RemoteTier]]:
    made: list[RemoteTier] = []
    prefix = f"t{time.monotonic_ns()}:"  # each test its own keys on the shared cluster

    def make(
        key_name: Callable[[bytes], bytes] | None = shared_key_name, password: str = "", **overrides: object
    ) -> RemoteTier:
        config = RemoteConfig(nodes=cluster.nodes, key_prefix=prefix, **overrides)  # type: ignore[arg-type]
        tier = RedisClusterTier(config, password, key_name=key_name)  # key_name: as the builder does
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def test_frames_round_trip_and_refuse_what_is_not_an_intact_block() -> None:
    k = key("a", 1)
    b = block(k)
    value = frame(b)
    assert unframe(value, k, FP) == memoryview(bytes(b.payload))  # a view's == compares its bytes
    assert unframe(value, k, OTHER_FP) is None  # another model's block is never served
    assert unframe(value, key("a", 2), FP) is None  # nor one read under another key
    assert unframe(value, key("b", 1), FP) is None  # or another namespace
    assert unframe(value[:-1], k, FP) is None  # torn
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert unframe(bytes(flipped), k, FP) is None  # checksum
    assert unframe(b"\xff\xff junk", k, FP) is None  # a header that lies about its size
    assert unframe(b"", k, FP) is None


def test_put_then_contains_and_get_many_in_order(make_tier: Callable[..., RemoteTier]) -> None:
    check_put_contains_get(make_tier())


def check_put_contains_get(tier: RemoteTier) -> None:
    """Put 40 blocks, ask for some in another order with a miss among them (every backend)."""
    blocks = [block(key("a", i), size=1000 + i) for i in range(40)]
    # put 40 blocks -> all stored; they spread over the three masters
    assert tier.put_many(blocks) == 40
    absent = key("a", 999)
    asked = [blocks[3].key, absent, blocks[39].key, blocks[0].key]
    assert tier.contains(asked) == [True, False, True, True]
    got = tier.get_many(asked, FP)
    assert got == [bytes(blocks[3].payload), None, bytes(blocks[39].payload), bytes(blocks[0].payload)]
    usage = tier.usage()
    assert (usage.gets, usage.hits, usage.puts, usage.failures) == (4, 3, 40, 0)


def check_an_expired_copy_is_a_counted_miss(tier: RemoteTier, namespace: str = "a") -> None:
    """Retention (every backend): a copy born before ``not_before_s``, or of unknown age (no
    birth in its header) while one is asked for, is a miss, counted and deleted there; a younger
    one is served with its birth time, which the header carried; a block already past its
    deadline is not stored; without a retention asked for, a copy of unknown age serves."""
    now = time.time()
    old = RemoteBlock(key(namespace, 901), FP, os.urandom(4096), born_s=now - 10)
    young = RemoteBlock(key(namespace, 902), FP, os.urandom(4096), born_s=now - 0.5)
    unknown = block(key(namespace, 903))  # born_s 0.0: written without a birth time
    late = RemoteBlock(key(namespace, 904), FP, os.urandom(4096), born_s=now - 10, expires_s=now - 1)
    assert tier.put_many([old, young, unknown, late]) == 3
    assert tier.contains([late.key]) == [False]
    born: list[float] = []
    assert tier.get_many([unknown.key], FP, 0.0, born) == [bytes(unknown.payload)] and born == [0.0]
    born = []
    got = tier.get_many([young.key, old.key, unknown.key], FP, now - 2.0, born)
    assert got == [bytes(young.payload), None, None]
    assert born == [young.born_s, 0.0, 0.0]
    assert tier.usage().expired == 2
    assert tier.contains([young.key, old.key, unknown.key]) == [True, False, False]  # deleted there


def test_a_copy_past_its_retention_is_a_counted_miss_and_deleted(
    make_tier: Callable[..., RemoteTier],
) -> None:
    check_an_expired_copy_is_a_counted_miss(make_tier())


def test_a_keys_expiry_is_the_retention_its_block_has_left(
    make_tier: Callable[..., RemoteTier], cluster: RedisClusterProcess
) -> None:
    """PX from the block's birth and deadline, not the put: born 100 s ago with 500 s left (a
    retention of 600 s), its key lives 500 s; ``ttl_s`` caps it further. The spans are long so
    that a slow machine cannot see a key expire before it is asked."""
    tier, capped = make_tier(), make_tier(ttl_s=60)
    now = time.time()
    b = RemoteBlock(key("a", 1), FP, os.urandom(1024), born_s=now - 100, expires_s=now + 500)
    c = RemoteBlock(key("a", 2), FP, os.urandom(1024), born_s=now - 100, expires_s=now + 500)
    assert tier.put_many([b]) == 1 and capped.put_many([c]) == 1
    raw = redis.cluster.RedisCluster(host="127.0.0.1", port=int(cluster.nodes[0].rsplit(":", 1)[1]))
    try:
        asked_s = time.time()
        pttl = raw.pttl(tier._key(b.key))  # type: ignore[attr-defined]
        answered_s = time.time()
        assert (now + 500 - answered_s) * 1000 - 1 <= pttl <= (now + 500 - asked_s) * 1000 + 1
        assert 0 < raw.pttl(capped._key(c.key)) <= 60_000  # type: ignore[attr-defined]
        # the fleet's invalidation marks: no expiry whatever the cap (a volatile-* policy keeps them)
        mark = RemoteBlock(key("a", 3), FP, b"mark", lasting=True)
        assert capped.put_many([mark]) == 1
        assert raw.pttl(capped._key(mark.key)) == -1  # type: ignore[attr-defined]
    finally:
        raw.close()


def test_a_corrupt_or_foreign_value_is_a_counted_miss_and_deleted(
    make_tier: Callable[..., RemoteTier], cluster: RedisClusterProcess
) -> None:
    tier = make_tier()
    good, bad = block(key("a", 1)), block(key("a", 2))
    assert tier.put_many([good, bad]) == 2
    raw = redis.cluster.RedisCluster(host="127.0.0.1", port=int(cluster.nodes[0].rsplit(":", 1)[1]))
    try:
        redis_key = tier._key(bad.key)  # type: ignore[attr-defined]
        value = bytearray(raw.get(redis_key))
        value[-5] ^= 0xFF  # a flipped bit on the medium
        raw.set(redis_key, bytes(value))
        assert tier.get_many([good.key, bad.key], FP) == [bytes(good.payload), None]
        assert tier.usage().checksum_failures == 1
        assert raw.exists(redis_key) == 0  # deleted, not served again
        # asked under another fingerprint: a miss, never the other model's bytes
        assert tier.get_many([good.key], OTHER_FP) == [None]
    finally:
        raw.close()


@pytest.mark.parametrize("moved_to", ["another-key", "another-namespace", "another-model"])
def test_a_value_copied_under_another_key_namespace_or_model_is_a_counted_miss_and_deleted(
    make_tier: Callable[..., RemoteTier], cluster: RedisClusterProcess, moved_to: str
) -> None:
    """Someone with access to the cluster copies a block's whole value (header and payload, as
    redis-py reads it) under another block's name: the header names the right fingerprint and
    its payload is intact, but the checksum is bound to the key it was stored under."""
    tier = make_tier()
    source = block(key("a", 1))
    target, fingerprint = {
        "another-key": (key("a", 2), FP),  # same tenant, same model, another prefix
        "another-namespace": (key("b", 1), FP),  # the same block key in another tenant
        "another-model": (key("a", 1, OTHER_FP), OTHER_FP),
    }[moved_to]
    assert tier.put_many([source]) == 1
    raw = redis.cluster.RedisCluster(host="127.0.0.1", port=int(cluster.nodes[0].rsplit(":", 1)[1]))
    try:
        name = tier._key(target)  # type: ignore[attr-defined]
        raw.set(name, raw.get(tier._key(source.key)))  # type: ignore[attr-defined]
        assert tier.get_many([target], fingerprint) == [None]  # a miss, not the other block
        assert tier.usage().checksum_failures == 1  # counted
        assert raw.exists(name) == 0  # deleted, not served again
        assert tier.get_many([source.key], FP) == [bytes(source.payload)]  # the original serves
    finally:
        raw.close()


@pytest.mark.parametrize("named", [True, False], ids=["shared-names", "raw-keys"])
def test_delete_many_and_delete_matching_reach_only_their_keys(
    make_tier: Callable[..., RemoteTier], named: bool
) -> None:
    tier = make_tier() if named else make_tier(key_name=None)
    # namespaces whose bytes are Redis glob characters must match only themselves
    a = [block(key("t*", i)) for i in range(30)]
    b = [block(key("t?", i)) for i in range(30)]
    c = [block(key("t", i)) for i in range(5)]
    assert tier.put_many(a + b + c) == 65
    assert tier.delete_many([a[0].key, a[0].key, key("t*", 500)]) == 1
    # invalidate namespace "t*" -> its 29 remaining blocks go, "t?" and "t" stay, and so does
    # "t*"'s key of the spared fingerprint (the fleet's invalidation marks)
    mark = block(key("t*", 1, OTHER_FP))
    assert tier.put_many([mark]) == 1
    prefix = bytes([2]) + b"t*"
    assert tier.delete_matching(prefix, spare=OTHER_FP) == 29
    assert tier.contains([x.key for x in a]) == [False] * 30
    assert tier.contains([x.key for x in b + c] + [mark.key]) == [True] * 36


def test_shared_names_keep_namespaces_apart_and_plain() -> None:
    a, ab = key("t/a", 1), key("t/a:b", 1)
    assert shared_key_name(a).startswith(b"t/a:") and shared_key_name(ab).startswith(b"t/a%3Ab:")
    assert not shared_key_name(ab).startswith(shared_key_name(a)[:4])  # no namespace begins another's
    assert shared_key_name(a)[4:] == FP + (1).to_bytes(32, "big")


def test_ttl_expires_remote_copies(make_tier: Callable[..., RemoteTier]) -> None:
    tier = make_tier(ttl_s=1.0)
    b = block(key("a", 1))
    assert tier.put_many([b]) == 1
    assert tier.contains([b.key]) == [True]
    deadline = time.monotonic() + 5
    while tier.contains([b.key]) == [True] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tier.contains([b.key]) == [False]


def test_a_tenant_user_cannot_read_another_tenants_keys(
    make_tier: Callable[..., RemoteTier], cluster: RedisClusterProcess
) -> None:
    admin = make_tier()
    prefix = admin.config.key_prefix  # type: ignore[attr-defined]
    theirs = block(key("t/tenant-b", 1))
    assert admin.put_many([theirs]) == 1
    pattern = prefix.encode() + b"t/tenant-a:*"  # the README's pattern: the namespace in plain text
    for node in cluster.nodes:  # ACLs are per node in a cluster
        host, _, port = node.rpartition(":")
        with redis.Redis(host=host, port=int(port)) as r:
            r.execute_command("ACL", "SETUSER", "tenant-a", "on", ">pw-a", b"~" + pattern, "+@all")
    mine = make_tier(username="tenant-a", password="pw-a")
    own = block(key("t/tenant-a", 1))
    assert mine.put_many([own]) == 1
    assert mine.get_many([own.key], FP) == [bytes(own.payload)]
    # tenant-b's block, asked by tenant-a's user: refused by the cluster, so a miss
    assert mine.get_many([theirs.key], FP) == [None]
    assert mine.put_many([block(key("t/tenant-b", 2))]) == 0
    # a namespace that merely begins like tenant-a's is not tenant-a's
    assert mine.put_many([block(key("t/tenant-ab", 1))]) == 0
    assert mine.usage().failures >= 1
    # what the fleet's invalidations ask before they read a namespace's marks: no failure counted
    ask = make_tier(username="tenant-a", password="pw-a")
    assert [ask.carries(ns) for ns in ("t/tenant-a", "t/tenant-b", "t/*")] == [True, False, False]
    assert ask.usage().failures == 0


def test_a_claim_stores_only_an_absent_key_and_keeps_the_first(make_tier: Callable[..., RemoteTier]) -> None:
    """The fleet's invalidation ledger takes its numbers by claims (``SET NX``): of two claims
    of one key the first wins and its value stays."""
    tier = make_tier()
    first, second = block(key("t/a", 1)), block(key("t/a", 1))
    assert tier.claim(first) is True
    assert tier.claim(second) is False
    assert [bytes(v) for v in tier.get_many([first.key], FP) if v is not None] == [first.payload]


def test_a_dead_cluster_means_misses_and_backoff_never_errors_or_stalls(
    make_tier: Callable[..., RemoteTier],
) -> None:
    with RedisClusterProcess(masters=3) as doomed:
        tier = RedisClusterTier(RemoteConfig(nodes=doomed.nodes, timeout_s=0.5, backoff_s=30.0))
        try:
            b = block(key("a", 1))
            assert tier.put_many([b]) == 1
            doomed.stop_all()
            started = time.monotonic()
            assert tier.get_many([b.key], FP) == [None]  # one bounded failure
            first_s = time.monotonic() - started
            started = time.monotonic()
            for _ in range(100):  # then backoff: nothing is tried, nothing waits
                assert tier.contains([b.key]) == [False]
                assert tier.put_many([b]) == 0
            assert tier.claim(b) is None  # failed, not taken: the ledger tries again later
            assert time.monotonic() - started < first_s + 0.5
            usage = tier.usage()
            assert usage.failures == 1
            assert usage.nodes_down == 1
        finally:
            tier.close()


def test_a_hung_cluster_costs_one_timeout_then_nothing_and_comes_back() -> None:
    with RedisClusterProcess(masters=3) as hung:
        tier = RedisClusterTier(RemoteConfig(nodes=hung.nodes, timeout_s=0.5, backoff_s=1.0))
        try:
            b = block(key("a", 1))
            assert tier.put_many([b]) == 1
            hung.freeze()  # SIGSTOP: sockets stay open, nothing answers
            started = time.monotonic()
            assert tier.get_many([b.key], FP) == [None]
            assert time.monotonic() - started < 3.0  # bounded by timeout_s, not hung with it
            started = time.monotonic()
            assert tier.contains([b.key]) == [False]  # in backoff: not even tried
            assert time.monotonic() - started < 0.1
            hung.thaw()
            time.sleep(1.2)  # the backoff passes
            deadline = time.monotonic() + 10
            while tier.get_many([b.key], FP) != [bytes(b.payload)]:
                assert time.monotonic() < deadline, tier.usage()
                time.sleep(0.3)
        finally:
            tier.close()


def test_a_cluster_that_is_down_at_start_is_not_an_error() -> None:
    tier = RedisClusterTier(RemoteConfig(nodes=("127.0.0.1:1",), timeout_s=0.2))
    try:
        assert tier.contains([key("a", 1)]) == [False]
        assert tier.get_many([key("a", 1)], FP) == [None]
        assert tier.put_many([block(key("a", 1))]) == 0
        assert tier.usage().failures == 1  # the rest were skipped by the backoff
    finally:
        tier.close()


def test_backoff_doubles_to_its_cap_and_resets_on_success() -> None:
    backoff = Backoff(base_s=0.05, max_s=0.2)
    assert backoff.ready()
    waits = []
    for _ in range(4):
        backoff.failed()
        assert not backoff.ready()
        started = time.monotonic()
        while not backoff.ready():
            time.sleep(0.005)
        waits.append(time.monotonic() - started)
    assert waits[0] < waits[1] < waits[2]  # 0.05, 0.1, 0.2
    assert waits[3] < 0.3  # capped at 0.2
    backoff.failed()
    backoff.succeeded()
    assert backoff.ready()


def test_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        RedisClusterTier(RemoteConfig(nodes=()))
    with pytest.raises(ValueError, match="HOST:PORT"):
        RemoteConfig(nodes=("localhost",))
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteConfig(nodes=("127.0.0.1:7000",), timeout_s=0)
