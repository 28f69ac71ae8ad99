"""A report piped into a reader that stops early (`kvstore stats | head -3`, `| grep -q`) ends
quietly, as `ls | head` does, instead of with a Python traceback on the operator's terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KVSTORE = str(Path(sys.executable).parent / "kvstore")


@pytest.mark.parametrize("form", [[], ["--json"]], ids=["table", "json"])
def test_a_closed_pipe_ends_a_report_without_a_traceback(tmp_path: Path, form: list[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write fails
    try:
        done = subprocess.run(
            [KVSTORE, "config", "--data-dir", str(tmp_path), *form],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 1  # as rich ends its tables there, and Python's docs advise
