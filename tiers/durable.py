"""Durable changes to a folder's entries.

    fsync_dir(folder)   makes a rename, link or removal in ``folder`` durable

Syncing a file makes its bytes durable, not its name: after a crash a file renamed or linked
into place may be missing, and a removed one may be back, until its folder is synced too.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
