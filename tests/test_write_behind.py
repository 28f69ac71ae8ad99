"""Write-behind (``store.write_behind``): new blocks reach nvme on a thread soon after they are
stored, bounded, and a full queue drops instead of blocking a put."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from kvstore.store import StoreConfig, TieredStore, tier_key
from kvstore.store.write_behind import WriteBehind
from tests.test_store_restart import BLOCK, A, chain, data
from tiers.dram import DramConfig, DramTier
from tiers.nvme import NvmeConfig, NvmeTier


def test_a_full_queue_drops_and_never_blocks() -> None:
    gate = threading.Event()
    copied: list[int] = []

    def slow_copy(items: Sequence[int]) -> None:
        gate.wait(10)
        copied.extend(items)

    wb: WriteBehind[int] = WriteBehind(slow_copy, max_bytes=3 * 100)
    try:
        accepted = [wb.offer(i, 100) for i in range(6)]  # the first is being copied, 3 wait
        assert accepted.count(False) >= 2 and accepted[:3] == [True, True, True]
        gate.set()
        assert wb.drain(10)
        assert copied == [i for i, ok in enumerate(accepted) if ok]
    finally:
        gate.set()
        wb.close()


def test_batches_take_what_is_queued_up_to_the_batch_size() -> None:
    gate = threading.Event()
    batches: list[list[int]] = []

    def copy(items: Sequence[int]) -> None:
        gate.wait(10)
        batches.append(list(items))

    wb: WriteBehind[int] = WriteBehind(copy, max_bytes=100 * 10, batch=4)
    try:
        assert all(wb.offer(i, 10) for i in range(10))  # 0 is taken alone, 1..9 wait
        gate.set()
        assert wb.drain(10)
        assert [x for b in batches for x in b] == list(range(10))  # in order, each once
        assert max(len(b) for b in batches) == 4 and len(batches) <= 4
    finally:
        gate.set()
        wb.close()


def test_new_blocks_reach_nvme_without_a_demotion(tmp_path: Path) -> None:
    dram = DramTier(DramConfig(capacity_bytes=16 * BLOCK, page_bytes=BLOCK, prefault=False))
    nvme = NvmeTier(NvmeConfig(path=tmp_path / "nvme", capacity_bytes=64 * BLOCK))
    store = TieredStore([dram, nvme], StoreConfig(write_behind=True))
    try:
        keys = chain(6, "wb")
        store.put(A, keys, [data(k) for k in keys])
        assert store._write_behind is not None and store._write_behind.drain(10)
        assert nvme.usage().blocks == 6 and dram.usage().blocks == 6  # copied, not moved
        assert store.stats().counters["write_behind_blocks"] == 6
        for k in keys:
            out = memoryview(bytearray(BLOCK))
            assert nvme.get_into(tier_key(A, k), out) == BLOCK and bytes(out) == data(k)
        store.delete(A, keys[:2])
        assert store.stats().blocks == 4
    finally:
        store.close()


def test_off_by_default_in_the_store_config() -> None:
    assert StoreConfig().write_behind is False
