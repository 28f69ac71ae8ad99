"""SIGKILL a process writing to the nvme tier, reopen, and find no torn or missing block.

A child process opens the tier and writes batches forever: blocks of 4 KiB..1 MiB whose bytes
follow from their key, plus one delete per batch. After each batch it calls flush() and
prints the batch number. The parent kills it at a few points (right after a flush, and a few
milliseconds into the next batch, when a transaction is usually open), then reopens the folder
and checks that:

  * every block scan() reports reads back byte for byte as its key dictates (nothing torn);
  * every block of a flushed batch is there, unless a batch deleted it.

Then the next child continues in the same folder, so later rounds open a folder that has
been killed and reopened before.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tiers import TierKey, nvme_folder
from tiers.nvme import NvmeConfig, NvmeTier

ROOT = Path(__file__).resolve().parent.parent
FP = b"\x07" * 32
BLOCKS_PER_BATCH = 6
KILL_DELAYS_S = [0.0, 0.002, 0.005, 0.012, 0.03]  # after the k-th flushed batch is announced


def block_key(batch: int, i: int) -> TierKey:
    return TierKey(b"crash-%05d-%02d" % (batch, i))


def block_bytes(key: bytes) -> bytes:
    seed = xxhash.xxh64_intdigest(key)
    size = 4096 + seed % ((1 << 20) - 4096)
    return np.random.default_rng(seed).bytes(size)


def deleted_by(batch: int) -> TierKey | None:
    """Each batch after the first deletes one block of the batch before it."""
    return block_key(batch - 1, batch % BLOCKS_PER_BATCH) if batch > 0 else None


def config(folder: Path, durability: str) -> NvmeConfig:
    return NvmeConfig(
        path=folder,
        capacity_bytes=2 << 30,
        durability=durability,  # type: ignore[arg-type]
        sync_interval_s=0.02,
        batch_max_blocks=4,  # several transactions per batch: more places to be killed in
    )


def child_main(folder: str, durability: str, first_batch: int) -> None:
    """Runs in the child process until it is killed."""
    tier = NvmeTier(config(Path(folder), durability))
    print("open", flush=True)
    batch = first_batch
    while True:
        for i in range(BLOCKS_PER_BATCH):
            k = block_key(batch, i)
            tier.put(k, block_bytes(k), FP)
        gone = deleted_by(batch)
        if gone is not None:
            tier.delete(gone)
        tier.flush()
        print(f"flushed {batch}", flush=True)
        batch += 1


def spawn(
    folder: Path, durability: str, first_batch: int
) -> tuple[subprocess.Popen[str], queue.Queue[str], threading.Thread]:
    code = "import sys; from tests.test_nvme_crash import child_main; child_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder), durability, str(first_batch)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    return proc, lines, pumping


def run_and_kill(folder: Path, durability: str, first_batch: int, flushes: int, delay_s: float) -> int:
    """Let a child flush ``flushes`` batches, kill it ``delay_s`` later; the last flushed batch."""
    proc, lines, pumping = spawn(folder, durability, first_batch)
    last_flushed = first_batch - 1
    try:
        deadline = time.monotonic() + 20
        while last_flushed < first_batch + flushes - 1:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith("flushed "):
                last_flushed = int(line.split()[1])
        time.sleep(delay_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        pumping.join(10)  # the pipe is drained: every line the child wrote is queued
    while not lines.empty():  # a flush may have been announced before the signal landed
        line = lines.get_nowait()
        if line.startswith("flushed "):
            last_flushed = max(last_flushed, int(line.split()[1]))
    assert proc.returncode == -signal.SIGKILL
    assert (folder / nvme_folder.MARKER_FILE).exists()  # the next open knows it was not closed
    return last_flushed


def check_folder(folder: Path, durability: str, flushed: set[int], killed: set[int]) -> None:
    """Reopen after the kill: nothing torn, nothing flushed lost (``killed``: batches cut short)."""
    tier = NvmeTier(config(folder, durability))
    try:
        found = {b.key: b for b in tier.scan()}
        buf = bytearray(1 << 20)
        for k, block in found.items():
            assert block.fingerprint == FP
            n = tier.get_into(k, memoryview(buf))
            assert n is not None, f"{k!r} listed but unreadable"
            assert bytes(buf[:n]) == block_bytes(k), f"{k!r} torn"
        maybe_deleted = {deleted_by(b) for b in flushed | killed}
        for batch in flushed:
            for i in range(BLOCKS_PER_BATCH):
                k = block_key(batch, i)
                assert k in found or k in maybe_deleted, f"flushed block {k!r} lost"
        assert tier.usage().checksum_failures == 0
    finally:
        tier.close()


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["cache", "durable"])
def test_sigkill_mid_write_leaves_no_torn_or_lost_block(tmp_path: Path, durability: str) -> None:
    folder = tmp_path / "nvme"
    flushed: set[int] = set()
    killed: set[int] = set()
    first = 0
    for round_no, delay_s in enumerate(KILL_DELAYS_S):
        last = run_and_kill(folder, durability, first, flushes=2 + round_no, delay_s=delay_s)
        flushed |= set(range(first, last + 1))
        killed.add(last + 1)
        check_folder(folder, durability, flushed, killed)
        first = last + 2  # batch last + 1 may be partly on disk: leave its numbers alone
