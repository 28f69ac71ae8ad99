"""An nvme tier in a test's own folder, its blocks, and a gate that holds its writer thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest

from tiers import TierKey
from tiers.nvme import NvmeConfig, NvmeTier

FP = b"\x01" * 32
MiB = 1 << 20


def key(i: int) -> TierKey:
    return TierKey(b"block-%06d" % i)


def payload(i: int, size: int) -> bytes:
    return np.random.default_rng(i).bytes(size)


class WriterGate:
    """Holds the tier's writer thread before each commit until opened."""

    def __init__(self, tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        commit: Callable[[object], None] = tier._writer._commit  # type: ignore[assignment]

        def gated(batch: object) -> None:
            assert self.opened.wait(30), "gate never opened"
            commit(batch)

        monkeypatch.setattr(tier._writer, "_commit", gated)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def config(tmp_path: Path) -> NvmeConfig:
    return NvmeConfig(path=tmp_path / "nvme", capacity_bytes=64 * MiB)


def reopen(tier: NvmeTier, config: NvmeConfig) -> NvmeTier:
    tier.close()
    return NvmeTier(config)


def raw_env(config: NvmeConfig) -> lmdb.Environment:
    return lmdb.open(str(config.path), map_size=config.effective_map_size_bytes, max_dbs=2)
