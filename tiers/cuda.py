"""The CUDA-only pieces of the tiers, isolated so that CPU machines never import CUDA state.

Every function here answers "not available" rather than failing when torch has no CUDA or is
not installed.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    """False without torch too: the server runs without it (torch is the engine extra)."""
    try:
        import torch
    except ModuleNotFoundError:
        return False
    return bool(torch.cuda.is_available())


def pin_host_memory(address: int, size_bytes: int) -> bool:
    """Register host memory as pinned with CUDA so copies to the GPU run at full DMA speed.

    Returns whether it was registered; False without CUDA or when the driver refuses.
    """
    if not cuda_available():
        return False
    import torch

    # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one.
    runtime: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = runtime.cudaHostRegister(address, size_bytes, 1)
    if int(err) != 0:
        log.warning(
            "cudaHostRegister of %d B failed with CUDA error %s; copies will be pageable", size_bytes, err
        )
        return False
    return True


def unpin_host_memory(address: int) -> None:
    import torch

    runtime: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    runtime.cudaHostUnregister(address)
