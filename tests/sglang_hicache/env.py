"""Where SGLang lives for the tests: ``.sglang/`` (scripts/install_sglang.sh) and the test-only
shims beside this file, put on the PYTHONPATH of the processes that run SGLang only, never of
the main pytest process (its vLLM tests must not see triton or the torchvision stand-in)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".sglang"
SHIMS = Path(__file__).resolve().parent / "shims"
SGLANG_VERSION = "0.5.23"  # the shims and the controller calls the tests make are this release's
INSTALL = "scripts/install_sglang.sh (scripts/test.sh runs it)"


def installed() -> bool:
    return (SITE / "sglang").is_dir() and (SITE / f"sglang-{SGLANG_VERSION}.dist-info").is_dir()


def sglang_env() -> dict[str, str]:
    """The environment of a process that imports SGLang: the repository, .sglang, the shims;
    .venv's bin first on PATH (torch compiles SGLang's page hash with its ninja)."""
    env = dict(os.environ)
    paths = [str(ROOT), str(SITE), str(SHIMS), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env
