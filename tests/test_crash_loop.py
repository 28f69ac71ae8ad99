"""kill -9 under load, a few cycles in each of a cache's everyday states (``kvstore bench crash``
runs more): every block whose commit returned is served after the restart, byte for byte, and a
torn or unacknowledged slot is never served. The dead server's arena is salvaged by its journal
into nvme: into an empty nvme, into a full one (room made by eviction, as a clean stop's spill
makes it), and with the arena overflowing into nvme when the kill comes (blocks on their way
down keep their arena slots until nvme has written them)."""

from __future__ import annotations

import logging
import random
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.crash import State, kill_cycles
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.server.builder import _salvage
from kvstore.store import Scope, StoreConfig, TieredStore
from kvstore.store.model import tier_key
from tiers.dram import JOURNAL_SUFFIX, Arena, DramConfig, DramTier, salvage
from tiers.journal import replay
from tiers.nvme import NvmeConfig, NvmeTier

MiB = 1 << 20
BLOCK = 1 << 16
FP = Fingerprint(b"\x0c" * 32)
SCOPE = Scope("tenant-a", FP)

# 256 KiB blocks. Each state's sizes keep a cycle to about a second of load on 2 cores.
EMPTY = State("from an empty store", 512 * MiB, blocks_per_writer=400, max_load_s=0.8)
NVME_FULL = State(
    "nvme full at the kill",
    128 * MiB,
    # 40 MiB: in the arena at the kill with the last cycle's blocks read back, and none evicted
    # from it (which blocks eviction keeps is not what is measured); nvme must evict to take them
    blocks_per_writer=160,
    max_load_s=0.8,
    nvme_bytes=128 * MiB,
    fill_nvme=True,
)
OVERFLOW = State("arena overflowing into nvme", 32 * MiB, writers=3, blocks_per_writer=240, max_load_s=1.2)


def test_acknowledged_blocks_survive_kill_9_from_an_empty_store() -> None:
    # 400 blocks per cycle stay inside the arena, with the blocks read back and promoted in
    # earlier cycles: what is measured is the crash, not eviction to nvme.
    result = kill_cycles(EMPTY, 2, rng=random.Random(7))
    print(result.per_cycle)
    assert result.acked >= 200, "the load barely ran: nothing was measured"
    assert result.corrupt == 0
    assert result.served >= 0.99 * result.acked
    assert result.served_at_end >= 0.99 * result.acked


def test_acknowledged_blocks_survive_kill_9_with_nvme_full() -> None:
    """Before salvage made room by eviction: 0 served (``nvme tier full``, the arena removed)."""
    result = kill_cycles(NVME_FULL, 2, rng=random.Random(7))
    print(result.per_cycle)
    assert result.nvme_full_at_kills == 2, "nvme was not full at the kill: the state was not reached"
    assert result.acked >= 100, "the load barely ran: nothing was measured"
    assert result.corrupt == 0
    assert result.served >= 0.99 * result.acked


def test_acknowledged_blocks_survive_kill_9_with_the_arena_overflowing_into_nvme() -> None:
    """Before demoted blocks kept their arena slots until nvme wrote them: 82-87% served."""
    result = kill_cycles(OVERFLOW, 2, rng=random.Random(7))
    print(result.per_cycle)
    assert result.acked >= 4 * (32 * MiB) // (256 << 10), "the arena never overflowed: nothing was measured"
    assert result.corrupt == 0
    assert result.served >= 0.99 * result.acked
    assert result.served_at_end >= 0.99 * result.acked


@pytest.mark.slow
def test_without_the_journal_a_kill_loses_the_arena() -> None:
    """The same loop with the journal off: the checks above can fail."""
    result = kill_cycles(EMPTY, 1, rng=random.Random(7), settings={"dram.journal": "false"})
    assert result.acked > 0 and result.served < 0.5 * result.acked and result.corrupt == 0


# ---------------------------------------------------------------- in process, no load: the rules


def _chain(n: int, salt: str) -> list[BlockKey]:
    return block_keys(FP, list(range(n * 4)), 4, cache_salt=salt)


def _bytes(key: BlockKey) -> bytes:
    return (key * (BLOCK // 32))[:BLOCK]


@pytest.fixture
def arena_name() -> Iterator[str]:
    """A journaled arena's name; whatever a test leaves of it in /dev/shm is removed after."""
    name = f"kvstore-test-{secrets.token_hex(4)}"
    yield name
    for path in (Arena.path_of(name), Arena.path_of(name) + JOURNAL_SUFFIX):
        Path(path).unlink(missing_ok=True)


def _journaled_dram(name: str) -> DramTier:
    return DramTier(DramConfig(4 * BLOCK, BLOCK, prefault=False, pin_with_cuda="off"), name)


def test_a_demoted_blocks_slot_stays_salvageable_until_nvme_has_written_it(
    tmp_path: Path, arena_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overflowing arena's loss: a block demoted to nvme had its slot freed (and journaled
    free) while its copy still waited in nvme's write queue, which a kill -9 loses."""
    dram = _journaled_dram(arena_name)
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=32 * BLOCK))
    gate = threading.Event()  # the disk takes nothing until it is set
    commit = nvme._writer._commit

    def gated(batch: object) -> None:
        assert gate.wait(30), "the test never let the disk go on"
        commit(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(nvme._writer, "_commit", gated)
    store = TieredStore([dram, nvme], StoreConfig(clean_ahead=0))
    try:
        keys = _chain(4, "demoted")
        store.put(SCOPE, keys, [_bytes(k) for k in keys])
        assert store.demote("dram") == 4  # into nvme's queue; nvme has written nothing yet
        assert [store.tier_of(SCOPE, k) for k in keys] == ["nvme"] * 4
        # What a kill -9 now leaves: the journal still names the four slots, bytes intact
        with salvage(arena_name) as found:
            assert sorted(bytes(view) for _, view in found) == sorted(_bytes(k) for k in keys)
        gate.set()
        nvme.flush()  # written: the slots may go now
        more = _chain(1, "after")
        assert store.put(SCOPE, more, [_bytes(more[0])]) == 1  # its room: the slots, settled
        live = replay(Arena.path_of(arena_name) + JOURNAL_SUFFIX)
        assert [record.key[-32:] for record in live.values()] == [more[0]]
        assert store.get(SCOPE, keys) == [_bytes(k) for k in keys]
    finally:
        gate.set()
        store.close()


def test_an_arena_whose_blocks_nvme_refused_is_kept_for_the_next_start(
    tmp_path: Path, arena_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    dram = _journaled_dram(arena_name)
    keys = _chain(3, "kept")
    for key in keys:  # committed and journaled, as a server killed now leaves them
        dram.put(tier_key(SCOPE, key), _bytes(key), bytes(FP))
    broken = NvmeTier(NvmeConfig(path=tmp_path / "broken", capacity_bytes=32 * BLOCK))
    broken.close()  # a medium that refuses every write
    with caplog.at_level(logging.WARNING):
        assert not _salvage(arena_name, broken, StoreConfig())
    assert "kept" in caplog.text and Path(Arena.path_of(arena_name)).exists()
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=32 * BLOCK))
    try:  # the next start, with a medium that takes them: the arena may go
        assert _salvage(arena_name, nvme, StoreConfig())
        out = memoryview(bytearray(BLOCK))
        assert all(nvme.get_into(tier_key(SCOPE, k), out) == BLOCK and out == _bytes(k) for k in keys)
    finally:
        nvme.close()
        dram.close()
