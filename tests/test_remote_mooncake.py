"""The ``mooncake`` remote tier against a real Mooncake Store: ``tests/mooncake_contract.py``
run with pytest in a network namespace of its own (Mooncake's transfer engine listens on every
interface; there, loopback is the only one). This test fails when any test there fails or is
skipped, and is skipped only where the machine lacks what it needs (the mooncake extra, or
unprivileged network namespaces), saying which."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.mooncake_store import MooncakeUnavailable, netns_argv

ROOT = Path(__file__).resolve().parent.parent


def _netns_or_skip() -> list[str]:
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("the mooncake extra is not installed: pip install '.[mooncake]'")
    try:
        argv = netns_argv(["true"])
    except MooncakeUnavailable as exc:
        pytest.skip(str(exc))
    tried = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if tried.returncode != 0:
        pytest.skip(f"no network namespace for this user here: {tried.stderr.strip()}")
    return argv[:-1]  # the namespace prefix, without "true"


def test_the_remote_contract_holds_on_a_real_mooncake_store() -> None:
    prefix = _netns_or_skip()
    argv = [*prefix, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    argv += ["tests/mooncake_contract.py"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    # Mooncake's own logging (glog lines) goes to stderr; pytest's report to stdout
    report = done.stdout[-6000:]
    assert done.returncode == 0, f"the Mooncake contract failed:\n{report}\n{done.stderr[-3000:]}"
    assert " passed" in report and "skipped" not in report and "failed" not in report, report
    print("\n" + report.strip().splitlines()[-1])
