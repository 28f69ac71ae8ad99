"""A real Mooncake Store on 127.0.0.1 for tests and benchmarks: its HTTP metadata server, its
master and one storage node (``mooncake_client``, which holds the segment blocks land in).

    with MooncakeStoreProcess(segment_mib=256) as store:
        tier = MooncakeTier(RemoteConfig(nodes=(store.master,), metadata_server=store.metadata_url))
        ...
        store.freeze()         # every process SIGSTOPped: a hung store
        store.stop_all()       # every process killed: a dead one

Must run in a private network namespace (``unshare --net --map-root-user``; ``in_private_netns``
says whether this process is in one, and ``bring_up_loopback`` makes its loopback usable): the
transfer engine listens on every interface whatever it is told, and here nothing may listen
beyond 127.0.0.1; in a namespace whose only interface is loopback, that is all there is. Every
address is 127.0.0.1, and ``MC_TCP_BIND_ADDRESS`` tells the transfer engine to advertise it.

Needs the ``mooncake`` extra (``mooncake-transfer-engine-non-cuda``, whose executables sit
beside the interpreter) and ``libibverbs1`` (the transfer engine links it even over TCP).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.ports import free_port, wait_port

START_TIMEOUT_S = 30.0


class MooncakeUnavailable(RuntimeError):
    """Mooncake's executables, its Python package, or a private network namespace is missing."""


def in_private_netns() -> bool:
    return all(name == "lo" for _, name in socket.if_nameindex())


def bring_up_loopback() -> None:
    ip = shutil.which("ip")
    if ip is None:
        raise MooncakeUnavailable("the ip command is missing: apt-get install -y iproute2")
    done = subprocess.run([ip, "link", "set", "lo", "up"], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise MooncakeUnavailable(f"cannot bring up loopback: {done.stderr.strip()}")


def netns_argv(argv: list[str]) -> list[str]:
    """``argv`` run in a network namespace of its own (as root, or mapped to root)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise MooncakeUnavailable("unshare is missing (util-linux)")
    return [unshare, "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), "--", *argv]


class MooncakeStoreProcess:
    def __init__(self, segment_mib: int = 256) -> None:
        self.segment_mib = segment_mib
        self.master = ""
        self.metadata_url = ""
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._dir = ""

    def __enter__(self) -> MooncakeStoreProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if not in_private_netns():
            raise MooncakeUnavailable("Mooncake Store runs here only in a private network namespace")
        bindir = Path(sys.executable).parent
        missing = [n for n in ("mooncake_master", "mooncake_client", "mooncake_http_metadata_server")]
        missing = [n for n in missing if not (bindir / n).exists()]
        if missing:
            raise MooncakeUnavailable(f"{', '.join(missing)} missing: pip install '.[mooncake]'")
        bring_up_loopback()
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        self._dir = tempfile.mkdtemp(prefix="kvs-mooncake-")
        meta_port, master_port, metrics_port, node_port = (free_port() for _ in range(4))
        self.metadata_url = f"http://127.0.0.1:{meta_port}/metadata"
        self.master = f"127.0.0.1:{master_port}"
        try:
            self._start(
                "metadata",
                [str(bindir / "mooncake_http_metadata_server"), "--host=127.0.0.1", f"--port={meta_port}"],
            )
            self._start(
                "master",
                [
                    str(bindir / "mooncake_master"),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={master_port}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={metrics_port}",
                    "--enable_metric_reporting=false",
                ],
            )
            wait_port(meta_port, "mooncake_http_metadata_server", START_TIMEOUT_S)
            wait_port(master_port, "mooncake_master", START_TIMEOUT_S)
            self._start(
                "node",
                [
                    str(bindir / "mooncake_client"),
                    "--host=127.0.0.1",
                    f"--port={node_port}",
                    f"--global_segment_size={self.segment_mib} MB",
                    f"--master_server_address={self.master}",
                    f"--metadata_server={self.metadata_url}",
                    "--protocol=tcp",
                ],
            )
            wait_port(node_port, "mooncake_client (the storage node)", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(Path(self._dir) / f"{name}.log", "wb")  # noqa: SIM115 - the process keeps it
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        """A plain ``MooncakeDistributedStore`` on this store (no segment of its own): what a
        test uses to look at, or tamper with, what a tier stored."""
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        code = raw.setup("127.0.0.1", self.metadata_url, 0, 16 << 20, "tcp", "", self.master)
        if code != 0:
            raise RuntimeError(f"a plain Mooncake client's setup answered {code}")
        try:
            yield raw
        finally:
            raw.close()

    def log_tail(self, name: str, nchars: int = 2000) -> str:
        return (Path(self._dir) / f"{name}.log").read_text(errors="replace")[-nchars:]

    def freeze(self) -> None:
        """SIGSTOP every process: connections stay open and nothing answers."""
        for proc in self._procs.values():
            proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        for proc in self._procs.values():
            proc.send_signal(signal.SIGCONT)

    def stop_all(self) -> None:
        """Kill every process (SIGKILL): the store is gone, its blocks with it."""
        self.thaw()
        for proc in self._procs.values():
            proc.kill()
        for proc in self._procs.values():
            proc.wait(10)

    def close(self) -> None:
        self.stop_all()
        self._procs.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""
