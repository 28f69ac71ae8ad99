"""Factories for every tier, shared by the contract suite and the store tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tiers import Tier, TierKey
from tiers.dram import DramConfig, DramTier
from tiers.hbm import HbmConfig, HbmTier

TierFactory = Callable[[Path, int], Tier]
PAGE = 1 << 20


def read(tier: Tier, k: TierKey) -> bytes | None:
    """A block's bytes read back through ``get_into``, or None when the tier lacks it."""
    size = tier.size_of(k)
    if size is None:
        return None
    buf = bytearray(size)
    n = tier.get_into(k, memoryview(buf))
    return None if n is None else bytes(buf[:n])


def make_dram(folder: Path, capacity_bytes: int) -> Tier:
    return DramTier(DramConfig(capacity_bytes=capacity_bytes, page_bytes=PAGE, prefault=False))


def make_hbm_cpu(folder: Path, capacity_bytes: int) -> Tier:
    return HbmTier(HbmConfig(capacity_bytes=capacity_bytes, page_bytes=PAGE, device="cpu"))


def make_hbm_cuda(folder: Path, capacity_bytes: int) -> Tier:
    return HbmTier(HbmConfig(capacity_bytes=capacity_bytes, page_bytes=PAGE, device="cuda"))


def make_nvme(folder: Path, capacity_bytes: int) -> Tier:
    from tiers.nvme import NvmeConfig, NvmeTier

    return NvmeTier(NvmeConfig(path=str(folder / "nvme"), capacity_bytes=capacity_bytes))


def make_nvme_zstd(folder: Path, capacity_bytes: int) -> Tier:
    from tiers.base import Codec
    from tiers.nvme import NvmeConfig, NvmeTier

    return NvmeTier(
        NvmeConfig(path=str(folder / "nvme"), capacity_bytes=capacity_bytes, codec=Codec.ZSTD_BYTEPLANE)
    )


def make_nvme_encrypted(folder: Path, capacity_bytes: int) -> Tier:
    from tiers.base import Codec
    from tiers.cipher import BlockCipher
    from tiers.nvme import NvmeConfig, NvmeTier

    cipher = BlockCipher(folder / "keys", lambda key: bytes(key[:1]).hex())
    return NvmeTier(
        NvmeConfig(path=str(folder / "nvme"), capacity_bytes=capacity_bytes, codec=Codec.ZSTD_BYTEPLANE),
        cipher=cipher,
    )


ALL_TIERS = [
    pytest.param(make_dram, id="dram"),
    pytest.param(make_hbm_cpu, id="hbm-cpu"),
    pytest.param(make_hbm_cuda, id="hbm-cuda", marks=pytest.mark.gpu),
    pytest.param(make_nvme, id="nvme"),
    pytest.param(make_nvme_zstd, id="nvme-zstd"),
    pytest.param(make_nvme_encrypted, id="nvme-zstd-aesgcm"),
]

__all__ = ["ALL_TIERS", "PAGE", "TierFactory", "make_dram", "make_hbm_cpu", "make_nvme", "torch"]
