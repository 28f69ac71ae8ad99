"""Mooncake Store worker: metadata server, master, one storage node and this client, all over TCP.

Must run inside a private network namespace (the harness starts it under ``unshare -n``): the
transfer engine listens on every interface whatever it is told, so here the only interface is
the namespace's own loopback, which this worker brings up. Every address given is 127.0.0.1, and
``MC_TCP_BIND_ADDRESS`` tells the transfer engine to advertise it (it refuses to start on a host
whose only address is loopback otherwise).

Processes: ``mooncake_http_metadata_server``, ``mooncake_master``, ``mooncake_client`` (the
storage node, which holds the global segment the blocks land in) and a
``MooncakeDistributedStore`` in this process that contributes no segment of its own. Client calls:
``batch_put_from`` / ``batch_get_into`` in batches of ``BATCH`` keys on buffers registered with
the transfer engine (no copies on the client side), and ``batch_is_exist`` for the existence check.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from benchmarks.peers.workers.peerlib import (
        Figures,
        MiB,
        PeerFailure,
        Servers,
        Workload,
        free_port,
        measure,
        worker_main,
    )
else:  # run as a script from its own folder, in the peer's interpreter
    from peerlib import Figures, MiB, PeerFailure, Servers, Workload, free_port, measure, worker_main

BATCH = 64
START_TIMEOUT_S = 30.0
LOCAL_BUFFER_BYTES = 64 * MiB


def _private_loopback() -> None:
    """Bring up loopback, after making sure this is a namespace with no other interface."""
    others = [name for _, name in socket.if_nameindex() if name != "lo"]
    if others:
        raise PeerFailure(
            "the Mooncake worker must run in a private network namespace (unshare -n), "
            f"but sees interfaces {others}"
        )
    ip = shutil.which("ip")
    if ip is None:
        raise PeerFailure("the ip command is missing: apt-get install -y iproute2")
    done = subprocess.run([ip, "link", "set", "lo", "up"], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise PeerFailure(f"cannot bring up loopback in the namespace: {done.stderr.strip()}")


class MooncakeStore(Protocol):
    """The calls used of ``mooncake.store.MooncakeDistributedStore`` (its binding has no types).
    Status codes: 0 is success, negative an error; ``batch_get_into`` answers bytes read."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def put_from(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def remove(self, key: str, force: bool) -> int: ...
    def remove_all(self, force: bool) -> int: ...
    def close(self) -> int: ...


class _Buffer:
    """Anonymous shared memory the transfer engine reads from or writes into directly."""

    def __init__(self, size: int) -> None:
        self.map = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.size = size


class MooncakeOps:
    def __init__(self, store: MooncakeStore, workload: Workload, src: _Buffer, dst: _Buffer) -> None:
        self.store = store
        self.w = workload
        self.keys = workload.keys()
        self.exists_keys = workload.exists_keys()
        self.src_ptrs = [src.addr + i * workload.block_bytes for i in range(workload.blocks)]
        self.dst_ptrs = [dst.addr + i * workload.block_bytes for i in range(workload.blocks)]
        self.src = src
        self.dst = dst

    def clear(self) -> None:
        self.store.remove_all(True)

    def put_all(self) -> None:
        size = self.w.block_bytes
        for s in range(0, self.w.blocks, BATCH):
            keys = self.keys[s : s + BATCH]
            codes = self.store.batch_put_from(keys, self.src_ptrs[s : s + BATCH], [size] * len(keys))
            if any(c != 0 for c in codes):
                raise PeerFailure(f"mooncake batch_put_from failed with codes {sorted(set(codes))}")

    def get_all(self) -> None:
        size = self.w.block_bytes
        for s in range(0, self.w.blocks, BATCH):
            keys = self.keys[s : s + BATCH]
            codes = self.store.batch_get_into(keys, self.dst_ptrs[s : s + BATCH], [size] * len(keys))
            if any(c != size for c in codes):
                raise PeerFailure(f"mooncake batch_get_into failed with codes {sorted(set(codes))}")

    def check(self) -> None:
        if self.src.map[:] != self.dst.map[:]:
            raise PeerFailure("mooncake returned different bytes than were put")

    def exists64(self) -> None:
        self.store.batch_is_exist(self.exists_keys)


def run(workload: Workload, workdir: Path) -> Figures:
    _private_loopback()
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

    bindir = Path(sys.executable).parent
    meta_port, master_port, metrics_port, node_port = (free_port() for _ in range(4))
    metadata_url = f"http://127.0.0.1:{meta_port}/metadata"
    master = f"127.0.0.1:{master_port}"
    segment_mib = (workload.total_bytes * 5 // 4) // MiB + 64  # under the 90 % eviction mark
    with Servers(workdir) as servers:
        servers.start(
            "mooncake_http_metadata_server",
            [str(bindir / "mooncake_http_metadata_server"), "--host=127.0.0.1", f"--port={meta_port}"],
        )
        servers.start(
            "mooncake_master",
            [
                str(bindir / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={master_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics_port}",
                "--http_metadata_server_host=127.0.0.1",
                "--enable_metric_reporting=false",
            ],
        )
        servers.wait_port("mooncake_http_metadata_server", meta_port, START_TIMEOUT_S)
        servers.wait_port("mooncake_master", master_port, START_TIMEOUT_S)
        servers.start(
            "mooncake_storage_node",
            [
                str(bindir / "mooncake_client"),
                "--host=127.0.0.1",
                f"--port={node_port}",
                f"--global_segment_size={segment_mib} MB",
                f"--master_server_address={master}",
                f"--metadata_server={metadata_url}",
                "--protocol=tcp",
            ],
        )
        servers.wait_port("mooncake_storage_node", node_port, START_TIMEOUT_S)

        store: MooncakeStore = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", metadata_url, 0, LOCAL_BUFFER_BYTES, "tcp", "", master)
        if rc != 0:
            raise PeerFailure(f"MooncakeDistributedStore.setup failed with code {rc}; see the worker log")
        try:
            src, dst = _Buffer(workload.total_bytes), _Buffer(workload.total_bytes)
            src.map[:] = workload.source_bytes()
            for buf in (src, dst):
                if store.register_buffer(buf.addr, buf.size) != 0:
                    raise PeerFailure("mooncake register_buffer failed; see the worker log")
            _wait_for_segment(store, src, workload.block_bytes, servers)
            figures: Figures = dict(measure(workload, MooncakeOps(store, workload, src, dst)))
            store.remove_all(True)
            for buf in (src, dst):
                store.unregister_buffer(buf.addr)
        finally:
            store.close()
    version = metadata.version("mooncake-transfer-engine-non-cuda")
    figures["client"] = (
        f"mooncake-transfer-engine-non-cuda {version}: MooncakeDistributedStore over tcp, "
        "batch_put_from/batch_get_into on registered buffers"
    )
    figures["notes"] = (
        f"private netns; one storage node ({segment_mib} MiB segment), client holds no segment; "
        f"batches of {BATCH} keys; batch_is_exist"
    )
    return figures


def _wait_for_segment(store: MooncakeStore, src: _Buffer, size: int, servers: Servers) -> None:
    """The storage node mounts its segment after it listens; a put fails until then."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while store.put_from("kvbench-probe", src.addr, size) != 0:
        if time.monotonic() > deadline:
            raise PeerFailure(
                "no Mooncake segment became available to put into; "
                + servers.log_tail("mooncake_storage_node")
            )
        time.sleep(0.2)
    store.remove("kvbench-probe", True)


if __name__ == "__main__":
    sys.exit(worker_main(run))
