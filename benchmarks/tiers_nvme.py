"""``kvstore bench tiers``' nvme rows: the nvme tier's writes and reads against raw LMDB with the
brief's best flags, plain, compressed and encrypted at rest."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import lmdb

from benchmarks.common import Result, gbps, interleaved, size_label
from benchmarks.tiers_working import BATCH_BLOCKS, COPY_ROUNDS, FP, MiB, Working
from tiers import Codec
from tiers.cipher import BlockCipher  # cryptography itself is imported when one is made
from tiers.nvme import NvmeConfig, NvmeTier


class _RawLmdb:
    """Raw LMDB write and read of the same values, best flags: the nvme rows' reference.

    ``read`` keeps its environment open across rounds, as the tier keeps its own: a fresh
    environment maps the file again and faults every page in on the first read (measured here
    5.8 against 14.6 GB/s at 32 MiB, 19.4 against 24.4 at 256 KiB), which would handicap the
    reference of the warm row. ``read_cold`` reopens after dropping the page
    cache, as the tier's cold read does."""

    def __init__(self, path: Path, w: Working) -> None:
        self.path, self.w = path, w
        self.map_size = 2 * w.total + 64 * MiB
        self.env: lmdb.Environment | None = None

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def write(self) -> float:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        env = lmdb.open(
            str(self.path),
            map_size=self.map_size,
            writemap=True,
            map_async=True,
            sync=False,
            metasync=False,
            max_dbs=2,
        )
        db = env.open_db(b"raw")
        w = self.w
        start = time.perf_counter()
        for first in range(0, w.count, BATCH_BLOCKS):
            with env.begin(write=True, db=db) as txn:
                for i in range(first, min(first + BATCH_BLOCKS, w.count)):
                    txn.put(w.keys[i], w.block(i))
        env.sync(True)
        elapsed = time.perf_counter() - start
        env.close()
        return elapsed

    def read(self) -> float:
        if self.env is None:
            self.env = lmdb.open(str(self.path), map_size=self.map_size, writemap=True, max_dbs=2)
        env, dst, keys = self.env, self.w.dst_view, self.w.keys
        db = env.open_db(b"raw")
        start = time.perf_counter()
        for first in range(0, len(keys), BATCH_BLOCKS):
            with env.begin(db=db, buffers=True) as txn:
                for k in keys[first : first + BATCH_BLOCKS]:
                    view = txn.get(k)
                    if view is None:
                        raise RuntimeError("raw LMDB bench: a value written a moment ago is missing")
                    dst[: len(view)] = view
        return time.perf_counter() - start

    def read_cold(self) -> float:
        self.close()
        drop_page_cache(self.path)
        return self.read()


class _NvmeRounds:
    """Timed rounds on one nvme tier config: ``write`` a fresh tier (incl. the final sync),
    ``read`` it back warm, ``read_cold`` after reopening with the page cache dropped."""

    def __init__(self, config: NvmeConfig, w: Working, cipher: BlockCipher | None = None) -> None:
        self.config, self.w, self.cipher = config, w, cipher
        self.tier: NvmeTier | None = None

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def write(self) -> float:
        self.close()
        shutil.rmtree(self.config.path, ignore_errors=True)
        tier = self.tier = NvmeTier(self.config, self.cipher)
        start = time.perf_counter()
        for i, k in enumerate(self.w.keys):
            tier.put(k, self.w.block(i), FP)
        tier.flush()
        return time.perf_counter() - start

    def read(self) -> float:
        """Every block into the warm block buffer, BATCH_BLOCKS a call, as the store reads a
        request's blocks of one tier (``get_into_many``)."""
        tier, keys = self.tier, self.w.keys
        assert tier is not None
        outs = [self.w.dst_view] * BATCH_BLOCKS
        sizes: list[int | None] = []
        start = time.perf_counter()
        for first in range(0, len(keys), BATCH_BLOCKS):
            batch = keys[first : first + BATCH_BLOCKS]
            tier.get_into_many(batch, outs[: len(batch)], sizes)
        elapsed = time.perf_counter() - start
        if None in sizes:
            raise RuntimeError("nvme bench: a block written a moment ago is missing")
        return elapsed

    def read_cold(self) -> float:
        self.close()
        drop_page_cache(Path(self.config.path))
        self.tier = NvmeTier(self.config, self.cipher)
        return self.read()


def bench_nvme(w: Working, rounds: int, folder: Path, codec: Codec = Codec.NONE) -> list[Result]:
    raw = _RawLmdb(folder / "raw", w)
    config = NvmeConfig(
        path=str(folder / "tier"),
        capacity_bytes=w.total + 64 * MiB,
        batch_max_blocks=BATCH_BLOCKS,
        codec=codec,
    )
    tier = _NvmeRounds(config, w)

    try:
        write_s, ref_write = interleaved(tier.write, raw.write, 3 * rounds)
        cold_s, ref_cold = interleaved(tier.read_cold, raw.read_cold, rounds)
        raw.read()  # warm both maps equally before the warm rounds
        tier.read()
        read_s, ref_read = interleaved(tier.read, raw.read, COPY_ROUNDS * rounds)  # as the gets
    finally:
        tier.close()
        raw.close()
    label = size_label(w.size)
    name = "nvme" if codec is Codec.NONE else f"nvme[{codec.name.lower()}]"
    reads = (
        f"{BATCH_BLOCKS} blocks a read txn (the tier's get_into_many, as the store reads); "
        "the tier verifies xxh3-64 on every read, raw LMDB does not"
    )
    return [
        Result(
            f"{name} write {label}",
            gbps(w.total, write_s),
            "GB/s",
            "raw LMDB",
            gbps(w.total, ref_write),
            ">= 0.7",
            "incl. final sync",
        ),
        Result(
            f"{name} read cold {label}",
            gbps(w.total, cold_s),
            "GB/s",
            "raw LMDB",
            gbps(w.total, ref_cold),
            ">= 0.8",
            "page cache dropped (fadvise) before each round; " + reads,
        ),
        Result(
            f"{name} read warm {label}",
            gbps(w.total, read_s),
            "GB/s",
            "raw LMDB",
            gbps(w.total, ref_read),
            ">= 0.85",
            "page cache warm; " + reads,
        ),
    ]


def bench_nvme_encryption(w: Working, rounds: int, folder: Path) -> list[Result]:
    """nvme with AES-256-GCM at rest (``nvme.encryption_keys_dir``) against nvme without it,
    the same blocks, interleaved: write incl. the final sync, and warm reads."""
    plain = NvmeConfig(
        path=str(folder / "plain"), capacity_bytes=w.total + 64 * MiB, batch_max_blocks=BATCH_BLOCKS
    )
    sealed = NvmeConfig(
        path=str(folder / "sealed"), capacity_bytes=w.total + 64 * MiB, batch_max_blocks=BATCH_BLOCKS
    )
    encrypted = _NvmeRounds(sealed, w, BlockCipher(folder / "keys", lambda key: "bench"))
    clear = _NvmeRounds(plain, w)
    try:
        write_s, ref_write = interleaved(encrypted.write, clear.write, rounds)
        encrypted.read(), clear.read()  # warm both maps
        read_s, ref_read = interleaved(encrypted.read, clear.read, rounds)
    finally:
        encrypted.close()
        clear.close()
    label = size_label(w.size)
    note = "AES-256-GCM (cryptography/OpenSSL), one key per tenant; xxh3 and the GCM tag both checked"
    return [
        Result(
            f"nvme write {label}, encrypted",
            gbps(w.total, write_s),
            "GB/s",
            "nvme plain",
            gbps(w.total, ref_write),
            note=note,
        ),
        Result(
            f"nvme read warm {label}, encrypted",
            gbps(w.total, read_s),
            "GB/s",
            "nvme plain",
            gbps(w.total, ref_read),
            note=note,
        ),
    ]


def drop_page_cache(folder: Path) -> None:
    """Evict a closed LMDB environment's files from the page cache (no privileges needed)."""
    for path in folder.glob("*.mdb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
