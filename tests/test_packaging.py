"""kvstore installs next to an engine without touching it: in this environment (torch and vLLM
already installed, as in a vLLM image) pip would install kvstore and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_installing_into_an_engine_environment_changes_nothing_else(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--disable-pip-version-check",
            "--report",
            str(report),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["kvstore"], f"pip would also install or replace {installs}"


def test_matplotlib_is_an_extra_not_a_requirement() -> None:
    from importlib.metadata import requires

    required = [r for r in requires("kvstore") or [] if "extra ==" not in r]
    assert not any(r.startswith("matplotlib") for r in required)
    assert not any(r.replace(" ", "").startswith("torch==") for r in required), required
