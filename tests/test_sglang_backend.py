"""kvstore as SGLang HiCache's storage tier: ``tests/sglang_backend_cases.py`` run with pytest in
a process that imports SGLang 0.5.23 from ``.sglang/``, two SGLang engines end to end included, (``scripts/install_sglang.sh``) with the
test-only shims of ``tests/sglang_hicache/shims``; this process stays free of them, for the vLLM tests.

This test fails when SGLang is not installed (CI installs it: scripts/test.sh), and when any
case there fails or is skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.sglang_hicache.env import INSTALL, ROOT, SGLANG_VERSION, installed, sglang_env


@pytest.mark.timeout(900)
def test_the_hicache_backend_cases_pass_on_sglang() -> None:
    if not installed():
        pytest.fail(f"sglang {SGLANG_VERSION} is not installed in .sglang/: run {INSTALL}")
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        "tests/sglang_backend_cases.py",
    ]
    done = subprocess.run(argv, cwd=ROOT, env=sglang_env(), capture_output=True, text=True, timeout=840)
    report = done.stdout[-8000:]
    print(report)
    assert done.returncode == 0, f"the SGLang backend cases failed:\n{report}\n{done.stderr[-3000:]}"
    assert " skipped" not in report.splitlines()[-1], f"cases were skipped:\n{report}"
