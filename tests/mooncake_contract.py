"""The remote tier contract on the ``mooncake`` backend, against a real Mooncake Store.

Not collected on its own (its name does not start with ``test_``): Mooncake's transfer engine
listens on every interface, so ``tests/test_remote_mooncake.py`` runs this file with pytest in a
network namespace of its own, where the only interface is loopback, and fails if any test here
fails."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import pytest

from benchmarks.mooncake_store import MooncakeStoreProcess, in_private_netns
from kvstore.store.model import shared_key_name
from tests.test_remote_contract import (
    FP,
    OTHER_FP,
    block,
    check_an_expired_copy_is_a_counted_miss,
    check_put_contains_get,
    key,
)
from tiers.mooncake import MooncakeTier
from tiers.remote import RemoteConfig

pytestmark = pytest.mark.skipif(not in_private_netns(), reason="run by tests/test_remote_mooncake.py")


@pytest.fixture(scope="module")
def store() -> Iterator[MooncakeStoreProcess]:
    with MooncakeStoreProcess(segment_mib=128) as s:
        yield s


def config(store: MooncakeStoreProcess, **overrides: object) -> RemoteConfig:
    overrides.setdefault("key_prefix", f"t{time.monotonic_ns()}:")  # each test its own keys
    return RemoteConfig(nodes=(store.master,), metadata_server=store.metadata_url, **overrides)  # type: ignore[arg-type]


@pytest.fixture
def make_tier(store: MooncakeStoreProcess) -> Iterator[Callable[..., MooncakeTier]]:
    made: list[MooncakeTier] = []

    def make(
        key_name: Callable[[bytes], bytes] | None = shared_key_name, **overrides: object
    ) -> MooncakeTier:
        tier = MooncakeTier(config(store, **overrides), key_name=key_name)  # key_name: as the builder does
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def test_put_then_contains_and_get_many_in_order(make_tier: Callable[..., MooncakeTier]) -> None:
    check_put_contains_get(make_tier())


def test_a_copy_past_its_retention_is_a_counted_miss_and_deleted(
    make_tier: Callable[..., MooncakeTier],
) -> None:
    """Mooncake keeps no expiry of its own: the read that meets an expired copy deletes it."""
    check_an_expired_copy_is_a_counted_miss(make_tier())


def test_a_corrupt_or_foreign_value_is_a_counted_miss_and_deleted(
    make_tier: Callable[..., MooncakeTier], store: MooncakeStoreProcess
) -> None:
    tier = make_tier()
    good, bad = block(key("a", 1)), block(key("a", 2))
    assert tier.put_many([good, bad]) == 2
    with store.client() as raw:
        name = tier._key(bad.key)
        value = bytearray(raw.get(name))
        value[-5] ^= 0xFF  # a flipped bit on the medium
        assert raw.upsert(name, bytes(value)) == 0
        assert tier.get_many([good.key, bad.key], FP) == [bytes(good.payload), None]
        assert tier.usage().checksum_failures == 1
        assert raw.is_exist(name) == 0  # deleted, not served again
        # asked under another fingerprint: a miss, never the other model's bytes
        assert tier.get_many([good.key], OTHER_FP) == [None]


@pytest.mark.parametrize("named", [True, False], ids=["shared-names", "raw-keys"])
def test_delete_many_and_delete_matching_reach_only_their_keys(
    make_tier: Callable[..., MooncakeTier], named: bool
) -> None:
    tier = make_tier() if named else make_tier(key_name=None)
    # namespaces whose bytes are regular-expression characters must match only themselves
    a = [block(key("t.*", i)) for i in range(30)]
    b = [block(key("t.?", i)) for i in range(30)]
    c = [block(key("t.", i)) for i in range(5)]
    assert tier.put_many(a + b + c) == 65
    assert tier.delete_many([a[0].key, key("t.*", 500)]) == 1
    # invalidate namespace "t.*": its 29 remaining blocks go, "t.?" and "t." stay, and (named
    # keys) so does "t.*"'s key of the spared fingerprint (the fleet's invalidation marks)
    mark = block(key("t.*", 1, OTHER_FP))
    assert tier.put_many([mark]) == 1
    assert tier.delete_matching(bytes([3]) + b"t.*", spare=OTHER_FP) == 29 + (not named)
    assert tier.contains([x.key for x in a]) == [False] * 30
    assert tier.contains([x.key for x in b + c] + [mark.key]) == [True] * 35 + [named]
    # one fingerprint of a namespace: a prefix with binary bytes in it
    assert tier.delete_matching(bytes([3]) + b"t.?" + FP) == 30
    assert tier.contains([x.key for x in c]) == [True] * 5


def test_a_hung_store_costs_one_timeout_then_nothing_and_comes_back(store: MooncakeStoreProcess) -> None:
    tier = MooncakeTier(config(store, timeout_s=0.5, backoff_s=1.0))
    try:
        b = block(key("a", 1))
        assert tier.put_many([b]) == 1
        store.freeze()  # SIGSTOP: connections stay open, nothing answers
        try:
            started = time.monotonic()
            assert tier.get_many([b.key], FP) == [None]
            assert time.monotonic() - started < 1.5  # bounded by timeout_s, not hung with it
            started = time.monotonic()
            assert tier.contains([b.key]) == [False]  # in backoff: not even tried
            assert tier.put_many([b]) == 0
            assert time.monotonic() - started < 0.1
        finally:
            store.thaw()
        deadline = time.monotonic() + 15
        while tier.get_many([b.key], FP) != [bytes(b.payload)]:
            assert time.monotonic() < deadline, tier.usage()
            time.sleep(0.3)
        assert tier.usage().failures >= 1
    finally:
        tier.close()


def test_a_dead_store_means_misses_and_backoff_never_errors_or_stalls() -> None:
    with MooncakeStoreProcess(segment_mib=64) as doomed:
        tier = MooncakeTier(config(doomed, timeout_s=0.5, backoff_s=30.0))
        try:
            b = block(key("a", 1))
            assert tier.put_many([b]) == 1
            doomed.stop_all()
            started = time.monotonic()
            assert tier.contains([b.key]) == [False]  # the store cannot say: a counted failure
            assert tier.get_many([b.key], FP) == [None]
            for _ in range(100):  # then backoff: nothing is tried, nothing waits
                assert tier.contains([b.key]) == [False]
                assert tier.put_many([b]) == 0
            assert time.monotonic() - started < 1.5
            usage = tier.usage()
            assert usage.failures == 1 and usage.nodes_down == 1
        finally:
            tier.close()


def test_a_store_that_is_down_at_start_is_not_an_error() -> None:
    tier = MooncakeTier(
        RemoteConfig(nodes=("127.0.0.1:1",), metadata_server="http://127.0.0.1:1/metadata", timeout_s=2.0)
    )
    try:
        started = time.monotonic()
        assert tier.contains([key("a", 1)]) == [False]
        assert tier.get_many([key("a", 1)], FP) == [None]
        assert tier.put_many([block(key("a", 1))]) == 0
        assert time.monotonic() - started < 3.0
        assert tier.usage().failures == 1  # the rest were skipped by the backoff
    finally:
        tier.close()


def test_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        RemoteConfig(nodes=("nowhere",), metadata_server="http://127.0.0.1:1/metadata")
    with pytest.raises(ValueError, match="metadata_server"):
        MooncakeTier(RemoteConfig(nodes=("127.0.0.1:1",), metadata_server=""))
    with pytest.raises(ValueError, match="needs one"):
        MooncakeTier(RemoteConfig(nodes=("127.0.0.1:1", "127.0.0.1:2"), metadata_server="http://x/metadata"))
    with pytest.raises(ValueError, match="tcp or rdma"):
        RemoteConfig(nodes=("127.0.0.1:1",), metadata_server="http://x/metadata", protocol="udp")


def test_a_prefix_stored_through_one_sidecar_is_restored_through_the_other(
    store: MooncakeStoreProcess,
) -> None:
    """Two sidecars (real kvstore servers, each its own data folder and arena) over one Mooncake
    Store: what a's client stores, b's client finds as tier ``remote`` and restores, byte for byte;
    the store holds it under the sidecar's namespace in plain text."""
    from tests.test_fleet_sidecars import check_restored_through_the_other, sidecars

    prefix = f"f{time.monotonic_ns()}:"
    remote = {"backend": "mooncake", "nodes": store.master, "metadata_server": store.metadata_url}
    with contextlib.contextmanager(sidecars)(**remote, key_prefix=prefix) as (a, b):
        check_restored_through_the_other(a, b)
        with store.client() as raw:
            # the sidecars' Unix callers are tenant "local": their blocks are named under t/local
            assert raw.remove_by_regex("^" + prefix + "t/local:", True) == 6
