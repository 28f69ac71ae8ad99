"""kvstore installs next to an engine without touching it: in this environment (torch and vLLM
already installed, as in a vLLM image) pip would install kvstore and nothing else."""

from __future__ import annotations

import json
import re
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


# The optional features' libraries (kvstore/extras.py): none is a requirement, and the server,
# the CLI and the client run with every one of them missing.
OPTIONAL = (
    "torch",
    "cryptography",
    "zstandard",
    "redis",
    "mooncake",
    "matplotlib",
    "aiohttp",
    "transformers",
)

WITHOUT_OPTIONAL = """
import sys
OPTIONAL, folder = set(sys.argv[1].split(",")), sys.argv[2]

class Missing:  # as if none of them were installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
import kvstore
from kvstore.cli.main import main
from kvstore.server.config import load_settings
from kvstore.server.serve import start_server

small = {"data_dir": folder, "dram.capacity_bytes": "4MiB", "dram.page_bytes": "1MiB",
         "dram.prefault": "false", "nvme.capacity_bytes": "64MiB", "server.metrics_address": ""}
server = start_server(load_settings(env={}, overrides=small))
try:
    identity = kvstore.ModelIdentity("pkg/tiny", "ab" * 32, num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=16)
    with kvstore.connect(server.unix_address) as kv:
        fp = kv.register(identity)
        keys = kvstore.block_keys(fp, list(range(2 * identity.tokens_per_block)), identity.tokens_per_block)
        blocks = [bytes([i + 1]) * identity.block_bytes for i in range(len(keys))]
        kv.put(fp, keys, blocks)
        assert [bytes(b) for b in kv.get(fp, keys)] == blocks
    assert main(["stats", "--address", server.unix_address, "--json"]) == 0
finally:
    server.stop()
for setting, extra in (("nvme.encryption_keys_dir=" + folder + "/keys", "encryption"), ("nvme.codec=zstd", "zstd"),
                       ("remote.backend=redis", "redis"), ("hbm.enabled=true", "engine")):
    args = ["serve", "--data-dir", folder + "/refused", "--set", setting, "--set", "remote.nodes=127.0.0.1:7000"]
    assert main(args) == 2, setting
loaded = sorted(name for name in OPTIONAL if name in sys.modules)
assert not loaded, loaded
print("OK")
"""


def test_the_requirements_hold_no_optional_library() -> None:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    required = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
    assert not required & set(OPTIONAL), sorted(required & set(OPTIONAL))
    extras = " ".join(" ".join(v) for v in project["optional-dependencies"].values())
    for name in OPTIONAL:  # each is reachable through an extra (mooncake's package is named so)
        assert name in extras or name == "mooncake", name


def test_serve_stats_and_the_client_run_without_any_optional_library(tmp_path: Path) -> None:
    """In one process where importing any optional library fails, as in a plain install: a server
    stores and serves a put, `kvstore stats` answers, and each optional feature configured is
    refused with exit 2 (scripts/check_installs.sh does the same from a clean `pip install .`)."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPTIONAL, ",".join(OPTIONAL), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )
    for extra in ("encryption", "zstd", "redis", "engine"):
        assert f"pip install 'kvstore[{extra}]'" in done.stderr, done.stderr[-4000:]
