"""The arena journal and salvage: which slots of a dead server's arena hold committed blocks."""

from __future__ import annotations

import os
from pathlib import Path

from tiers.base import TierKey
from tiers.dram import JOURNAL_SUFFIX, DramConfig, DramTier, salvage
from tiers.journal import COMMIT, FREE, Journal, JournalRecord, _encode, replay

FP = b"\x07" * 32


def key(i: int) -> TierKey:
    return TierKey(bytes([3]) + b"abc" + FP + i.to_bytes(32, "little"))


def test_replay_follows_commits_and_frees_and_stops_at_a_torn_tail(tmp_path: Path) -> None:
    path = str(tmp_path / "j")
    journal = Journal(path)
    journal.commit(JournalRecord(0, 10, b"k0", FP, b"m"))
    journal.commit(JournalRecord(4096, 20, b"k1", FP, b""))
    journal.free(0)  # k0's slot went back: its bytes may be anyone's now
    journal.commit(JournalRecord(8192, 30, b"k2", FP, b""))
    journal.close(remove=False)
    assert sorted(replay(path)) == [4096, 8192]
    assert replay(path)[4096] == JournalRecord(4096, 20, b"k1", FP, b"")
    whole = Path(path).read_bytes()
    Path(path).write_bytes(whole[:-3])  # the crash tore the last record: it was never acknowledged
    assert sorted(replay(path)) == [4096]
    Path(path).write_bytes(whole[:-3] + b"\xff\xff\xff")  # garbage instead: the CRC says so
    assert sorted(replay(path)) == [4096]


def test_compaction_keeps_exactly_the_live_blocks(tmp_path: Path) -> None:
    name = f"kvstore-test-{os.getpid()}-compact"
    tier = DramTier(DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False), name)
    try:
        assert tier._journal is not None
        tier._journal.compact_bytes = 4096  # compact after a few dozen records
        for round_ in range(50):
            for i in range(8):
                tier.put(key(i), bytes([round_ % 256]) * 5000, FP)
        live = replay(tier.arena.path_of(name) + JOURNAL_SUFFIX)
        assert len(live) == 8
        assert os.path.getsize(tier.arena.path_of(name) + JOURNAL_SUFFIX) < 8 * 4096
        with salvage(name) as blocks:
            assert sorted(r.key for r, _ in blocks) == sorted(bytes(key(i)) for i in range(8))
            assert all(bytes(view) == bytes([49]) * 5000 for _, view in blocks)
    finally:
        tier.close()
    assert not os.path.exists(tier.arena.path_of(name) + JOURNAL_SUFFIX), "a clean close removes it"


def test_salvage_sees_committed_slots_only(tmp_path: Path) -> None:
    name = f"kvstore-test-{os.getpid()}-salvage"
    tier = DramTier(DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False), name)
    try:
        tier.put(key(1), b"a" * 4096, FP)
        tier.put(key(2), b"b" * 4096, FP)
        tier.delete(key(1))
        slot = tier.reserve(key(3), 4096, FP)  # reserved, written, never committed
        tier.slot_view(slot)[:] = b"c" * 4096
        with salvage(name) as blocks:
            assert [(r.key, bytes(v)) for r, v in blocks] == [(bytes(key(2)), b"b" * 4096)]
    finally:
        tier.close()


def test_a_large_live_set_is_not_rewritten_at_every_commit(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "j"), compact_bytes=4096)
    live = [JournalRecord(i * 4096, 100, b"k%d" % i, FP, b"") for i in range(200)]  # ~17 KiB of records
    journal.rewrite(live)
    assert not journal.needs_compaction  # the live set alone is over compact_bytes
    rewrites = 0
    for i in range(2000):
        journal.commit(JournalRecord(i * 4096, 100, b"n%d" % i, FP, b""))
        if journal.needs_compaction:
            journal.rewrite(live)
            rewrites += 1
    assert rewrites < 200, f"rewritten {rewrites} times for 2000 commits"
    journal.close(remove=True)


def test_a_batch_of_commits_is_one_append_whose_torn_tail_drops_only_its_last_records(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "j")
    journal = Journal(path)
    journal.commit(JournalRecord(0, 10, b"k0", FP, b"m"))
    before = os.path.getsize(path)
    journal.commit_many([JournalRecord(4096 * i, 10 * i, b"k%d" % i, FP, b"meta") for i in range(1, 5)])
    journal.close(remove=False)
    assert sorted(replay(path)) == [0, 4096, 8192, 12288, 16384]
    assert replay(path)[12288] == JournalRecord(12288, 30, b"k3", FP, b"meta")
    whole = Path(path).read_bytes()
    record = (len(whole) - before) // 4
    Path(path).write_bytes(whole[: len(whole) - record - 1])  # torn inside the batch's third record
    assert sorted(replay(path)) == [0, 4096, 8192]


def test_a_batch_of_commits_writes_the_bytes_of_its_records_written_one_by_one(tmp_path: Path) -> None:
    """Keys and metas of different lengths in one batch (each run of equal lengths shares a
    layout), a short fingerprint padded, plain tuples and records alike."""
    records = [
        JournalRecord(0, 10, b"k0", FP, b"m"),
        JournalRecord(4096, 20, b"k1", FP, b"m"),
        JournalRecord(8192, 30, b"a longer key", FP, b""),
        JournalRecord(12288, 40, b"k3", b"short", b"a longer meta"),
        JournalRecord(16384, 50, b"k4", FP, b"m"),
    ]
    path = str(tmp_path / "j")
    journal = Journal(path)
    journal.commit_many([r[:] for r in records[:2]])  # a slice of a record is a plain tuple
    journal.commit_many(records[2:])
    journal.close(remove=False)
    assert Path(path).read_bytes() == b"".join(_encode(COMMIT, *r) for r in records)
    assert replay(path)[12288] == JournalRecord(12288, 40, b"k3", b"short".ljust(32, b"\0"), b"a longer meta")


def test_a_free_record_is_the_bytes_the_general_encoder_writes(tmp_path: Path) -> None:
    """Frees have their own short path (one for each victim of an eviction)."""
    path = str(tmp_path / "j")
    journal = Journal(path)
    journal.free(4096)
    journal.free(1 << 40)
    journal.close(remove=False)
    assert Path(path).read_bytes() == _encode(FREE, 4096, 0, b"", b"", b"") + _encode(
        FREE, 1 << 40, 0, b"", b"", b""
    )


def test_frees_in_a_batch_are_written_at_its_end_or_before_a_slot_is_handed_out(tmp_path: Path) -> None:
    """An eviction pass frees many slots (``frees_batched``): their records go out in one
    write, and always before any slot is handed out again, so a salvage never takes a slot's
    new bytes for the block it held before."""
    name = f"kvstore-test-{os.getpid()}-batch"
    tier = DramTier(DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False), name)
    path = tier.arena.path_of(name) + JOURNAL_SUFFIX
    try:
        for i in range(4):
            tier.put(key(i), bytes([i]) * 4096, FP)
        with tier.frees_batched():
            tier.delete(key(0))
            tier.delete(key(1))
            assert len(replay(path)) == 4  # not written yet: salvage would find both, whole
            slot = tier.reserve(key(9), 4096, FP)  # a slot handed out: the frees go first
            assert len(replay(path)) == 2
            tier.abort(key(9))
            tier.delete(key(2))
        assert sorted(r.key for r in replay(path).values()) == [bytes(key(3))]
        assert slot.offset in (0, 4096)  # one of the slots just freed
    finally:
        tier.close()
