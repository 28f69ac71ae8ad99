"""A real Redis Cluster on 127.0.0.1 for tests and benchmarks: ``masters`` redis-server
processes in cluster mode (no persistence, no replicas), joined by ``redis-cli --cluster create``.

    with RedisClusterProcess(masters=3) as cluster:
        tier = RedisClusterTier(RedisConfig(nodes=cluster.nodes))
        ...
        cluster.stop_all()     # the whole cluster gone: what a dead shared store looks like

Needs Debian's ``redis-server`` and ``redis-cli`` (``apt-get install -y redis-server``; the test
command installs it). Each node's port and its cluster-bus port (port + 10000) are chosen free.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.ports import wait_port

START_TIMEOUT_S = 20.0


START_ATTEMPTS = 3


class _PortTaken(Exception):
    """A node exited at start: another process took its port first."""


class RedisUnavailable(RuntimeError):
    """redis-server or redis-cli is not installed."""


class RedisClusterProcess:
    def __init__(self, masters: int = 3) -> None:
        self.masters = masters
        self.nodes: tuple[str, ...] = ()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dir = ""

    def __enter__(self) -> RedisClusterProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the nodes and create the cluster. A free port can be taken by another process
        between the pick and the bind (the node then exits and ``wait_port`` meets the other
        listener): such a start is retried on fresh ports."""
        for attempt in range(START_ATTEMPTS):
            try:
                self._start_once()
                return
            except _PortTaken:
                if attempt + 1 == START_ATTEMPTS:
                    raise RuntimeError(f"redis nodes lost their ports {START_ATTEMPTS} times") from None

    def _start_once(self) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RedisUnavailable("redis-server is not installed: apt-get install -y redis-server")
        self._procs = []
        self._dir = tempfile.mkdtemp(prefix="kvs-redis-")
        ports = _free_ports(self.masters)
        try:
            for port in ports:
                folder = Path(self._dir) / str(port)
                folder.mkdir()
                argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
                argv += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
                argv += ["--save", "", "--appendonly", "no", "--dir", str(folder), "--protected-mode", "no"]
                log = open(folder / "redis.log", "wb")  # noqa: SIM115 - the process keeps it
                self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            for port in ports:
                wait_port(port, "redis-server", START_TIMEOUT_S)
            self.nodes = tuple(f"127.0.0.1:{port}" for port in ports)
            created = subprocess.run(
                [cli, "--cluster", "create", *self.nodes, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S,
                check=False,
            )
            if created.returncode != 0:
                time.sleep(0.2)
                if any(proc.poll() is not None for proc in self._procs):
                    raise _PortTaken
                raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout}{created.stderr}")
            self._wait_ok(cli, ports)
        except BaseException:
            self.close()
            raise

    def freeze(self) -> None:
        """SIGSTOP every node: the cluster hangs, connections open and nothing answers."""
        for proc in self._procs:
            proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        for proc in self._procs:
            proc.send_signal(signal.SIGCONT)

    def stop_all(self) -> None:
        """Kill every node (SIGKILL): the cluster is gone, its data with it."""
        self.thaw()  # a stopped process dies on SIGKILL too, but be sure wait() returns
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.wait()

    def close(self) -> None:
        self.stop_all()
        self._procs.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def _wait_ok(self, cli: str, ports: list[int]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for port in ports:
            while True:
                info = subprocess.run(
                    [cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, check=False
                ).stdout
                if "cluster_state:ok" in info:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis node {port} never reported cluster_state:ok: {info}")
                time.sleep(0.1)


def _free_ports(n: int) -> list[int]:
    """``n`` ports whose cluster-bus twins (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports
