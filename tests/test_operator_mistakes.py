"""Every operator mistake ends as the README promises: exactly one line on stderr, exit status 2,
no traceback (``-v`` adds it). Each case runs the real ``kvstore`` console script in a
subprocess, with no terminal on standard input, as a script or a CI job runs it; none of them
needs a server, because each is refused before one would be reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.server.datadir import remove_shm_files

KVSTORE = str(Path(sys.executable).parent / "kvstore")
# Should a mistake slip through and a server start, it is a small one, and it is cleaned up.
SMALL = ["--set", "dram.capacity_bytes=4MiB", "--set", "dram.page_bytes=1MiB", "--set", "dram.prefault=false"]


def run_kvstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full_env.update(env or {})
    return subprocess.run(
        [KVSTORE, *args],
        stdin=subprocess.DEVNULL,  # no terminal, whatever pytest itself was started from
        capture_output=True,
        text=True,
        env=full_env,
        timeout=20,
        check=False,
    )


def assert_one_line_exit_2(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


SERVE_MISTAKES = {
    "an arena smaller than one page": (
        ["--set", "dram.capacity_bytes=1MiB", "--set", "dram.page_bytes=32MiB"],
        ["dram.capacity_bytes", "smaller than one page"],
    ),
    "a page of zero bytes": (["--set", "dram.page_bytes=0"], ["dram.page_bytes", "positive"]),
    "a TCP port past 65535": (["--tcp", "127.0.0.1:99999"], ["server.tcp_address", "65535"]),
    "a TCP address without a port": (["--tcp", "localhost"], ["server.tcp_address", "HOST:PORT"]),
    "a metrics port past 65535": (
        ["--set", "server.metrics_address=127.0.0.1:70000"],
        ["server.metrics_address", "65535"],
    ),
    "a data port past 65535": (
        ["--set", "server.data_address=127.0.0.1:65536"],
        ["server.data_address", "65535"],
    ),
    "a remote node on port 0": (
        ["--set", "remote.backend=kvstore", "--set", "remote.nodes=127.0.0.1:0"],
        ["remote.nodes", "1 to 65535"],
    ),
    "a negative size": (["--set", "nvme.capacity_bytes=-5"], ["nvme.capacity_bytes", "not a size"]),
    "a negative duration": (["--set", "store.lease_ttl_s=-1"], ["store.lease_ttl_s", "not a duration"]),
    "a token table item without '='": (
        ["--set", "server.tokens=s3cret"],
        ["server.tokens", "item 1 has no '='"],
    ),
}


@pytest.mark.parametrize("mistake", SERVE_MISTAKES)
def test_a_serve_mistake_is_one_line_and_exit_2(mistake: str, tmp_path: Path) -> None:
    args, fragments = SERVE_MISTAKES[mistake]
    try:
        result = run_kvstore("serve", "--data-dir", str(tmp_path / "data"), *SMALL, *args)
    finally:
        remove_shm_files(tmp_path / "data")
    assert_one_line_exit_2(result, "kvstore serve:", *fragments)
    assert "s3cret" not in result.stderr, "a malformed token table must not echo its secrets"
    assert not (tmp_path / "data").exists(), "refused at parse time, before the data folder"


def test_negative_numbers_in_a_toml_file(tmp_path: Path) -> None:
    """TOML hands integers and floats over as numbers, past the text parsers of sizes and durations."""
    config = tmp_path / "kvstore.toml"
    for toml, fragment in (
        ("[nvme]\ncapacity_bytes = -1", "nvme.capacity_bytes"),
        ("[remote]\ntimeout_s = -0.5", "remote.timeout_s"),
    ):
        config.write_text(toml + "\n")
        try:
            result = run_kvstore("serve", "--config", str(config), "--data-dir", str(tmp_path / "d"), *SMALL)
        finally:
            remove_shm_files(tmp_path / "d")
        assert_one_line_exit_2(result, fragment, "must not be negative")


def test_a_malformed_tokens_variable_names_the_variable_in_serve_and_stats(tmp_path: Path) -> None:
    env = {"KVSTORE_SERVER_TOKENS": "tok-a=alpha,s3cret"}
    for command in ("serve", "stats"):
        result = run_kvstore(command, "--data-dir", str(tmp_path), env=env)
        assert_one_line_exit_2(result, f"kvstore {command}:", "KVSTORE_SERVER_TOKENS", "item 2")
        assert "s3cret" not in result.stderr


def test_invalidate_everything_without_a_terminal_asks_for_yes(tmp_path: Path) -> None:
    result = run_kvstore("invalidate", "--everything", "--data-dir", str(tmp_path))
    assert_one_line_exit_2(result, "kvstore invalidate:", "--yes")


def test_verbose_adds_the_traceback(tmp_path: Path) -> None:
    result = run_kvstore("invalidate", "--everything", "--data-dir", str(tmp_path), "-v")
    assert result.returncode == 2 and "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("kvstore invalidate:")


def test_route_mistakes(tmp_path: Path) -> None:
    backend = ["--backend", "http://127.0.0.1:1"]
    missing = run_kvstore("route", "--model", str(tmp_path / "no-such-model"), *backend)
    assert_one_line_exit_2(missing, "kvstore route:", "no-such-model", "config.json")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    partial = run_kvstore("route", "--model", str(tmp_path / "model"), *backend)
    assert_one_line_exit_2(partial, "kvstore route:", "config.json", "num_attention_heads")
    port = run_kvstore("route", "--model", str(tmp_path / "model"), *backend, "--listen", "127.0.0.1:99999")
    assert_one_line_exit_2(port, "kvstore route:", "--listen", "65535")


def test_salt_secret_mistakes(tmp_path: Path) -> None:
    route = ["route", "--model", str(tmp_path / "model"), "--backend", "http://127.0.0.1:1"]
    keys = tmp_path / "keys"
    keys.write_text("key-a=tenant-a\n")
    keys.chmod(0o600)
    unsalted = run_kvstore(*route, "--keys-file", str(keys))
    assert_one_line_exit_2(unsalted, "kvstore route:", "--salt-secret-file", "KVSTORE_ROUTE_SALT_SECRET")
    secret = tmp_path / "salt-secret"
    secret.write_text("a-salt-secret-long-enough-to-use\n")
    secret.chmod(0o644)
    readable = run_kvstore(*route, "--keys-file", str(keys), "--salt-secret-file", str(secret))
    assert_one_line_exit_2(readable, "kvstore route:", str(secret), "mode 644", "chmod 600")
    short = run_kvstore(*route, "--keys-file", str(keys), env={"KVSTORE_ROUTE_SALT_SECRET": "hunter2"})
    assert_one_line_exit_2(short, "kvstore route:", "KVSTORE_ROUTE_SALT_SECRET", "7 characters")
    assert "hunter2" not in short.stderr
