from __future__ import annotations

import pytest
import torch

# the end-of-run report of files left in /dev/shm (hooks run where conftest defines them)
from tests.shm_leftovers import pytest_sessionstart, pytest_terminal_summary

__all__ = ["pytest_sessionstart", "pytest_terminal_summary"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
