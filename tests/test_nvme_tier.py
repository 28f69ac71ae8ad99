"""The nvme tier (tiers/nvme*.py): LMDB layout, the writer queue, durability and crash policy.

The contract every tier keeps is in test_tier_contract.py, reading blocks back (checksums,
batch reads, the native verified copy) in test_nvme_reads.py; this file covers the rest of what
only the nvme tier does. A "gate" holds the writer thread before it commits, so a test can look at
blocks while they are still queued.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.nvme_fixtures import FP, MiB, WriterGate, config, key, payload, raw_env, reopen
from tests.tier_factories import read
from tiers import (
    BlockTooLarge,
    Codec,
    TierBusy,
    TierClosed,
    TierFull,
    TierUnavailable,
    nvme_folder,
)
from tiers.nvme import NvmeConfig, NvmeTier
from tiers.nvme_config import Durability

__all__ = ["config"]

FP2 = b"\x02" * 32


def bf16_payload(i: int, size: int) -> bytes:
    values = torch.randn(size // 2, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
    return values.view(torch.uint8).numpy().tobytes()


@pytest.fixture
def tier(config: NvmeConfig) -> Iterator[NvmeTier]:
    t = NvmeTier(config)
    yield t
    t.close()


# ---- round trips and the queue -----------------------------------------------------------------


@pytest.mark.parametrize("codec", list(Codec), ids=lambda c: c.name)
def test_round_trip_through_the_medium(config: NvmeConfig, codec: Codec) -> None:
    config = replace(config, codec=codec)
    blocks = {key(i): bf16_payload(i, 4096 * (i + 1)) for i in range(8)}
    blocks[key(100)] = b""
    blocks[key(101)] = payload(101, 4097)  # odd length, incompressible
    tier = NvmeTier(config)
    for k, data in blocks.items():
        tier.put(k, data, FP)
    assert all(read(tier, k) == data for k, data in blocks.items())  # pending or committed
    tier = reopen(tier, config)
    assert all(read(tier, k) == data for k, data in blocks.items())  # from the map
    usage = tier.usage()
    assert usage.used_bytes == sum(len(d) for d in blocks.values())
    if codec is Codec.NONE:
        assert usage.stored_bytes == usage.used_bytes
    else:
        assert usage.stored_bytes < usage.used_bytes
    tier.close()


def test_incompressible_blocks_are_stored_raw(config: NvmeConfig) -> None:
    tier = NvmeTier(replace(config, codec=Codec.ZSTD))
    tier.put(key(1), payload(1, 100_000), FP)
    assert tier.usage().stored_bytes == 100_000  # zstd would have grown it
    assert read(tier, key(1)) == payload(1, 100_000)
    tier.close()


def test_reads_of_queued_blocks_see_the_latest_write(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = WriterGate(tier, monkeypatch)
    buf = bytearray(payload(1, 50_000))
    tier.put(key(1), memoryview(buf), FP)
    buf[:] = bytes(len(buf))  # put copied it
    assert read(tier, key(1)) == payload(1, 50_000)  # served from the queue
    tier.put(key(1), payload(2, 30_000), FP2)  # overwrite while queued
    assert read(tier, key(1)) == payload(2, 30_000)
    assert {(b.key, b.fingerprint, b.size_bytes) for b in tier.scan()} == {(key(1), FP2, 30_000)}
    tier.put(key(2), payload(3, 1000), FP)
    assert tier.delete(key(2)) is True  # cancels the queued put
    assert read(tier, key(2)) is None
    assert tier.delete(key(2)) is False
    gate.open()
    tier.flush()
    assert read(tier, key(1)) == payload(2, 30_000)
    assert read(tier, key(2)) is None
    assert tier.usage().blocks == 1


def test_delete_of_a_queued_overwrite_removes_the_committed_block_too(
    config: NvmeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = NvmeTier(config)
    tier.put(key(1), payload(1, 1000), FP)
    tier.flush()  # committed
    gate = WriterGate(tier, monkeypatch)
    tier.put(key(1), payload(2, 2000), FP)  # queued overwrite
    assert tier.delete(key(1)) is True
    gate.open()
    tier = reopen(tier, config)
    assert read(tier, key(1)) is None
    assert list(tier.scan()) == []
    tier.close()


def test_queued_puts_count_against_capacity(config: NvmeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = NvmeTier(replace(config, capacity_bytes=4 * MiB))
    gate = WriterGate(tier, monkeypatch)
    for i in range(4):
        tier.put(key(i), payload(i, MiB), FP)
    assert not tier.can_store(1)
    with pytest.raises(TierFull):
        tier.put(key(9), b"x", FP)
    tier.put(key(0), payload(10, MiB), FP)  # overwrite frees the old size first
    with pytest.raises(BlockTooLarge):
        tier.put(key(9), bytes(4 * MiB + 1), FP)
    tier.delete(key(1))
    assert tier.can_store(MiB)
    gate.open()
    tier.close()


def _full_queue(config: NvmeConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[NvmeTier, WriterGate]:
    """A tier whose write queue (2 MiB) is full of two puts its held writer has not committed."""
    tier = NvmeTier(replace(config, max_pending_bytes=2 * MiB))
    gate = WriterGate(tier, monkeypatch)
    tier.put(key(0), payload(0, MiB), FP)
    tier.put(key(1), payload(1, MiB), FP)
    return tier, gate


def test_put_waits_while_too_many_bytes_are_queued(
    config: NvmeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, gate = _full_queue(config, monkeypatch)
    third = threading.Thread(target=tier.put, args=(key(2), payload(2, MiB), FP))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # back-pressure: 2 MiB are queued already
    gate.open()
    third.join(10)
    assert not third.is_alive()
    tier.flush()
    assert all(read(tier, key(i)) == payload(i, MiB) for i in range(3))
    tier.close()


def test_put_nowait_refuses_a_full_queue_and_the_writer_can_wait_for_it_to_drain(
    config: NvmeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, gate = _full_queue(config, monkeypatch)
    with pytest.raises(TierBusy):
        tier.put_nowait(key(2), payload(2, MiB), FP)  # the store's placements never wait
    assert read(tier, key(2)) is None  # nothing of the refused block was kept
    assert not tier.wait_for_queue_room(MiB, 0.2)  # the writer is held: still full at the timeout
    threading.Timer(0.2, gate.open).start()
    assert tier.wait_for_queue_room(MiB, 10)
    tier.put_nowait(key(2), payload(2, MiB), FP)
    tier.flush()
    assert all(read(tier, key(i)) == payload(i, MiB) for i in range(3))
    tier.close()


def test_writer_syncs_on_its_own_in_cache_mode(config: NvmeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = NvmeTier(replace(config, sync_interval_s=0.05))
    synced = threading.Event()
    sync = tier._writer._sync

    def counting_sync() -> None:
        sync()
        synced.set()

    monkeypatch.setattr(tier._writer, "_sync", counting_sync)
    tier.put(key(1), b"x" * 1000, FP)
    assert synced.wait(10)  # no flush() called
    marker = json.loads((Path(config.path) / nvme_folder.MARKER_FILE).read_text())
    assert marker["dirty"] is False  # the sync marked the folder clean again
    tier.close()


# ---- reopening and durability ------------------------------------------------------------------


@pytest.mark.parametrize("durability", ["cache", "durable"])
def test_reopen_serves_every_block_with_its_fingerprint(config: NvmeConfig, durability: str) -> None:
    config = replace(config, durability=durability)  # type: ignore[arg-type]
    tier = NvmeTier(config)
    expected = {key(i): (FP if i % 2 else FP2, 1000 + 997 * i) for i in range(30)}
    for i in range(30):
        tier.put(key(i), payload(i, expected[key(i)][1]), expected[key(i)][0])
    tier.delete(key(3))
    del expected[key(3)]
    tier.close()
    assert not (Path(config.path) / nvme_folder.MARKER_FILE).exists()  # a clean close
    tier = NvmeTier(config)
    assert {b.key: (b.fingerprint, b.size_bytes) for b in tier.scan()} == expected
    for i in range(30):
        assert read(tier, key(i)) == (None if i == 3 else payload(i, 1000 + 997 * i))
    assert tier.usage().used_bytes == sum(size for _, size in expected.values())
    tier.close()


def test_a_second_owner_is_refused(tier: NvmeTier, config: NvmeConfig) -> None:
    with pytest.raises(TierUnavailable):
        NvmeTier(config)


def test_closed_tier_refuses_everything(tier: NvmeTier) -> None:
    tier.put(key(1), b"abc", FP)
    tier.close()
    for call in (
        lambda: tier.get_into(key(1), memoryview(bytearray(3))),
        lambda: tier.size_of(key(1)),
        lambda: tier.delete(key(1)),
        lambda: tier.scan(),
        tier.flush,
        lambda: tier.can_store(1),
    ):
        with pytest.raises(TierClosed):
            call()


# ---- damage found at open ----------------------------------------------------------------------


def test_unreadable_header_drops_the_block_at_open(config: NvmeConfig) -> None:
    tier = NvmeTier(config)
    tier.put(key(1), b"a" * 100, FP)
    tier.put(key(2), b"b" * 100, FP)
    tier.close()
    with raw_env(config) as env, env.begin(write=True, db=env.open_db(b"headers")) as txn:
        txn.put(key(1), b"not a header")
    tier = NvmeTier(config)
    assert [b.key for b in tier.scan()] == [key(2)]
    tier = reopen(tier, config)
    assert [b.key for b in tier.scan()] == [key(2)]
    tier.close()


def make_unclean(config: NvmeConfig, *, dirty: bool, boot_id: str | None = None) -> None:
    """Leave the marker a killed owner would have left."""
    marker = {"boot_id": boot_id if boot_id is not None else nvme_folder.boot_id(), "dirty": dirty}
    (Path(config.path) / nvme_folder.MARKER_FILE).write_text(json.dumps(marker))


def scribble(config: NvmeConfig) -> None:
    with open(Path(config.path) / "data.mdb", "r+b") as f:
        f.write(os.urandom(16384))  # both meta pages


def filled(config: NvmeConfig) -> None:
    tier = NvmeTier(config)
    tier.put(key(1), b"a" * 100, FP)
    tier.close()


@pytest.mark.parametrize(
    ("durability", "unclean"), [("cache", True), ("cache", False), ("durable", True), ("durable", False)]
)
def test_a_damaged_environment_is_moved_aside_kept_and_counted_and_the_tier_starts_empty(
    config: NvmeConfig, caplog: pytest.LogCaptureFixture, durability: Durability, unclean: bool
) -> None:
    config = replace(config, durability=durability)
    filled(config)
    scribble(config)
    damaged_bytes = (Path(config.path) / "data.mdb").read_bytes()
    if unclean:
        make_unclean(config, dirty=False)
    with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
        tier = NvmeTier(config)
    try:
        assert list(tier.scan()) == []
        assert tier.usage().damaged_moved == 1
        [moved] = Path(config.path).parent.glob("nvme.damaged-*")
        assert (moved / "data.mdb").read_bytes() == damaged_bytes, "kept as found, for inspection"
        [line] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
        assert str(moved) in line and "empty" in line
        tier.put(key(2), b"b", FP)
        assert read(tier, key(2)) == b"b"
    finally:
        tier.close()
    reopened = NvmeTier(config)  # the fresh environment is whole: nothing more is moved
    assert reopened.usage().damaged_moved == 0 and read(reopened, key(2)) == b"b"
    reopened.close()


def test_unsynced_cache_from_an_earlier_boot_is_discarded(config: NvmeConfig) -> None:
    filled(config)
    make_unclean(config, dirty=True, boot_id="another-boot")
    tier = NvmeTier(config)
    assert list(tier.scan()) == []  # pages written after the last sync may be torn
    tier.close()


def test_unsynced_cache_from_this_boot_is_kept(config: NvmeConfig) -> None:
    filled(config)
    make_unclean(config, dirty=True)  # a killed process: the page cache still holds its commits
    tier = NvmeTier(config)
    assert read(tier, key(1)) == b"a" * 100
    tier.close()


def test_durable_mode_keeps_blocks_across_a_reboot_marker(config: NvmeConfig) -> None:
    config = replace(config, durability="durable")
    filled(config)
    make_unclean(config, dirty=True, boot_id="another-boot")
    tier = NvmeTier(config)
    assert read(tier, key(1)) == b"a" * 100
    tier.close()


# ---- a full map ----------------------------------------------------------------------------------


def test_map_full_drops_blocks_but_keeps_the_writer(config: NvmeConfig) -> None:
    # Capacity as large as the map: LMDB's own pages make the last block not fit.
    tier = NvmeTier(replace(config, capacity_bytes=4 * MiB, map_size_bytes=4 * MiB))
    for i in range(4):
        tier.put(key(i), payload(i, MiB - 1000), FP)
    tier.flush()
    assert tier.write_failures >= 1
    kept = [b.key for b in tier.scan()]
    assert 1 <= len(kept) < 4
    for k in kept:
        assert read(tier, k) == payload(int(k[-6:]), MiB - 1000)
    for k in kept:
        tier.delete(k)
    tier.put(key(9), b"still writing", FP)
    tier.flush()
    assert read(tier, key(9)) == b"still writing"
    tier.close()


def test_get_into_a_typed_view(tier: NvmeTier) -> None:
    data = bf16_payload(1, 8192)
    tier.put(key(1), data, FP)
    tier.flush()
    target = np.zeros(4096, dtype=np.uint16)
    assert tier.get_into(key(1), memoryview(target)) == 8192
    assert target.tobytes() == data


def test_concurrent_readers_while_the_writer_commits_and_buffers_recycle(config: NvmeConfig) -> None:
    # A small queue bound: put() copies land in few pooled buffers, reused all the time, while
    # readers copy out of queued blocks. Same size, different bytes: a reuse too early shows.
    tier = NvmeTier(replace(config, max_pending_bytes=200_000, batch_max_blocks=3))
    blocks = {i: payload(i, 20_000) for i in range(30)}
    stop = time.monotonic() + 1.0

    def reader(base: int) -> None:
        while time.monotonic() < stop:
            for i in range(base, base + 10):
                got = read(tier, key(i))
                assert got is None or got == blocks[i]

    with ThreadPoolExecutor(3) as pool:
        readers = [pool.submit(reader, n * 10) for n in range(3)]
        rounds = 0
        while time.monotonic() < stop:
            for i in range(30):
                tier.put(key(i), memoryview(bytearray(blocks[i])), FP)
            if rounds % 2:
                for i in range(rounds % 3, 30, 3):
                    tier.delete(key(i))
            rounds += 1
        for done in readers:
            done.result()  # re-raises a reader's failure here
    tier.flush()
    for i in range(30):
        assert read(tier, key(i)) in (None, blocks[i])
    tier.close()


def test_only_the_owner_can_read_the_files(tmp_path: Path) -> None:
    folder = tmp_path / "nvme"
    tier = NvmeTier(NvmeConfig(path=folder, capacity_bytes=1 << 24))
    try:
        tier.put(key(1), payload(1, 4096), b"\x01" * 32)
        tier.flush()
        assert folder.stat().st_mode & 0o777 == 0o700
        for path in folder.iterdir():
            assert path.stat().st_mode & 0o077 == 0, f"{path.name} is readable by others"
    finally:
        tier.close()
