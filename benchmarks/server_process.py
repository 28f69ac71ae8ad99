"""``kvstore serve`` in a child process of its own, for the benchmarks and the tests: the server
as it is deployed, and one a test can freeze (SIGSTOP: a hung sidecar, which an in-process
server cannot play) and thaw (SIGCONT) again.

    server = ServerProcess({"dram.capacity_bytes": "64MiB"})   # a private folder in /tmp
    try:
        with connect(server.unix) as kv: ...
        server.freeze(); ...; server.thaw()
        server.restart()                                       # same folder: nvme kept
    finally:
        server.stop()                                          # drains; returns the exit status

``settings`` are ``--set`` overrides (``section.field`` to value); metrics are off unless they
name an address. The server's output goes to ``<data_dir>/serve.log`` (a pipe nobody reads would
fill and block it); a server that does not answer within START_S raises with the log's tail.
A folder the helper made is removed by ``stop``, with any arena a killed server left behind;
a folder the caller passed is left as the server left it.

Not for use from several threads at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.ports import free_port
from kvstore.client import connect
from kvstore.errors import Unavailable
from kvstore.server.datadir import remove_shm_files

START_S = 60.0  # until the server answers on its Unix socket
STOP_S = 60.0  # for a drain, before the server is killed
KVSTORE = (sys.executable, "-m", "kvstore")


class ServerProcess:
    def __init__(
        self,
        settings: Mapping[str, str] | None = None,
        data_dir: str | Path | None = None,
        *,
        tcp: bool = False,
        extra_args: Sequence[str] = (),
        command: Sequence[str] = KVSTORE,
    ) -> None:
        """Start the server and wait until it answers. ``tcp``: also listen on a free port of
        127.0.0.1 (``self.tcp``); ``command``: how to run ``kvstore`` (the console script, for
        tests of that)."""
        self._owns_folder = data_dir is None
        # A short folder: Unix socket paths are limited to about 100 bytes.
        self.data_dir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp") if data_dir is None else data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.settings = {"server.metrics_address": "", **(settings or {})}
        self.unix = f"unix://{self.data_dir / 'kvstore.sock'}"
        self.tcp = f"127.0.0.1:{free_port()}" if tcp else ""
        self._extra_args = [*(("--tcp", self.tcp) if tcp else ()), *extra_args]
        self._command = list(command)
        self.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> None:
        """Start (again, after ``kill``) on the same folder and wait until it answers."""
        cmd = [*self._command, "serve", "--data-dir", str(self.data_dir), *self._extra_args]
        for key, value in self.settings.items():
            cmd += ["--set", f"{key}={value}"]
        with open(self.data_dir / "serve.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        socket_path = self.data_dir / "kvstore.sock"
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if socket_path.exists():
                try:
                    with connect(self.unix, timeout_s=2) as kv:
                        kv.stats()
                    return
                except Unavailable:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with {self.proc.returncode}:\n{self._log_tail()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"kvstore serve did not answer within {START_S:.0f} s:\n{self._log_tail()}")

    def restart(self, settings: Mapping[str, str] | None = None) -> None:
        """A clean stop and a start on the same folder (dram empty after it, nvme holding all),
        with ``settings`` changed."""
        self._terminate()
        self.settings.update(settings or {})
        self.start()

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread has stopped: the signal takes effect
        asynchronously, and a thread still running could answer one more request."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + START_S
        tasks = Path(f"/proc/{self.pid}/task")
        while not all(_stopped(task) for task in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError("kvstore serve did not stop on SIGSTOP")
            time.sleep(0.005)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: nothing of the server's runs; its arena stays in /dev/shm for the next start."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> int:
        """Thaw (a stopped process ignores SIGTERM) and drain; killed when the drain takes longer
        than STOP_S. Returns the exit status (0 after a clean drain)."""
        code = self._terminate()
        if self._owns_folder:
            remove_shm_files(self.data_dir)  # a killed server's arena, had it been killed last
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return code

    def _terminate(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # its threads' stacks into the log
                    os.kill(self.pid, signal.SIGUSR1)
                time.sleep(1.0)
                self.kill()
                tail = self._log_tail(30000)  # the stacks of every thread
                print(f"kvstore serve did not drain within {STOP_S:.0f} s; killed:\n{tail}", file=sys.stderr)
        return self.proc.returncode

    def _log_tail(self, chars: int = 3000) -> str:
        return (self.data_dir / "serve.log").read_text(errors="replace")[-chars:]


def _stopped(task: Path) -> bool:
    try:
        status = (task / "status").read_text()
    except FileNotFoundError:  # the thread ended meanwhile
        return True
    return "State:\tT" in status
