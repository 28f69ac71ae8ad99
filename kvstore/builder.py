"""Assemble a tiered store from ``Settings``: the one place that knows the tier order."""

from __future__ import annotations

from kvstore.config import CODECS, Settings
from kvstore.store import TieredStore
from tiers import Tier, TierUnavailable
from tiers.dram import DramConfig, DramTier


def build_tiers(settings: Settings) -> tuple[list[Tier], list[str]]:
    """The configured tiers, fastest first, and a line for each configured tier that is absent."""
    tiers: list[Tier] = []
    absent: list[str] = []
    if settings.hbm.enabled:
        from tiers.hbm import HbmConfig, HbmTier

        try:
            tiers.append(
                HbmTier(HbmConfig(settings.hbm.capacity_bytes, settings.hbm.page_bytes, settings.hbm.device))
            )
        except TierUnavailable as exc:
            absent.append(f"hbm: {exc}")
    else:
        absent.append("hbm: disabled in the configuration ([hbm] enabled = false)")
    d = settings.dram
    tiers.append(DramTier(DramConfig(d.capacity_bytes, d.page_bytes, None, d.prefault, d.pin_with_cuda)))
    if settings.nvme.enabled:
        from tiers.nvme import NvmeConfig, NvmeTier

        n = settings.nvme
        tiers.append(
            NvmeTier(
                NvmeConfig(
                    path=settings.nvme_path,
                    capacity_bytes=n.capacity_bytes,
                    durability=n.durability,
                    sync_interval_s=n.sync_interval_s,
                    codec=CODECS[n.codec],
                    zstd_level=n.zstd_level,
                )
            )
        )
    else:
        absent.append("nvme: disabled in the configuration ([nvme] enabled = false)")
    throttles = {"hbm": settings.hbm.throttle_bytes_per_s, "dram": d.throttle_bytes_per_s}
    throttles["nvme"] = settings.nvme.throttle_bytes_per_s
    for tier in tiers:
        tier.throttle_bytes_per_s = float(throttles.get(tier.name, 0))
    return tiers, absent


def open_store(settings: Settings) -> TieredStore:
    """A store over the configured tiers; the persistent ones are indexed from disk."""
    tiers, absent = build_tiers(settings)
    store = TieredStore(tiers, settings.store, absent_tiers=absent)
    return store
