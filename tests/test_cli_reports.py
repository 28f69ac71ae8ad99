"""What the operator's commands report, run as an operator runs them (the `kvstore` console
script in a subprocess) against a real `kvstore serve`: every counter shown from the start,
open connections counted, ``--json`` on every reporting command, the effective configuration
with its sources and no secret in it, and ``kvstore bench service`` measuring a running server
without starting or installing anything."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from benchmarks.peers import specs
from benchmarks.peers.specs import WORKERS, PeerSpec
from benchmarks.server_process import ServerProcess
from benchmarks.service_peers import bench_peers, say_what_peers_need
from kvstore.cli.config_cmd import REDACTED, effective_settings
from kvstore.cli.main import build_parser
from kvstore.client import Client, connect
from kvstore.keys import block_keys
from kvstore.server.config import load_settings
from kvstore.server.stats import counter_names
from tests.service_fixtures import BLOCK, MODEL, process_settings

KVSTORE = str(Path(sys.executable).parent / "kvstore")
STORE_CODE = Path(__file__).resolve().parents[1] / "kvstore" / "store"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full_env.update(env or {})
    return subprocess.run(
        [KVSTORE, *args], capture_output=True, text=True, env=full_env, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # Room for the bench's 2 MiB blocks; the shared settings' tokens and admins otherwise.
    settings = process_settings(**{"dram.capacity_bytes": "32MiB", "dram.page_bytes": "4MiB"})
    server = ServerProcess(settings, tcp=True)
    try:
        yield server
    finally:
        server.stop()


def stats_json(server: ServerProcess, *extra: str) -> dict[str, Any]:
    done = run("stats", "--address", server.unix, "--json", *extra)
    assert done.returncode == 0, done.stderr
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def wait_for_connections(server: ServerProcess, listener: str, n: int) -> dict[str, Any]:
    """Stats once the server has seen connections open or close (their threads notice a close
    when the peer's end arrives, a moment after it)."""
    deadline = time.monotonic() + 10
    while True:
        stats = stats_json(server)
        if stats["connections"][listener] == n or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


# ----------------------------------------------------------------- stats


def test_stats_shows_counters_at_zero_and_counts_data_connections(server: ServerProcess) -> None:
    fp = MODEL.fingerprint()
    keys = block_keys(fp, list(range(32)), MODEL.tokens_per_block)
    clients = [Client(server.unix) for _ in range(3)]
    try:
        for kv in clients:
            kv.lookup(fp, keys)  # each opens its data-socket connection
        stats = wait_for_connections(server, "data socket", 3)
        assert stats["connections"]["data socket"] == 3
        assert stats["tenant_connections"]["local"] == 3
        assert stats["connections"]["grpc"] >= 1  # this command's own
        counters = stats["counters"]
        for never_counted in (
            "checksum_failures",
            "quota_rejections",
            "pace_timeouts",
            "evicted_nvme_blocks",
        ):
            assert counters[never_counted] == 0, never_counted
        table = run("stats", "--address", server.unix)
        assert table.returncode == 0, table.stderr
        assert re.search(r"checksum_failures\s*│\s*0\s", table.stdout), table.stdout
        assert "data socket 3" in table.stdout
        assert "local 3" in table.stdout
    finally:
        for kv in clients:
            kv.close()
    assert wait_for_connections(server, "data socket", 0)["connections"]["data socket"] == 0


def test_a_tenant_sees_its_own_data_connections_only(server: ServerProcess) -> None:
    fp = MODEL.fingerprint()
    with connect(server.tcp, token="tok-a") as kv:
        kv.lookup(fp, block_keys(fp, list(range(16)), MODEL.tokens_per_block))
        admin = wait_for_connections(server, "data port", 1)
        assert admin["tenant_connections"]["tenant-a"] == 1
        own = run("stats", "--address", server.tcp, "--json", env={"KVSTORE_TOKEN": "tok-a"})
        assert own.returncode == 0, own.stderr
        mine = json.loads(own.stdout)
        assert mine["connections"] == {}  # how busy the server is with others is not a tenant's to know
        assert mine["tenant_connections"] == {"tenant-a": 1}
        assert mine["counters"]["lookup_hit_blocks"] == 0
        assert "checksum_failures" not in mine["counters"]  # the store's, an admin's figure


def test_the_counters_shown_at_zero_are_every_counter_the_store_keeps() -> None:
    """Read off the store's code: a counter added there and not to kvstore.server.stats would be
    missing from `kvstore stats` until it first counts."""
    tiers = ("hbm", "dram", "nvme")
    found: set[str] = set()
    for path in STORE_CODE.glob("*.py"):
        for line in path.read_text().splitlines():
            if "counter" not in line and ".count(" not in line and "CopyDown(" not in line:
                continue
            for name in re.findall(r'"([a-z_{}.\[\]]+)"', line):
                if "{" in name:
                    if name == "remote_{k}":
                        continue  # the remote backend's own figures, present whenever it is
                    name = re.sub(r"\{[^}]*\}", "{}", name)
                    found.update(name.format(t) for t in tiers)
                elif name.endswith(("_blocks", "_slots", "s", "_written", "_unwritten")):
                    found.add(name)
    assert "put_blocks" in found and "evicted_nvme_blocks" in found  # the scan reads the code
    assert found - set(counter_names(tiers, remote=True)) == set()


# ----------------------------------------------------------------- --json


def test_every_reporting_command_takes_json() -> None:
    parser = build_parser()
    commands: dict[str, Any] = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[assignment]
    not_reports = {"serve", "route", "demo"}  # servers and a demonstration
    for name, sub in commands.items():
        if name in not_reports:
            continue
        groups = [sub] if name != "bench" else list(sub._actions[-1].choices.values())
        for command in groups:
            options = {o for a in command._actions for o in a.option_strings}
            if command.prog.endswith("bench calibrate"):
                assert "--out" in options  # what it reports is that JSON file
                continue
            assert "--json" in options, command.prog


def test_json_of_each_reporting_command_parses(server: ServerProcess) -> None:
    fp = MODEL.fingerprint()
    keys = block_keys(fp, list(range(4 * MODEL.tokens_per_block)), MODEL.tokens_per_block)
    with connect(server.unix) as kv:
        kv.register(MODEL)
        kv.put(fp, keys, [bytes(BLOCK)] * 4)
    address = ("--address", server.unix)
    demoted = json.loads(run("demote", *address, "--model", MODEL.model_id, "--json").stdout)
    assert demoted["tier"] == "dram" and demoted["moved"] == 4
    assert demoted["fingerprints"][0]["fingerprint"] == fp.hex()
    removed = json.loads(run("invalidate", *address, "--fingerprint", fp.hex()[:12], "--json").stdout)
    assert removed["removed"] == 4 and removed["fingerprints"][0]["model_id"] == MODEL.model_id
    with connect(server.unix) as kv:
        kv.put(fp, keys, [bytes(BLOCK)] * 4)
    everything = run("invalidate", *address, "--everything", "--json", "--tenant", "*")
    assert everything.returncode == 2 and everything.stdout == ""  # no answer given: refused, stdout clean
    everything = run("invalidate", *address, "--everything", "--yes", "--json")
    assert json.loads(everything.stdout) == {"removed": 4, "everything": True}
    shred = json.loads(run("shred", *address, "--tenant", "tenant-c", "--json").stdout)
    assert shred == {"tenant": "tenant-c", "removed": 0, "key_removed": False}
    audit = run("audit", "--data-dir", str(server.data_dir), "--json")
    records = json.loads(audit.stdout)["records"]
    assert {r["action"].split()[0] for r in records} >= {"invalidate", "demote", "shred"}
    assert isinstance(stats_json(server)["counters"], dict)
    config = json.loads(run("config", "--data-dir", str(server.data_dir), "--json").stdout)
    assert config["settings"]["data_dir"] == {"value": str(server.data_dir), "source": "flag"}


# ----------------------------------------------------------------- config


def test_config_shows_each_value_with_its_source_and_no_secret(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text(
        '[dram]\ncapacity_bytes = "2GiB"\n[server]\ntokens = {"sekrit-token-1" = "tenant-a"}\n'
        '[remote]\ntokens = {"t/tenant-a" = "sekrit-token-2"}\n'
    )
    env = {"KVSTORE_NVME_DURABILITY": "durable", "KVSTORE_SERVER_TCP_ADDRESS": "127.0.0.1:7070"}
    flags = ("--set", "server.workers=4", "--set", "server.tcp_address=127.0.0.1:7071")
    done = run("config", "--config", str(toml), *flags, "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert "sekrit" not in done.stdout
    settings = json.loads(done.stdout)["settings"]
    assert settings["dram.capacity_bytes"] == {"value": 2 << 30, "source": "file"}
    assert settings["nvme.durability"] == {"value": "durable", "source": "env"}
    assert settings["server.workers"] == {"value": 4, "source": "flag"}
    assert settings["server.tcp_address"] == {"value": "127.0.0.1:7071", "source": "flag"}  # flag over env
    assert settings["dram.page_bytes"]["source"] == "default"
    assert list(settings["server.tokens"]["value"].values()) == ["tenant-a"]  # the tenant, not its token
    assert settings["remote.tokens"]["value"] == {"t/tenant-a": REDACTED}
    # The loader's own answer, for every setting (the command shows what serve would run with).
    real = load_settings(
        toml, env=env, overrides={"server.workers": "4", "server.tcp_address": "127.0.0.1:7071"}
    )
    assert settings["server.admins"]["value"] == list(real.server.admins)
    assert settings["store.lease_ttl_s"]["value"] == real.store.lease_ttl_s
    table = run("config", "--config", str(toml), *flags, env=env)
    assert table.returncode == 0 and "sekrit" not in table.stdout + table.stderr
    assert re.search(r"nvme\.durability\s*│\s*durable\s*│\s*env", table.stdout), table.stdout


def test_config_redacts_every_setting_named_for_a_secret() -> None:
    """Secrets are found by name: a token, password or secret field added later is covered."""
    flags = {"server.tokens": "tok-one=a", "remote.tokens": "t/a=tok-two", "remote.username": "u"}
    rows = effective_settings(None, {}, flags)
    text = json.dumps([(name, str(value)) for name, value, _ in rows])
    assert "tok-one" not in text and "tok-two" not in text
    secret_named = [n for n, _, _ in rows if re.search(r"token|password|secret", n.rpartition(".")[2])]
    assert "server.tokens" in secret_named and "remote.tokens" in secret_named


def test_config_prints_every_unset_value_one_way() -> None:
    """None, "" and an empty list or table are all "not set": the table says (none) for each,
    never Python's None or a bare "", and --json keeps each value's own type."""
    table = run("config", env={"COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    cells = dict(re.findall(r"^│ (\S+)\s*│ (.*?)\s*│ \w+\s*│$", table.stdout, re.MULTILINE))
    assert len(cells) > 50, table.stdout
    assert not [n for n, v in cells.items() if v in ("None", '""', "[]", "{}", "")], cells
    for name in ("store.default_quota_bytes", "nvme.path", "server.tokens", "store.quota_bytes"):
        assert cells[name] == "(none)", (name, cells[name])
    settings = json.loads(run("config", "--json").stdout)["settings"]
    assert settings["store.default_quota_bytes"]["value"] is None
    assert settings["nvme.path"]["value"] == ""
    assert settings["server.tokens"]["value"] == {}


def test_config_names_a_bad_value_in_one_line(tmp_path: Path) -> None:
    done = run("config", "--set", "dram.capacity_bytes=lots")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "dram.capacity_bytes" in done.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------- bench a deployment


def test_bench_service_measures_a_running_server(server: ServerProcess, tmp_path: Path) -> None:
    before = stats_json(server)
    out = tmp_path / "bench.json"
    done = run("bench", "service", "--address", server.unix, "--quick", "--blocks", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["metric"]: r for r in json.loads(out.read_text())["results"]}
    for metric in (
        "lookup 64 keys p50",
        "remote put 2 MiB",
        "remote get 2 MiB (get_into)",
        "same-host write 2 MiB",
        "same-host read_into 2 MiB",
    ):
        assert rows[metric]["value"] > 0, rows[metric]
    assert "data socket" in rows["remote put 2 MiB"]["note"]
    after = stats_json(server)
    assert after["uptime_s"] > before["uptime_s"]  # the same server: none was started
    assert not [f for f in after["fingerprints"] if f["model_id"].startswith("kvstore-bench/")]
    over_tcp = run(
        "bench",
        "service",
        "--address",
        server.tcp,
        "--quick",
        "--blocks",
        "1",
        env={"KVSTORE_TOKEN": "tok-b"},
    )
    assert over_tcp.returncode == 0, over_tcp.stdout + over_tcp.stderr
    assert "remote get 2 MiB" in over_tcp.stdout and "same-host" not in over_tcp.stdout


def test_bench_service_installs_no_peer_without_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer missing a Debian package and its venv: without --install-peers nothing runs but
    dpkg-query (an apt-get on PATH records any call), and the row and the line before the run
    name what is missing and the flag. With the flag, apt-get is called: the test tells them apart."""
    calls = tmp_path / "apt-get-calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    (bin_dir / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    spec = PeerSpec(
        "fake",
        apt=("kvstore-no-such-package",),
        pip_steps=(("fake==1",),),
        worker=WORKERS / "redis_worker.py",
    )
    monkeypatch.setitem(specs.SPECS, "fake", spec)
    root = tmp_path / "peers"

    def ours() -> dict[str, float]:
        raise AssertionError("a peer that is not measured needs no pass of ours")

    said = io.StringIO()
    missing = say_what_peers_need(Console(file=said), install=False, names=("fake",), root=root)
    assert "kvstore-no-such-package" in missing["fake"][0]
    assert "--install-peers" in said.getvalue() and "kvstore-no-such-package" in said.getvalue()
    rows = bench_peers(ours, 1, 1, {}, Console(file=io.StringIO()), install=False, names=("fake",), root=root)
    assert rows[0].value is None
    assert "--install-peers" in rows[0].note and "kvstore-no-such-package" in rows[0].note
    assert not calls.exists() and not root.exists()  # nothing installed, nothing made
    if os.geteuid() != 0:
        pytest.skip("the install path calls apt-get as root only; this half needs root")
    rows = bench_peers(ours, 1, 1, {}, Console(file=io.StringIO()), install=True, names=("fake",), root=root)
    assert "update" in calls.read_text()  # with the flag, it does install
    assert rows[0].value is None


def test_bench_service_against_no_server_says_so_in_one_line() -> None:
    nowhere = run("bench", "service", "--address", "unix:///tmp/kvstore-no-such.sock", "--quick")
    assert nowhere.returncode == 2 and "Traceback" not in nowhere.stderr
    assert "cannot reach a kvstore server at unix:///tmp/kvstore-no-such.sock" in nowhere.stderr
    clash = run("bench", "service", "--address", "unix:///tmp/kvstore-no-such.sock", "--install-peers")
    assert clash.returncode == 2 and "--install-peers" in clash.stderr.strip().splitlines()[-1]
