"""Assembling a store from settings: tier order, and an absent `hbm` tier said out loud."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.server.builder import open_store
from kvstore.server.config import load_settings


def test_default_tiers_are_dram_then_nvme(tmp_path: Path) -> None:
    store = open_store(load_settings(env={}, overrides={"data_dir": str(tmp_path), "dram.prefault": "false"}))
    try:
        assert [t.name for t in store.tiers] == ["dram", "nvme"]
        assert (tmp_path / "nvme").is_dir()
        assert any(line.startswith("hbm: disabled") for line in store.stats().absent_tiers)
    finally:
        store.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_hbm_without_cuda_is_absent_and_says_why(tmp_path: Path) -> None:
    settings = load_settings(
        env={}, overrides={"data_dir": str(tmp_path), "hbm.enabled": "true", "dram.prefault": "false"}
    )
    store = open_store(settings)
    try:
        assert [t.name for t in store.tiers] == ["dram", "nvme"]
        assert any("hbm" in line and "CUDA" in line for line in store.stats().absent_tiers)
    finally:
        store.close()


@pytest.mark.gpu
def test_hbm_with_cuda_comes_first(tmp_path: Path) -> None:
    settings = load_settings(
        env={},
        overrides={"data_dir": str(tmp_path), "hbm.enabled": "true", "hbm.capacity_bytes": "256MiB"},
    )
    store = open_store(settings)
    try:
        assert [t.name for t in store.tiers] == ["hbm", "dram", "nvme"]
    finally:
        store.close()
