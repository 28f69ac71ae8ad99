"""An operator's first hour, run as an operator runs it: the `kvstore` console script in a
subprocess. Every mistake ends with one line on stderr naming what is wrong and what to do, a
non-zero exit and no traceback; the environment variables the help names work; no arena
outlives its server, whatever way the server ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import block_keys
from kvstore.server.datadir import ARENA_ID_FILE, remove_shm_files
from kvstore.server.metrics_http import DEFAULT_ADDRESS
from tests.service_fixtures import MODEL, Served
from tests.service_fixtures import served as served  # the fixture

KVSTORE = str(Path(sys.executable).parent / "kvstore")
SMALL = [
    "--set",
    "dram.capacity_bytes=4MiB",
    "--set",
    "dram.page_bytes=1MiB",
    "--set",
    "nvme.capacity_bytes=64MiB",
]
SHM = Path("/dev/shm")


def run(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full_env.update(env or {})
    return subprocess.run(
        [KVSTORE, *args], capture_output=True, text=True, env=full_env, timeout=timeout_s, check=False
    )


def assert_one_clear_line(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The command failed, without a traceback, and its last stderr line says all of ``fragments``."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, last
    return last


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvop-", dir="/tmp"))  # short: Unix socket paths are short
    try:
        yield path
    finally:
        for data_dir in [path, *path.iterdir()]:
            if data_dir.is_dir():
                remove_shm_files(data_dir)
        shutil.rmtree(path, ignore_errors=True)


def shm_files_of(data_dir: Path) -> list[str]:
    """The data folder's files in /dev/shm: arenas and their journals."""
    if not (data_dir / ARENA_ID_FILE).exists():
        return []
    folder_id = (data_dir / ARENA_ID_FILE).read_text().strip()
    return sorted(name for name in os.listdir(SHM) if name.startswith(f"kvstore-{folder_id}-"))


def arenas_of(data_dir: Path) -> list[str]:
    return [name for name in shm_files_of(data_dir) if "." not in name]


def start_serve(data_dir: Path, *extra: str) -> ServerProcess:
    settings = {
        "dram.capacity_bytes": "4MiB",
        "dram.page_bytes": "1MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "64MiB",
    }
    return ServerProcess(settings, data_dir, extra_args=extra, command=[KVSTORE])


# ----------------------------------------------------------------- the command itself


def test_version_and_python_dash_m() -> None:
    from kvstore import __version__

    assert run("--version").stdout.strip() == f"kvstore {__version__}"
    module = subprocess.run(
        [sys.executable, "-m", "kvstore", "--version"], capture_output=True, text=True, check=False
    )
    assert module.returncode == 0 and module.stdout.strip() == f"kvstore {__version__}"


# ----------------------------------------------------------------- configuration mistakes


def test_a_toml_syntax_error_names_the_file(folder: Path) -> None:
    bad = folder / "kvstore.toml"
    bad.write_text("[dram\ncapacity_bytes = 1\n")
    assert_one_clear_line(run("serve", "--config", str(bad)), str(bad), "not valid TOML")


def test_a_missing_config_file(folder: Path) -> None:
    assert_one_clear_line(run("serve", "--config", str(folder / "nope.toml")), "nope.toml", "does not exist")


def test_a_data_dir_under_a_file(folder: Path) -> None:
    (folder / "afile").write_text("")
    assert_one_clear_line(
        run("serve", "--data-dir", str(folder / "afile" / "sub")), "data_dir", "is a file", "--data-dir"
    )


def test_a_bad_size_names_its_setting_and_durations_take_units(folder: Path) -> None:
    assert_one_clear_line(
        run("serve", "--data-dir", str(folder), "--set", "dram.capacity_bytes=lots"),
        "dram.capacity_bytes",
        "not a size",
    )
    assert_one_clear_line(
        run("serve", "--data-dir", str(folder), "--set", "store.lease_ttl_s=soon"),
        "store.lease_ttl_s",
        "not a duration",
    )
    assert not list(folder.glob("kvstore.lock")), "a refused setting must not touch the data folder"


def test_unknown_kvstore_variables_warn_once_and_are_ignored(folder: Path) -> None:
    env = {"KVSTORE_DATA_DIR": str(folder), "KVSTORE_NO_SUCH_THING": "1", "KVSTORE_DRAM_CAPACITY": "1GiB"}
    result = run("stats", env=env)  # no server: it still gets as far as connecting
    warnings = [line for line in result.stderr.splitlines() if "ignoring" in line]
    assert len(warnings) == 1, result.stderr
    assert "KVSTORE_NO_SUCH_THING" in warnings[0] and "KVSTORE_DRAM_CAPACITY" in warnings[0]
    assert_one_clear_line(result, "cannot reach")


def test_stats_without_a_server_says_where_it_looked(folder: Path) -> None:
    assert_one_clear_line(
        run("stats", "--data-dir", str(folder)), str(folder / "kvstore.sock"), "kvstore serve"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    assert_one_clear_line(
        run("stats", "--address", f"127.0.0.1:{port}"), f"127.0.0.1:{port}", "connection refused"
    )


def test_the_token_comes_from_the_environment(served: Served) -> None:
    ok = run("stats", "--address", served.tcp, "--json", env={"KVSTORE_TOKEN": "tok-a"})
    assert ok.returncode == 0, ok.stderr
    assert '"tenant": "tenant-a"' in ok.stdout
    assert "ignoring" not in ok.stderr
    refused = run("stats", "--address", served.tcp, env={"KVSTORE_TOKEN": "wrong"})
    assert_one_clear_line(refused, "kvstore stats:")


# ----------------------------------------------------------------- ports, folders, memory


def test_ports_in_use_and_a_second_server_on_one_folder(folder: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        tcp = run(
            "serve",
            "--data-dir",
            str(folder / "a"),
            *SMALL,
            "--set",
            "server.metrics_address=",
            "--tcp",
            f"127.0.0.1:{port}",
        )
        assert_one_clear_line(tcp, f"127.0.0.1:{port}", "server.tcp_address")
        metrics = run(
            "serve",
            "--data-dir",
            str(folder / "a"),
            *SMALL,
            "--set",
            f"server.metrics_address=127.0.0.1:{port}",
        )
        assert_one_clear_line(metrics, "metrics", "server.metrics_address")
    assert arenas_of(folder / "a") == [], "a failed start left its arena behind"
    first = start_serve(folder / "b")
    try:
        second = run("serve", "--data-dir", str(folder / "b"), *SMALL, "--set", "server.metrics_address=")
        assert_one_clear_line(second, "in use by another kvstore process", f"pid {first.pid}")
        assert len(arenas_of(folder / "b")) == 1
        with connect(f"unix://{folder / 'b' / 'kvstore.sock'}") as kv:  # the first is unharmed
            assert kv.stats()["tiers"]
    finally:
        assert first.stop() == 0
    assert shm_files_of(folder / "b") == []


def test_a_second_server_on_a_folder_in_use_says_only_that(folder: Path) -> None:
    """The folder's lock is taken before the metrics port: the refusal is the one line the second
    server prints, not a warning that the first server holds the default metrics port too."""
    first = start_serve(folder)
    try:
        host, port = DEFAULT_ADDRESS.rsplit(":", 1)
        with socket.socket() as held:  # the default metrics port taken, as the first server's would be
            with contextlib.suppress(OSError):  # taken already: by another kvstore on this host
                held.bind((host, int(port)))
                held.listen(1)
            second = run("serve", "--data-dir", str(folder), *SMALL)  # metrics_address=auto
        assert second.returncode == 2, second
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert "in use by another kvstore process" in lines[0] and f"pid {first.pid}" in lines[0]
    finally:
        assert first.stop() == 0


def test_an_arena_larger_than_dev_shm_is_refused_before_anything_is_faulted(folder: Path) -> None:
    free = shutil.disk_usage(SHM).free
    result = run("serve", "--data-dir", str(folder), "--set", f"dram.capacity_bytes={free + (1 << 30)}")
    last = assert_one_clear_line(result, "/dev/shm", "dram.capacity_bytes", "--shm-size")
    assert "needs" in last and "free" in last
    assert arenas_of(folder) == []


def test_a_killed_servers_arena_is_reclaimed_by_the_next_start(folder: Path) -> None:
    server = start_serve(folder)
    leftover = arenas_of(folder)
    assert len(leftover) == 1
    server.kill()  # SIGKILL: nothing of ours runs
    assert arenas_of(folder) == leftover, "the kernel keeps a dead server's arena"
    restarted = start_serve(folder)
    try:
        now = arenas_of(folder)
        assert len(now) == 1 and now != leftover
        assert not (SHM / leftover[0]).exists()
    finally:
        assert restarted.stop() == 0
    assert shm_files_of(folder) == [], "arena and journal go with a clean stop"


# ----------------------------------------------------------------- stats and invalidation


def test_stats_shows_version_uptime_addresses_hit_ratio_and_models(folder: Path) -> None:
    server = start_serve(folder, "--tcp", "127.0.0.1:0")
    try:
        address = f"unix://{folder / 'kvstore.sock'}"
        with connect(address) as kv:
            fp = kv.register(MODEL)
            keys = block_keys(fp, list(range(8 * MODEL.tokens_per_block)), MODEL.tokens_per_block)
            kv.write(fp, keys[:4], [bytes([i]) * MODEL.block_bytes for i in range(4)])
            assert kv.lookup(fp, keys) == 4  # 4 of 8 blocks: half the tokens asked for
        table = run("stats", "--address", address)
        assert table.returncode == 0, table.stderr
        from kvstore import __version__

        out = table.stdout
        assert f"kvstore {__version__} up" in out
        assert "token hit ratio 50.0% of 128 tokens" in out
        assert address in out and "127.0.0.1:" in out
        assert "[hbm] enabled = false" in out  # rich must not eat it as markup
        assert fp.hex() in out and MODEL.model_id in out

        log_text = (folder / "serve.log").read_text()
        assert "hbm" in log_text and not [
            line for line in log_text.splitlines() if "WARNING" in line and "hbm" in line
        ], "an hbm tier off by default is not worth a warning at every start"
        prefix = run("invalidate", "--address", address, "--fingerprint", fp.hex()[:10])
        assert prefix.returncode == 0, prefix.stderr
        assert f"removed 4 blocks of {fp.hex()} ({MODEL.model_id})" in prefix.stdout
        with connect(address) as kv:
            kv.write(fp, keys[:2], [b"x" * MODEL.block_bytes] * 2)
        by_model = run("invalidate", "--address", address, "--model", MODEL.model_id)
        assert "removed 2 blocks" in by_model.stdout, by_model.stderr
        assert_one_clear_line(run("invalidate", "--address", address, "--model", "no/such"), "no/such")
        assert_one_clear_line(run("invalidate", "--address", address, "--fingerprint", "zz"), "hex")
        assert_one_clear_line(
            run("invalidate", "--address", address, "--fingerprint", "ab"), "`kvstore stats`"
        )
    finally:
        assert server.stop() == 0


def test_models_are_named_after_a_restart(folder: Path) -> None:
    server = start_serve(folder)
    address = f"unix://{folder / 'kvstore.sock'}"
    try:
        with connect(address) as kv:
            fp = kv.register(MODEL)
            keys = block_keys(fp, list(range(2 * MODEL.tokens_per_block)), MODEL.tokens_per_block)
            kv.write(fp, keys, [b"y" * MODEL.block_bytes] * 2)
    finally:
        assert server.stop() == 0  # spills the blocks to nvme
    server = start_serve(folder)
    try:
        with connect(address) as kv:
            models = kv.stats()["fingerprints"]
        assert [(m["fingerprint"], m["model_id"], m["blocks"]) for m in models] == [
            (fp.hex(), MODEL.model_id, 2)
        ]
        assert (folder / "models.json").stat().st_mode & 0o777 == 0o600
    finally:
        assert server.stop() == 0


def test_tokens_come_from_a_private_file(folder: Path) -> None:
    tokens = folder / "tokens"
    tokens.write_text("# tenants\nsecret-a = tenant-a\n")
    tokens.chmod(0o644)
    refused = run("serve", "--data-dir", str(folder / "d"), *SMALL, "--set", f"server.tokens_file={tokens}")
    assert_one_clear_line(refused, "tokens_file", "chmod 600")
    tokens.chmod(0o600)
    server = start_serve(folder / "d", "--tcp", "127.0.0.1:0", "--set", f"server.tokens_file={tokens}")
    try:
        with connect(f"unix://{folder / 'd' / 'kvstore.sock'}") as kv:
            tcp = next(a for a in kv.stats()["addresses"] if a.startswith("127.0.0.1:"))
        ok = run("stats", "--address", tcp, "--json", env={"KVSTORE_TOKEN": "secret-a"})
        assert ok.returncode == 0 and '"tenant": "tenant-a"' in ok.stdout, ok.stderr
    finally:
        assert server.stop() == 0
