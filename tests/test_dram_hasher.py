"""The dram tier's hasher (``tiers.dram_hasher``): a block written in place, committed without a
checksum, gets one just after its commit, kept in its entry and in the arena journal, so a change
to its bytes since is caught when it leaves the process and at salvage."""

from __future__ import annotations

import os
import time
from pathlib import Path

import xxhash

from tests.test_journal import FP, key
from tiers.dram import JOURNAL_SUFFIX, DramConfig, DramTier
from tiers.journal import Journal, JournalRecord, replay


def test_a_summed_record_joins_the_commit_of_its_slot_and_key_only(tmp_path: Path) -> None:
    path = str(tmp_path / "j")
    journal = Journal(path)
    journal.commit(JournalRecord(0, 10, b"k0", FP, b"m"))  # written in place: no checksum yet
    journal.commit(JournalRecord(4096, 10, b"k1", FP, b""))
    journal.commit(JournalRecord(8192, 10, b"k2", FP, b""))
    journal.free(8192)
    journal.summed_many([(0, b"k0", 11), (4096, b"other", 12), (8192, b"k2", 13)])
    journal.close(remove=False)
    live = replay(path)
    assert live[0] == JournalRecord(0, 10, b"k0", FP, b"m", 11)
    assert live[4096].checksum is None, "a checksum of another key's block is not this one's"
    assert 8192 not in live, "a checksum revives no freed slot"
    torn = str(tmp_path / "torn")
    journal = Journal(torn)
    journal.commit(JournalRecord(0, 10, b"k0", FP, b"m"))
    journal.summed_many([(0, b"k0", 11)])
    journal.close(remove=False)
    Path(torn).write_bytes(Path(torn).read_bytes()[:-2])  # torn by a kill: the block stays unchecked
    assert replay(torn)[0] == JournalRecord(0, 10, b"k0", FP, b"m")


def _wait_summed(path: str, count: int) -> dict[int, JournalRecord]:
    deadline = time.monotonic() + 10
    while True:
        live = replay(path)
        if sum(r.checksum is not None for r in live.values()) >= count:
            return live
        assert time.monotonic() < deadline, "the hasher journaled no checksum"
        time.sleep(0.02)


def test_a_block_written_in_place_is_checksummed_after_its_commit_and_a_change_is_caught(
    tmp_path: Path,
) -> None:
    name = f"kvstore-test-{os.getpid()}-hasher"
    tier = DramTier(DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False), name)
    try:
        payloads = [bytes([i + 1]) * 8192 for i in range(4)]
        slots = tier.reserve_many([(key(i), len(p)) for i, p in enumerate(payloads)], FP)
        for slot, payload in zip(slots, payloads, strict=True):  # as a same-host client does
            assert slot is not None
            tier.slot_view(slot)[:] = payload
        tier.commit_many([(key(i), None) for i in range(4)])
        live = _wait_summed(tier.arena.path_of(name) + JOURNAL_SUFFIX, 4)
        assert {r.key: r.checksum for r in live.values()} == {
            bytes(key(i)): xxhash.xxh3_64_intdigest(p) for i, p in enumerate(payloads)
        }
        slot = slots[2]
        assert slot is not None
        tier.slot_view(slot)[100:116] = b"\xee" * 16  # changed since: its first copy out finds it
        assert tier.verified_checksum(key(2), slot, tier.slot_view(slot)) is None
        assert tier.usage().checksum_failures == 1
        first = slots[0]
        assert first is not None
        assert tier.verified_checksum(key(0), first, tier.slot_view(first)) == xxhash.xxh3_64_intdigest(
            payloads[0]
        )
    finally:
        tier.close()
    assert not Path(tier.arena.path_of(name)).exists()


def test_a_block_the_tier_copies_in_itself_carries_its_checksum_from_the_commit() -> None:
    """``put`` (a promotion, a read-through, a salvage: the server's own copy) hashes on the way."""
    name = f"kvstore-test-{os.getpid()}-put-hashed"
    tier = DramTier(DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False), name)
    try:
        payload = os.urandom(300_001)
        tier.put(key(7), payload, FP)
        (record,) = replay(
            tier.arena.path_of(name) + JOURNAL_SUFFIX
        ).values()  # no wait: in the commit record
        assert record.checksum == xxhash.xxh3_64_intdigest(payload)
        assert tier._hasher._thread is None, "nothing was left for the hasher"
    finally:
        tier.close()
