"""The peer harness without the peers: nothing here installs Redis, Mooncake or LMCache.

A fake peer (a worker script over an in-memory dict, run with this interpreter) goes through the
real install fast path, worker protocol, timing loop, deadline and process-group cleanup.
"""

from __future__ import annotations

import json
import os
import py_compile
import socket
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.peers import (
    PEERS,
    Installed,
    PeerFigures,
    PeerUnavailable,
    Workload,
    install_peer,
    measure_peer,
    parse_worker_output,
    specs,
)
from benchmarks.peers.install import MARKER, _marker, install_spec
from benchmarks.peers.process import run_in_group
from benchmarks.peers.specs import WORKERS, PeerSpec
from benchmarks.peers.workers.peerlib import EXISTS_KEYS, parse_args

FIGURES = {
    "put_gbps": 1.5,
    "get_gbps": 2.5,
    "exists64_p50_ms": 0.1,
    "exists64_p99_ms": 0.4,
    "client": "fake-client 1.0",
    "notes": "in memory",
}
TINY = Workload(block_bytes=4096, blocks=8, rounds=2, exists_calls=5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it is dead for our purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


# --- the worker's output ---------------------------------------------------------------------


def test_figures_line_after_noise_is_parsed() -> None:
    out = "loading...\n{not json\n" + json.dumps(FIGURES) + "\n"
    got = parse_worker_output("fake", out, 0)
    assert got == PeerFigures(peer="fake", **FIGURES)  # type: ignore[arg-type]


def test_unavailable_line_carries_the_workers_reason() -> None:
    out = json.dumps({"unavailable": "redis-server is not installed: apt-get install -y redis-server"})
    got = parse_worker_output("redis", out, 0)
    assert got == PeerUnavailable("redis", "redis-server is not installed: apt-get install -y redis-server")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("put_gbps", None),
        ("get_gbps", "fast"),
        ("exists64_p99_ms", float("nan")),
        ("put_gbps", -1.0),
        ("client", 3),
        ("put_gbps", True),
    ],
)
def test_invalid_figures_name_the_field(field: str, value: object) -> None:
    doc = dict(FIGURES, **{field: value})
    got = parse_worker_output("fake", json.dumps(doc), 0)
    assert isinstance(got, PeerUnavailable)
    assert field in got.reason


def test_crash_without_figures_names_status_and_last_log_line(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("Traceback (most recent call last):\nModuleNotFoundError: No module named 'redis'\n")
    got = parse_worker_output("redis", "", 1, log)
    assert isinstance(got, PeerUnavailable)
    assert "status 1" in got.reason
    assert "No module named 'redis'" in got.reason
    assert str(log) in got.reason


# --- the workload ----------------------------------------------------------------------------


def test_workload_round_trips_through_the_worker_flags(tmp_path: Path) -> None:
    workload, workdir = parse_args([*TINY.argv(), f"--workdir={tmp_path}"])
    assert workload == TINY
    assert workdir == tmp_path


def test_workload_blocks_are_distinct_deterministic_and_exists_keys_cycle() -> None:
    data = TINY.source_bytes()
    assert len(data) == TINY.total_bytes
    assert data == TINY.source_bytes()
    blocks = {data[i * TINY.block_bytes : (i + 1) * TINY.block_bytes] for i in range(TINY.blocks)}
    assert len(blocks) == TINY.blocks
    keys = TINY.exists_keys()
    assert len(keys) == EXISTS_KEYS
    assert set(keys) == set(TINY.keys())


@pytest.mark.parametrize("kwargs", [{"block_bytes": 1000}, {"blocks": 0}, {"rounds": 0}])
def test_workload_rejects_nonsense(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Workload(**kwargs)


# --- running commands in a group -------------------------------------------------------------


def test_deadline_ends_the_command_and_everything_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pidfile}; sleep 60"
    start = time.monotonic()
    done = run_in_group(["sh", "-c", script], timeout_s=1.0, log_path=tmp_path / "log")
    assert done.timed_out
    assert time.monotonic() - start < 10
    assert _wait_gone(int(pidfile.read_text()))


def test_a_finished_command_leaves_no_background_process(tmp_path: Path) -> None:
    pidfile = tmp_path / "straggler.pid"
    script = f"sleep 60 & echo $! > {pidfile}; echo done"
    done = run_in_group(["sh", "-c", script], timeout_s=30.0, log_path=tmp_path / "log")
    assert (done.returncode, done.stdout, done.timed_out) == (0, "done\n", False)
    assert _wait_gone(int(pidfile.read_text()))


# --- installing ------------------------------------------------------------------------------


def test_unknown_peer_is_unavailable_with_the_known_names() -> None:
    got = install_peer("memcached")
    assert isinstance(got, PeerUnavailable)
    assert all(name in got.reason for name in PEERS)


def test_impossible_install_returns_a_reason(tmp_path: Path) -> None:
    spec = PeerSpec("broken", apt=(), pip_steps=(("anything",),), worker=WORKERS / "redis_worker.py")
    got = install_spec(spec, tmp_path, python=str(tmp_path / "no-such-python"))
    assert isinstance(got, PeerUnavailable)
    assert "cannot install broken" in got.reason
    assert "no-such-python" in got.reason


def test_missing_system_package_without_root_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    spec = PeerSpec("sys", apt=("kvstore-no-such-package",), pip_steps=(), worker=WORKERS / "redis_worker.py")
    got = install_spec(spec, tmp_path)
    assert isinstance(got, PeerUnavailable)
    assert "kvstore-no-such-package" in got.reason


def _fake_peer(root: Path, name: str, worker_body: str) -> PeerSpec:
    """A peer already 'installed' in ``root`` whose interpreter is this one."""
    worker = root / f"{name}_worker.py"
    root.mkdir(parents=True, exist_ok=True)
    worker.write_text(textwrap.dedent(worker_body))
    spec = PeerSpec(name, apt=(), pip_steps=(("fake==1",),), worker=worker)
    (root / name / "bin").mkdir(parents=True)
    spec.python(root).symlink_to(sys.executable)
    (root / name / MARKER).write_text(json.dumps(_marker(spec)))
    return spec


def test_installed_peer_is_recognised_without_running_anything(tmp_path: Path) -> None:
    spec = _fake_peer(tmp_path, "fake", "")
    got = install_spec(spec, tmp_path)
    assert isinstance(got, Installed)
    assert not got.fresh
    assert got.seconds < 1.0


# --- measuring through a fake worker ---------------------------------------------------------

_PRELUDE = f"""
import sys, time
sys.path.insert(0, {str(WORKERS)!r})
from peerlib import PeerFailure, measure, worker_main
"""

DICT_WORKER = (
    _PRELUDE
    + """
class DictOps:
    def __init__(self, workload):
        self.w, self.store, self.got = workload, {}, {}
        self.src = workload.source_bytes()
        self.keys = workload.keys()
    def clear(self): self.store.clear()
    def put_all(self):
        b = self.w.block_bytes
        for i, k in enumerate(self.keys): self.store[k] = self.src[i * b : (i + 1) * b]
    def get_all(self): self.got = {k: self.store[k] for k in self.keys}
    def check(self):
        if b"".join(self.got[k] for k in self.keys) != self.src: raise PeerFailure("bytes differ")
    def exists64(self): [k in self.store for k in self.w.exists_keys()]

def run(workload, workdir):
    print("chatter a library prints on stdout")
    figures = measure(workload, DictOps(workload))
    return dict(figures, client="dict", notes="in this process")

sys.exit(worker_main(run))
"""
)


def test_fake_peer_is_measured_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "peers"
    monkeypatch.setitem(specs.SPECS, "fake", _fake_peer(root, "fake", DICT_WORKER))
    got = measure_peer("fake", TINY, tmp_path / "work", root=root, timeout_s=60)
    assert isinstance(got, PeerFigures), got
    assert got.client == "dict"
    assert got.put_gbps > 0 and got.get_gbps > 0
    assert 0 < got.exists64_p50_ms <= got.exists64_p99_ms
    assert "chatter" in (tmp_path / "work" / "fake" / "worker.log").read_text()


def test_worker_failure_reason_is_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = _PRELUDE + "def run(w, d): raise PeerFailure('server exited: port in use')\nworker_main(run)\n"
    root = tmp_path / "peers"
    monkeypatch.setitem(specs.SPECS, "fail", _fake_peer(root, "fail", body))
    got = measure_peer("fail", TINY, tmp_path / "work", root=root, timeout_s=60)
    assert got == PeerUnavailable("fail", "server exited: port in use")


def test_hung_worker_is_stopped_with_its_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "server.pid"
    body = (
        _PRELUDE
        + f"""
import subprocess
server = subprocess.Popen(["sleep", "600"])
open({str(pidfile)!r}, "w").write(str(server.pid))
time.sleep(600)
"""
    )
    root = tmp_path / "peers"
    monkeypatch.setitem(specs.SPECS, "hang", _fake_peer(root, "hang", body))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the default workdir goes
    start = time.monotonic()
    got = measure_peer("hang", TINY, root=root, timeout_s=2)
    assert isinstance(got, PeerUnavailable)
    assert "did not finish within 2 s" in got.reason
    kept = next(tmp_path.glob("kvstore-peer-hang-*"))  # logs kept after a failure, and named
    assert str(kept) in got.reason
    assert time.monotonic() - start < 15
    assert _wait_gone(int(pidfile.read_text()))


def test_crashing_worker_reports_its_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "peers"
    monkeypatch.setitem(specs.SPECS, "crash", _fake_peer(root, "crash", "import kvstore_no_such_client\n"))
    got = measure_peer("crash", TINY, tmp_path / "work", root=root, timeout_s=60)
    assert isinstance(got, PeerUnavailable)
    assert "status 1" in got.reason
    assert "No module named 'kvstore_no_such_client'" in got.reason


@pytest.mark.skipif(
    [name for _, name in socket.if_nameindex()] == ["lo"], reason="this host has only a loopback interface"
)
def test_mooncake_worker_refuses_a_shared_network_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its transfer engine listens on every interface: outside a private namespace it must not start."""
    root = tmp_path / "peers"
    real = specs.SPECS["mooncake"]
    fake = _fake_peer(root, "mooncake", "")
    no_netns = PeerSpec("mooncake", apt=(), pip_steps=fake.pip_steps, worker=real.worker, netns=False)
    monkeypatch.setitem(specs.SPECS, "mooncake", no_netns)
    got = measure_peer("mooncake", TINY, tmp_path / "work", root=root, timeout_s=60)
    assert isinstance(got, PeerUnavailable)
    assert "private network namespace" in got.reason


@pytest.mark.parametrize("name", PEERS)
def test_real_workers_compile(name: str) -> None:
    py_compile.compile(str(specs.SPECS[name].worker), doraise=True)
