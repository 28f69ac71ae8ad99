"""The `hbm` tier: a device memory pool cut into fixed-size slots.

One tensor of ``capacity_bytes`` is allocated on the device at start and never resized. With
``device="cuda"`` it needs CUDA (TierUnavailable otherwise); the same logic runs on
``device="cpu"``, which is how it is tested on machines without a GPU. Host buffers passed to
``put`` and ``get_into`` are copied synchronously: the call returns when the bytes have moved.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tiers.base import BytesLike, Slot
from tiers.errors import TierUnavailable
from tiers.slab import SlabTier

# torch warns once that a read-only host buffer (bytes) could be written through the tensor; the
# tier only ever reads from it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True)
class HbmConfig:
    capacity_bytes: int = 1 << 30
    page_bytes: int = 32 << 20
    device: str = "cuda"


class HbmTier(SlabTier):
    """Slots in one device tensor. See the module docstring."""

    name = "hbm"

    def __init__(self, config: HbmConfig) -> None:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise TierUnavailable("the hbm tier needs CUDA, and torch sees no CUDA device")
        super().__init__(config.capacity_bytes, config.page_bytes)
        self.device = device
        self.pool = torch.empty(self._alloc.capacity_bytes, dtype=torch.uint8, device=device)

    def slot_tensor(self, slot: Slot) -> torch.Tensor:
        """The device bytes of ``slot``; valid until the slot is freed or the tier closes."""
        return self.pool[slot.offset : slot.offset + slot.size_bytes]

    def _write(self, slot: Slot, payload: BytesLike) -> None:
        if slot.size_bytes == 0:
            return
        self.slot_tensor(slot).copy_(torch.frombuffer(payload, dtype=torch.uint8))

    def _read(self, slot: Slot, out: memoryview) -> None:
        if slot.size_bytes == 0:
            return
        host = torch.frombuffer(out, dtype=torch.uint8)[: slot.size_bytes]
        host.copy_(self.slot_tensor(slot))

    def _release_region(self) -> None:
        del self.pool
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
