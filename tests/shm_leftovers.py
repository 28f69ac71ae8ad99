"""What a test run leaves in /dev/shm, reported at the end of the run (tests/conftest.py).

Tests remove what they and the servers and engines they start create (arenas and journals
``kvstore-*``, SGLang's ``sglang_loads_*`` and ``sgl_shm_*``, multiprocessing's named semaphores ``sem.mp-*``). A file of those families that
appeared during the run, is still there at its end and that no live process maps or holds open
is listed in a section of the summary. It is a report, not a failure: /dev/shm is shared by
every run on the machine, and another run's server killed on purpose (its arena kept for its
next start) looks the same from here. The SGLang harness asserts its own files are gone
(tests/sglang_backend_cases.py::_engine), by their exact paths.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
FAMILIES = ("kvstore-", "sglang_loads_", "sgl_shm_", "sem.mp-")
_at_start: set[str] = set()


def listing(families: tuple[str, ...] = FAMILIES) -> set[str]:
    try:
        return {name for name in os.listdir(SHM) if name.startswith(families)}
    except OSError:  # no /dev/shm: nothing to report
        return set()


def in_use() -> set[str]:
    """Names in /dev/shm some live process maps or holds open (a running server's arena)."""
    used: set[str] = set()
    prefix = f"{SHM}/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                used.update(line.split(prefix, 1)[1].split()[0] for line in maps if prefix in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target.removeprefix(prefix))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


def pytest_sessionstart(session: pytest.Session) -> None:
    _at_start.update(listing())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    new = listing() - _at_start
    left = sorted(new - in_use()) if new else []
    if not left:
        return
    terminalreporter.section("left in /dev/shm")
    terminalreporter.write_line(
        f"{len(left)} file(s) appeared during this run and no live process uses them (this run's, "
        "or another run's on this machine):"
    )
    for name in left:
        terminalreporter.write_line(f"  {SHM / name}")
