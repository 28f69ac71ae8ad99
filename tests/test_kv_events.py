"""The sidecar's KV cache events, read by a real ZMQ subscriber off a real ``kvstore serve`` and
decoded with vLLM's own types (``vllm.distributed.kv_events``): stores, evictions, deletions and
an invalidation of everything arrive as vLLM's BlockStored / BlockRemoved / AllBlocksCleared.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import Client, connect
from kvstore.keys import block_keys
from kvstore.server.config import EventsSettings, Settings
from kvstore.store import Scope, StoreConfig, TieredStore
from tests.service_fixtures import BLOCK, MODEL

zmq = pytest.importorskip("zmq")
kv_events = pytest.importorskip("vllm.distributed.kv_events")  # vLLM's own types decode the feed
msgspec = pytest.importorskip("msgspec")

ARENA_BLOCKS = 16


class Subscriber:
    """A ZMQ SUB on the feed, decoding each message with vLLM's KVEventBatch."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self._decode = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode
        self.sequences: list[int] = []

    def events(self, timeout_s: float = 0.2) -> list[object]:
        """Every event that arrives until the feed is quiet for ``timeout_s``."""
        out: list[object] = []
        while self.sock.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b""  # vLLM's default topic; events.topic sets another
            self.sequences.append(int.from_bytes(seq, "big"))
            out.extend(self._decode(payload).events)
        return out

    def until(self, found: Callable[[list[object]], bool], timeout_s: float = 10.0) -> list[object]:
        seen: list[object] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not found(seen):
            seen.extend(self.events())
        assert found(seen), f"not seen within {timeout_s} s: {seen}"
        return seen

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def feed() -> Iterator[tuple[ServerProcess, Subscriber]]:
    """One server and its subscriber for the module; each test starts from a quiet feed."""
    folder = tempfile.mkdtemp(prefix="kvs-ev-", dir="/tmp")
    endpoint = f"ipc://{folder}/events"
    server = ServerProcess(
        {
            "dram.capacity_bytes": str(ARENA_BLOCKS * BLOCK),
            "dram.page_bytes": str(ARENA_BLOCKS * BLOCK),
            "dram.prefault": "false",
            "nvme.capacity_bytes": "64MiB",
            "store.clean_ahead": "0",  # demotions only at eviction: what this test watches
            "events.publish_address": endpoint,
        }
    )
    sub = Subscriber(endpoint)
    try:
        with connect(server.unix) as kv:  # the slow joiner: put until the feed is heard
            fp = kv.register(MODEL)
            probe = block_keys(fp, list(range(10_000, 10_016)), 16)
            deadline = time.monotonic() + 10
            while not sub.events() and time.monotonic() < deadline:
                kv.delete(fp, probe)
                kv.put(fp, probe, [bytes(BLOCK)])
            kv.delete(fp, probe)
        sub.events()
        yield server, sub
        sub.events()
    finally:
        sub.close()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _of(events: list[object], kind: type, medium: str | None = None) -> list[bytes | int]:
    return [
        h
        for e in events
        if isinstance(e, kind) and (medium is None or getattr(e, "medium", None) == medium)
        for h in e.block_hashes  # type: ignore[attr-defined]
    ]


def test_a_stored_chain_and_its_eviction_are_vllm_events(feed: tuple[ServerProcess, Subscriber]) -> None:
    server, sub = feed
    with connect(server.unix) as kv:
        fp = kv.register(MODEL)
        keys = block_keys(fp, list(range(24 * 16)), 16)
        # store 24 blocks into a 16-block arena -> the chain's first events are CPU, and
        # blocks evicted from the arena move to nvme: BlockRemoved CPU + BlockStored STORAGE
        kv.put(fp, keys[:8], [bytes(BLOCK)] * 8)
        first = sub.until(lambda seen: len(_of(seen, kv_events.BlockStored, "CPU")) >= 8)
        stored = [e for e in first if isinstance(e, kv_events.BlockStored)]
        assert stored[0].block_hashes == keys[:8]  # one event for the chain, keys in order
        assert stored[0].parent_block_hash is None
        assert stored[0].block_size == MODEL.tokens_per_block  # from the registered model
        assert f"events {server.settings['events.publish_address']}" in kv.stats()["addresses"]
        assert (stored[0].locality, stored[0].ownership, stored[0].token_ids) == ("LOCAL", "kvstore", [])
        kv.put(fp, keys[8:], [bytes(BLOCK)] * 16, parent=keys[7])
        seen = sub.until(lambda seen: bool(_of(seen, kv_events.BlockRemoved, "CPU")))
        seen += sub.events(0.5)
    later = [e for e in seen if isinstance(e, kv_events.BlockStored) and e.medium == "CPU"]
    assert later[0].parent_block_hash == keys[7]  # a chain continued names its parent
    evicted = set(_of(seen, kv_events.BlockRemoved, "CPU"))
    assert evicted <= set(keys)
    assert evicted <= set(_of(seen, kv_events.BlockStored, "STORAGE"))  # demoted, not lost
    assert sub.sequences == sorted(sub.sequences)


def test_a_delete_and_an_invalidation_of_everything(feed: tuple[ServerProcess, Subscriber]) -> None:
    server, sub = feed
    with connect(server.unix) as kv:
        fp = kv.register(MODEL)
        keys = block_keys(fp, list(range(50_000, 50_000 + 3 * 16)), 16)
        kv.put(fp, keys, [bytes(BLOCK)] * 3)
        sub.until(lambda seen: len(_of(seen, kv_events.BlockStored)) >= 3)
        kv.delete(fp, keys[2:])
        seen = sub.until(lambda seen: keys[2] in _of(seen, kv_events.BlockRemoved))
        seen += sub.events(0.5)  # its copy in nvme too, where write-behind made one
        assert set(_of(seen, kv_events.BlockRemoved)) == {keys[2]}
        removed = kv.invalidate(everything=True, tenant="*")
        seen = sub.until(lambda seen: any(isinstance(e, kv_events.AllBlocksCleared) for e in seen))
        seen += sub.events(0.5)
    # The clear stands for every removal: none comes after it (those the thread had taken
    # before the clear reached the queue went out first).
    assert removed and isinstance(seen[-1], kv_events.AllBlocksCleared)
    assert sub.sequences == sorted(sub.sequences)


def test_a_full_queue_drops_and_counts_and_never_holds_up_a_store(tmp_path: Path) -> None:
    """With no room for a change, stores go on, the changes are counted as dropped, the next
    batch's sequence skips one (the subscriber sees the gap), and a clear still goes out."""
    from kvstore.server.events import EventPublisher
    from tests.tier_factories import make_dram

    endpoint = f"ipc://{tmp_path}/events"
    publisher = EventPublisher(EventsSettings(publish_address=endpoint, max_queued=0), ["dram"])
    sub = Subscriber(endpoint)
    store = TieredStore([make_dram(tmp_path, 2 << 20)], StoreConfig())
    try:
        store.listen(publisher)
        scope = Scope("t/a", MODEL.fingerprint())
        keys = block_keys(scope.fingerprint, list(range(5 * 16)), 16)
        store.put(scope, keys, [bytes(BLOCK)] * 5)
        assert store.exists(scope, keys) == [True] * 5
        assert publisher.dropped == 5
        deadline = time.monotonic() + 10
        seen: list[object] = []
        while not seen and time.monotonic() < deadline:  # the slow joiner again
            store.invalidate()
            seen = sub.events()
        assert isinstance(seen[0], kv_events.AllBlocksCleared)
        assert sub.sequences[0] == 1  # batch 0 never went out: the dropped changes' gap
    finally:
        store.close()
        publisher.close()
        sub.close()


def test_events_are_off_by_default_and_a_bad_address_is_refused() -> None:
    from kvstore.errors import InvalidArgument
    from kvstore.server.config import load_settings

    assert Settings().events.publish_address == ""
    with pytest.raises(InvalidArgument, match=r"events\.publish_address"):
        load_settings(env={}, overrides={"events.publish_address": "127.0.0.1:5557"})


def test_the_router_follows_a_feed_instead_of_asking(feed: tuple[ServerProcess, Subscriber]) -> None:
    """``kvstore route --sidecar-events``: the probe's hits come from the feed, with no lookup."""
    from kvstore.cli.route import _probe
    from kvstore.routing.events import FollowedProbe

    server, sub = feed
    endpoint = server.settings["events.publish_address"]
    probe = _probe([server.unix], [endpoint], token=None)  # what --sidecar-events builds
    assert isinstance(probe, FollowedProbe)
    try:
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            keys = block_keys(fp, list(range(70_000, 70_000 + 4 * 16)), 16)
            lookups = _lookups(kv)
            deadline = time.monotonic() + 10
            while probe.hits(fp, keys) != [("dram",) * 4] and time.monotonic() < deadline:
                kv.delete(fp, keys)  # the slow joiner: store again until the probe heard it
                kv.put(fp, keys, [bytes(BLOCK)] * 4)
                time.sleep(0.2)
            assert probe.hits(fp, keys) == [("dram",) * 4]
            kv.delete(fp, keys[2:])
            _wait(lambda: probe.hits(fp, keys) == [("dram",) * 2])
            kv.invalidate(everything=True, tenant="*")
            _wait(lambda: probe.hits(fp, keys) == [()])
            assert _lookups(kv) == lookups  # every answer came from the feed
    finally:
        probe.close()
        sub.events()


def _lookups(kv: Client) -> int:
    counters = kv.stats()["counters"]
    return int(counters["lookup_hit_blocks"] + counters["lookup_miss_blocks"])


def _wait(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done()


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_feeds_index_matches_what_the_store_holds_after_random_work(
    tmp_path: Path, write_behind: bool
) -> None:
    """Puts, re-puts, reads (promotions out of nvme), deletes, demotions, evictions from a small
    arena, the cleaner or write-behind copying below: the index kept from the feed alone ends up
    naming exactly the blocks the store holds, each in its fastest tier."""
    import random

    from kvstore.kv_events import SidecarIndex, decoder, sequence_of
    from kvstore.server.events import EventPublisher
    from tests.tier_factories import make_dram, make_nvme

    endpoint = f"ipc://{tmp_path}/events"
    publisher = EventPublisher(EventsSettings(publish_address=endpoint), ["dram", "nvme"])
    sub = Subscriber(endpoint)
    config = StoreConfig(write_behind=write_behind)
    store = TieredStore([make_dram(tmp_path, 2 << 20), make_nvme(tmp_path, 64 << 20)], config)
    index = SidecarIndex()
    decode = decoder().decode

    def follow(quiet_s: float) -> None:
        while sub.sock.poll(int(quiet_s * 1000)):
            _topic, seq, payload = sub.sock.recv_multipart()
            index.apply(sequence_of(seq), decode(payload))

    try:
        store.listen(publisher)
        scope = Scope("t/a", MODEL.fingerprint())
        probe = block_keys(scope.fingerprint, list(range(16)), 16)
        deadline = time.monotonic() + 10
        while not index.copies and time.monotonic() < deadline:  # the slow joiner
            store.put(scope, probe, [bytes(BLOCK)])
            follow(0.2)
        rng = random.Random(3)
        heads = [[rng.randrange(1000) for _ in range(16 * 8)] for _ in range(40)]
        for _ in range(400):
            keys = block_keys(scope.fingerprint, rng.choice(heads)[: 16 * rng.randint(1, 8)], 16)
            op = rng.random()
            if op < 0.6:
                store.put(scope, keys, [bytes(BLOCK)] * len(keys))
            elif op < 0.8:
                store.get(scope, keys)
            elif op < 0.95:
                store.delete(scope, keys[rng.randrange(len(keys)) :])
            else:
                store.demote("dram")
        store.flush()
        follow(1.0)
        held = {key: tier for _scope, key, tier in store.blocks()}
        assert len(held) > 100  # the work left a store worth comparing
        followed = {key: index.prefix_tiers([key])[0] for key in index.copies}
        assert followed == held
        assert index.gaps == 0 and publisher.dropped == 0
    finally:
        store.close()
        publisher.close()
        sub.close()
