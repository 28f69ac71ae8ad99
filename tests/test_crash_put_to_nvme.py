"""kill -9 right after a put whose blocks found no room in the arena: a real ``kvstore serve``
whose small arena is full of pinned blocks takes a put over TCP straight into nvme's write
queue (no arena slot, so nothing salvage could bring back). The put returns only once nvme has
committed those blocks (``kvstore.store.writes``), so a kill the moment it returns loses none:
after the restart on the same folder every acknowledged block is served byte for byte. Before,
the put was answered with its blocks still in the queue, and the kill lost the queue's tail:
156 and 118 of 192 served in two runs (54, 64, 38 and 10, 44, 64 of each put's 64). Past the wait's bound (a disk behind), the
put does not count what nvme has not committed."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.crash import MODEL, block_bytes  # 256 KiB blocks whose bytes are a function of the key
from benchmarks.server_process import ServerProcess
from kvstore.client import Client, connect
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.store import Scope, StoreConfig, TieredStore, writes
from tiers.dram import JOURNAL_SUFFIX, Arena, DramConfig, DramTier
from tiers.nvme import NvmeConfig, NvmeTier

ARENA_BLOCKS = 16  # a 4 MiB arena, every block of it pinned before each put
PUT_BLOCKS = 64  # 16 MiB a put, all of it into nvme's queue
ROUNDS = 3
TOKEN = "crash-put-token"


def _keys(fp: Fingerprint, n: int, salt: str) -> list[BlockKey]:
    return block_keys(fp, list(range(n * MODEL.tokens_per_block)), MODEL.tokens_per_block, cache_salt=salt)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = ServerProcess(
        {
            "dram.capacity_bytes": str(ARENA_BLOCKS * MODEL.block_bytes),
            "dram.page_bytes": str(MODEL.block_bytes),
            "dram.prefault": "false",
            "nvme.capacity_bytes": "1GiB",
            "server.max_message_bytes": "64MiB",
            "server.tokens": f"{TOKEN}=tenant-a",
        },
        tcp=True,
    )
    try:
        yield server
    finally:
        server.stop()


def _arena_full_of_pins(kv: Client, fp: Fingerprint, salt: str) -> None:
    """Fill the arena and pin every block of it (a lease held until the kill)."""
    fill = _keys(fp, ARENA_BLOCKS, salt)
    assert kv.put(fp, fill, [block_bytes(k) for k in fill]) == ARENA_BLOCKS
    found = kv.lookup_tiers(fp, fill, pin_ttl_s=120)
    assert list(found.tiers) == ["dram"] * ARENA_BLOCKS, "the arena did not hold the fill: no state reached"


def test_a_put_that_went_straight_to_nvme_survives_a_kill_9_right_after_it_returned(
    server: ServerProcess,
) -> None:
    acked: list[BlockKey] = []
    for round_ in range(ROUNDS):
        with connect(server.tcp, TOKEN, timeout_s=30) as kv:
            fp = kv.register(MODEL)
            _arena_full_of_pins(kv, fp, f"fill-{round_}")
            keys = _keys(fp, PUT_BLOCKS, f"put-{round_}")
            stored = kv.put(fp, keys, [block_bytes(k) for k in keys])
            server.kill()  # the moment the put has returned
        assert stored == PUT_BLOCKS, "nvme did not commit 16 MiB within the 2 s pace: nothing to check"
        acked += keys
        server.start()
    served: list[int] = []  # of each put's blocks
    corrupt = 0
    with connect(server.tcp, TOKEN, timeout_s=30) as kv:
        fp = kv.register(MODEL)
        for first in range(0, len(acked), PUT_BLOCKS):
            served.append(0)
            for key in acked[first : first + PUT_BLOCKS]:  # one by one: a get answers a prefix
                got = kv.get(fp, [key])
                served[-1] += len(got)
                corrupt += bool(got) and bytes(got[0]) != block_bytes(key)
    print(f"served {sum(served)} of {len(acked)} acknowledged blocks ({served} a put), {corrupt} corrupt")
    assert corrupt == 0
    assert sum(served) == len(acked)


def test_a_put_the_disk_has_not_committed_within_the_pace_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, nvme's disk held back: the blocks stay queued (written once it goes on),
    but the put does not count them, and says why in a counter."""
    monkeypatch.setattr(writes, "PACE_S", 0.2)  # the bound, shortened for the test
    name = f"kvstore-test-{secrets.token_hex(4)}"
    block = MODEL.block_bytes
    dram = DramTier(DramConfig(2 * block, block, prefault=False, pin_with_cuda="off"), name)
    nvme = NvmeTier(NvmeConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * block))
    gate = threading.Event()  # the disk commits nothing until it is set
    commit = nvme._writer._commit

    def gated(batch: object) -> None:
        assert gate.wait(30), "the test never let the disk go on"
        commit(batch)  # type: ignore[arg-type]

    store = TieredStore([dram, nvme], StoreConfig(clean_ahead=0))
    try:
        scope = Scope("tenant-a", Fingerprint(b"\x0d" * 32))
        fill = _keys(scope.fingerprint, 2, "fill")
        assert store.put(scope, fill, [block_bytes(k) for k in fill]) == 2
        lease = store.pin(scope, fill, ttl_s=60)  # the arena: no room for anything else
        monkeypatch.setattr(nvme._writer, "_commit", gated)
        keys = _keys(scope.fingerprint, 4, "held")
        assert store.put(scope, keys, [block_bytes(k) for k in keys]) == 0
        assert store.stats().counters["put_unacknowledged_blocks"] == 4
        assert [store.tier_of(scope, k) for k in keys] == ["nvme"] * 4  # queued, not dropped
        gate.set()
        nvme.flush()
        assert store.get(scope, keys) == [block_bytes(k) for k in keys]
        more = _keys(scope.fingerprint, 2, "free")  # the disk going again: acknowledged at once
        assert store.put(scope, more, [block_bytes(k) for k in more]) == 2
        assert store.stats().counters["put_unacknowledged_blocks"] == 4
        store.release(lease.lease_id)
    finally:
        gate.set()
        store.close()
        for path in (Arena.path_of(name), Arena.path_of(name) + JOURNAL_SUFFIX):
            Path(path).unlink(missing_ok=True)
