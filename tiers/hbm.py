"""The `hbm` tier: a device memory pool cut into fixed-size slots.

One tensor of ``capacity_bytes`` is allocated on the device at start and never resized. With
``device="cuda"`` it needs CUDA (TierUnavailable otherwise); the same logic runs on
``device="cpu"``, which is how it is tested on machines without a GPU. Host buffers passed to
``put`` and ``get_into`` are copied synchronously: the call returns when the bytes have moved.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiers.base import BytesLike, Slot
from tiers.errors import TierUnavailable
from tiers.slab import SlabTier
from tiers.slab_alloc import check_pool

if TYPE_CHECKING:
    import torch

# torch warns once that a read-only host buffer (bytes) could be written through the tensor; the
# tier only ever reads from it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True)
class HbmConfig:
    """A GPU memory pool tier above the arena (CUDA only; off unless enabled). Declared without
    torch, which the tier imports when it is built: a server without it never loads torch."""

    enabled: bool = False  # needs CUDA; the store logs why it is absent
    capacity_bytes: int = 4 << 30  # the pool's size
    page_bytes: int = 32 << 20  # the pool's page
    device: str = "cuda"  # torch device of the pool
    throttle_bytes_per_s: int = 0  # benchmarks only: emulate a slower tier; 0 = off

    def __post_init__(self) -> None:
        if self.enabled:
            check_pool(self.capacity_bytes, self.page_bytes, "hbm.")


class HbmTier(SlabTier):
    """Slots in one device tensor. See the module docstring."""

    name = "hbm"

    def __init__(self, config: HbmConfig) -> None:
        import torch

        self._torch = torch
        self.config = config
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
            return None
        torch = self._torch
        self.slot_tensor(slot).copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return None  # device memory: no checksum

    def _read(self, slot: Slot, out: memoryview) -> None:
        if slot.size_bytes == 0:
            return
        torch = self._torch
        host = torch.frombuffer(out, dtype=torch.uint8)[: slot.size_bytes]
        host.copy_(self.slot_tensor(slot))

    def _release_region(self) -> None:
        del self.pool
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()
