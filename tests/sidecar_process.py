"""``kvstore serve`` in a process of its own, for tests that freeze it (SIGSTOP: a hung
sidecar, which an in-process server cannot play) and thaw it again (SIGCONT).

    proc = start_serve(data_dir, {"dram.capacity_bytes": "64MiB"})
    try: ... freeze(proc) ... thaw(proc) ...
    finally: stop_serve(proc)          # thaws it first: a stopped process ignores SIGTERM

The server's output goes to ``data_dir/serve.log`` (a pipe nobody reads would fill and block it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvstore.client import connect
from kvstore.errors import Unavailable

START_S = 30.0


def start_serve(
    data_dir: str | Path,
    settings: dict[str, str],
    extra_args: Sequence[str] = (),
    command: Sequence[str] = (sys.executable, "-m", "kvstore.cli"),
) -> subprocess.Popen[bytes]:
    """Start ``kvstore serve`` on ``data_dir`` and wait until it answers on its Unix socket;
    ``command`` is how to run ``kvstore`` (the console script, for tests of that)."""
    data_dir = str(data_dir)
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    cmd = [*command, "serve", "--data-dir", data_dir, *extra_args]
    for key, value in {"server.metrics_address": "", "dram.prefault": "false", **settings}.items():
        cmd += ["--set", f"{key}={value}"]
    with open(Path(data_dir) / "serve.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    socket = Path(data_dir) / "kvstore.sock"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if socket.exists():
            try:
                with connect(f"unix://{socket}", timeout_s=2) as kv:
                    kv.stats()
                return proc
            except Unavailable:
                pass
        if proc.poll() is not None:
            tail = (Path(data_dir) / "serve.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"kvstore serve exited with {proc.returncode}:\n{tail}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"kvstore serve did not answer within {START_S:.0f} s")


def freeze(proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP, and wait until every thread has stopped: the signal takes effect
    asynchronously, and a thread still running could answer one more request."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + START_S
    tasks = Path(f"/proc/{proc.pid}/task")
    while not all(_stopped(task) for task in tasks.iterdir()):
        if time.monotonic() > deadline:
            raise AssertionError("kvstore serve did not stop on SIGSTOP")
        time.sleep(0.005)


def thaw(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGCONT)


def _stopped(task: Path) -> bool:
    try:
        status = (task / "status").read_text()
    except FileNotFoundError:  # the thread ended meanwhile
        return True
    return "State:\tT" in status


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    """Thaw (if stopped) and end the server; kill it when it does not drain in time."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
