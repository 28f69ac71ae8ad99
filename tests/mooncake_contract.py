"""The remote tier contract on the ``mooncake`` backend, against a real Mooncake Store, and the
fleet's governance over it: real ``kvstore serve`` sidecars sharing the store (invalidation
reaching a sidecar that was down, a lost mark, shredding reaching the store's copies).

Not collected on its own (its name does not start with ``test_``): Mooncake's transfer engine
listens on every interface, so ``tests/test_remote_mooncake.py`` runs this file with pytest in a
network namespace of its own, where the only interface is loopback, and fails if any test here
fails."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.mooncake_store import MooncakeStoreProcess, in_private_netns
from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import BlockKey
from kvstore.server.audit import read_audit
from kvstore.server.shredding import KEY_CHECK_S
from kvstore.store.model import Scope, shared_key_name, tier_key
from tests import test_fleet_invalidation as fleet_checks
from tests.service_fixtures import BLOCK, MODEL, chain, process_settings
from tests.test_fleet_encryption import PATTERN, patterned
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
from tiers.sealed_remote import SEALED_OVERHEAD_BYTES

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


def test_first_calls_that_come_together_set_one_client_up_and_none_fails(
    make_tier: Callable[..., MooncakeTier],
) -> None:
    """A sidecar's first calls arrive together (write-behind, lookups, the invalidation poll):
    one sets the client up, the others wait for it. Two setups at once in one process left the
    calls on both past timeout_s, and a sidecar's first blocks dropped (5 tiers of 10 here)."""
    for _ in range(8):
        tier = make_tier(timeout_s=2.0)
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(tier.contains, [[key("a", 1)]] * 3)) == [[False]] * 3
        assert tier.usage().failures == 0


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


# ----------------------------------------------------------------- the fleet, on real processes


@pytest.fixture(scope="module")
def fleet(store: MooncakeStoreProcess) -> Iterator[list[ServerProcess]]:
    """Three ``kvstore serve`` processes over the store (each test its own chains), polling the
    fleet's invalidation marks every 0.5 s: the fleet ``tests/test_fleet_invalidation.py``
    attacks over a kvstore node and a Redis Cluster."""
    remote = {
        "remote.backend": "mooncake",
        "remote.nodes": store.master,
        "remote.metadata_server": store.metadata_url,
        "remote.key_prefix": f"i{time.monotonic_ns()}:",
        "remote.invalidation_poll_s": "0.5",
    }
    sidecars: list[ServerProcess] = []
    try:
        for _ in range(3):
            sidecars.append(ServerProcess(process_settings(**remote)))
        yield sidecars
    finally:
        for sidecar in sidecars:
            sidecar.stop()


def test_an_invalidation_reaches_a_live_sidecar_and_one_that_was_down(
    fleet: list[ServerProcess], make_tier: Callable[..., MooncakeTier]
) -> None:
    """The kvstore-node and Redis check, on Mooncake: B drops its copies within 2 s, C (stopped
    by SIGTERM, its copies spilled to its nvme) serves none when it starts again, another
    model's chain stays. The store keeps no copy of the dead chain, and keeps the other."""
    fleet_checks.test_an_invalidation_at_one_sidecar_reaches_the_others_and_one_that_was_down(fleet)
    a = fleet[0]
    fp, other = MODEL.fingerprint(), fleet_checks.OTHER.fingerprint()
    tier = make_tier(key_prefix=a.settings["remote.key_prefix"])
    scope_keys = [
        tier_key(Scope("t/local", f), k)
        for f, s in ((fp, "inv-dead"), (other, "inv-kept"))
        for k in chain(4, s)
    ]
    assert tier.contains(scope_keys) == [False] * 4 + [True] * 4


def test_a_copy_born_before_the_invalidation_is_refused_on_every_remote_read(
    fleet: list[ServerProcess],
) -> None:
    fleet_checks.test_a_copy_born_before_the_invalidation_is_refused_on_every_remote_read(fleet)


@pytest.mark.parametrize("evicted", ["entry", "head"])
def test_a_sidecar_that_was_down_when_a_mark_was_lost_fails_closed(
    fleet: list[ServerProcess], evicted: str
) -> None:
    """Mooncake numbers the ledger by look-then-put (``RemoteTier.claim``'s default: two
    sidecars invalidating at the same moment may take one number); a lost mark is seen all the
    same."""
    fleet_checks.test_a_sidecar_that_was_down_when_a_mark_was_lost_fails_closed(fleet, evicted)


def test_a_shred_at_one_sidecar_reaches_the_copies_in_the_store(
    store: MooncakeStoreProcess, make_tier: Callable[..., MooncakeTier], tmp_path: Path
) -> None:
    """Encryption on, one key folder for the fleet: A's copies land in the store sealed (no
    plaintext in the raw values), B restores them; ``kvstore shred --tenant local`` at A removes
    them from the store and B drops its own. The sealed copies planted back (as a backup or a
    node that was down would keep them), with the fleet's marks gone too: a fresh sidecar C
    restores none of them, counts them and deletes them."""
    prefix = f"s{time.monotonic_ns()}:"
    settings = process_settings(
        **{
            "remote.backend": "mooncake",
            "remote.nodes": store.master,
            "remote.metadata_server": store.metadata_url,
            "remote.key_prefix": prefix,
            "nvme.encryption_keys_dir": str(tmp_path / "keys"),  # the fleet's one key folder
        }
    )
    keys, blocks = chain(4, "shred"), patterned(4)
    tier = make_tier(key_prefix=prefix)
    copy_keys = [tier_key(Scope("t/local", MODEL.fingerprint()), k) for k in keys]
    names = [tier._key(k) for k in copy_keys]  # as the store names them
    sidecars = [ServerProcess(settings), ServerProcess(settings)]
    try:
        a, b = sidecars
        with connect(a.unix) as kv:
            fp = kv.register(MODEL)
            assert kv.write(fp, keys, blocks) == 4
            deadline = time.monotonic() + 10
            while kv.stats()["counters"].get("remote_stored_blocks", 0) < 4:
                # the counters, and the serve log's tail (Mooncake's client logs there)
                assert time.monotonic() < deadline, (
                    f"{kv.stats()['counters']}\n{(a.data_dir / 'serve.log').read_text()[-4000:]}"
                )
                time.sleep(0.05)
        with store.client() as raw:
            copies = [bytes(raw.get(n)) for n in names]
        assert all(len(c) >= BLOCK + SEALED_OVERHEAD_BYTES for c in copies)
        assert not any(PATTERN in c for c in copies), "a copy in the store holds plaintext"
        assert _restored(b, keys, blocks) == 4  # the same key folder: B opens A's copies

        shred = [sys.executable, "-m", "kvstore", "shred", "--tenant", "local", "--address", a.unix]
        done = subprocess.run(shred, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert tier.contains(copy_keys) == [False] * 4  # the shred reached the store's copies
        deadline = time.monotonic() + 5 * KEY_CHECK_S
        while not _dropped_on_key_removal(b):  # B's key watch: its copies, and the store's again
            assert time.monotonic() < deadline, "B did not see the key go"
            time.sleep(0.05)
        with connect(b.unix) as kv:
            assert kv.lookup_tiers(fp, keys).hit_blocks == 0

        with store.client() as raw:
            raw.remove_by_regex("^" + re.escape(prefix), True)  # the fleet's marks and ledgers too
            assert [raw.put(n, c) for n, c in zip(names, copies, strict=True)] == [0] * 4
        sidecars.append(c := ServerProcess(settings))
        assert _restored(c, keys, blocks) == 0
        with connect(c.unix) as kv:
            assert kv.stats()["counters"]["remote_unsealable"] >= 1
        assert tier.contains(copy_keys).count(True) < 4  # what C could not open, it deleted
    finally:
        for sidecar in sidecars:
            sidecar.stop()


def _restored(sidecar: ServerProcess, keys: list[BlockKey], blocks: list[bytes]) -> int:
    with connect(sidecar.unix) as kv:
        fp = kv.register(MODEL)
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        n = kv.read_into(fp, keys, outs)
        assert [bytes(o) for o in outs[:n]] == blocks[:n]
        return n


def _dropped_on_key_removal(sidecar: ServerProcess) -> bool:
    """Whether ``sidecar``'s key watch has dropped tenant "local"'s copies (audited when done)."""
    actions = read_audit(sidecar.data_dir / "audit.log").actions
    return any(a["action"] == "shred (key file removed)" and a["phase"] == "done" for a in actions)
