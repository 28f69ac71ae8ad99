"""``kvstore serve``: one process, a Unix socket for the sidecar role and an optional TCP
listener for the shared-store role, standard health checking and reflection, Prometheus
metrics, and a graceful drain on SIGTERM or SIGINT.

Drain order: health goes NOT_SERVING and new RPCs get UNAVAILABLE; in-flight RPCs get
``drain_grace_s`` to finish; the store closes (dram-only blocks spilled, `nvme` flushed); the
process exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.auth import Authenticator, tenant_namespace
from kvstore.builder import open_store
from kvstore.config import Settings
from kvstore.dataport import DataPort
from kvstore.metrics import Metrics
from kvstore.service import SERVICE_NAME, KvStoreService
from kvstore.store import TieredStore
from proto import kvstore_pb2

log = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A started server; ``stop()`` drains it. Addresses are what clients pass to connect()."""

    grpc_server: grpc.Server
    service: KvStoreService
    health: health.HealthServicer
    store: TieredStore
    metrics: Metrics | None
    unix_address: str
    tcp_address: str | None
    metrics_port: int | None
    drain_grace_s: float
    _stopped: threading.Event
    data_port: DataPort | None = None
    data_socket: DataPort | None = None

    def stop(self) -> None:
        """Drain and close; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("draining: refusing new requests, %.1fs for in-flight ones", self.drain_grace_s)
        self.service.draining.set()
        self.health.enter_graceful_shutdown()
        for port in (self.data_port, self.data_socket):
            if port is not None:
                port.close(self.drain_grace_s)
        self.grpc_server.stop(self.drain_grace_s).wait()
        self.store.close()
        if self.metrics is not None:
            self.metrics.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.unix_address.removeprefix("unix://"))
        log.info("stopped")

    def wait(self) -> None:
        self._stopped.wait()


def start_server(settings: Settings) -> RunningServer:
    """Open the store and start listening; returns once requests can be served."""
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    # Quotas are configured per tenant; the store keeps them per namespace.
    quotas = {tenant_namespace(tenant): nbytes for tenant, nbytes in settings.store.quota_bytes.items()}
    settings = dataclasses.replace(settings, store=dataclasses.replace(settings.store, quota_bytes=quotas))
    store = open_store(settings)
    for line in store.absent_tiers:
        log.warning("tier absent: %s", line)
    metrics = Metrics(store) if settings.server.metrics_address else None
    auth = Authenticator(settings.server)
    service = KvStoreService(store, auth, metrics)
    options = [
        ("grpc.max_receive_message_length", settings.server.max_message_bytes),
        ("grpc.max_send_message_length", settings.server.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.server.workers), options=options)
    server.add_generic_rpc_handlers((service.handler(),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            kvstore_pb2.DESCRIPTOR.services_by_name["KvStore"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    socket_path = settings.socket_path
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()  # a stale socket of a process that died
    unix_address = f"unix://{socket_path}"
    old_umask = os.umask(0o177)  # the socket is born 0600: only this user reaches the sidecar
    try:
        server.add_insecure_port(unix_address)
    finally:
        os.umask(old_umask)
    tcp_address = None
    if settings.server.tcp_address:
        host, _, _ = settings.server.tcp_address.rpartition(":")
        port = server.add_insecure_port(settings.server.tcp_address)
        if port == 0:
            store.close()
            raise OSError(f"cannot listen on {settings.server.tcp_address}")
        tcp_address = f"{host}:{port}"
    data_port = None
    data_address = settings.server.data_address
    if data_address == "auto":
        data_address = f"{tcp_address.rpartition(':')[0]}:0" if tcp_address else ""
    if data_address:
        data_port = DataPort(store, auth, data_address, service.check_sizes)
        data_port.on_lookup = service.record_hits
        service.data_port = data_port.port
    data_socket = None
    data_socket_path = settings.server.data_socket_path
    if data_socket_path == "auto":
        data_socket_path = str(Path(settings.data_dir) / "kvstore-data.sock")
    if data_socket_path:
        data_socket = DataPort(store, auth, f"unix:{data_socket_path}", service.check_sizes)
        data_socket.on_lookup = service.record_hits
        service.data_socket = data_socket_path
    server.start()
    os.chmod(socket_path, 0o600)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics_port = metrics.serve(settings.server.metrics_address) if metrics is not None else None
    log.info(
        "serving on %s%s%s; tiers: %s",
        unix_address,
        f" and {tcp_address}" if tcp_address else "",
        f", data port {data_port.port}" if data_port else "",
        ", ".join(t.name for t in store.tiers),
    )
    return RunningServer(
        server,
        service,
        health_servicer,
        store,
        metrics,
        unix_address,
        tcp_address,
        metrics_port,
        settings.server.drain_grace_s,
        threading.Event(),
        data_port,
        data_socket,
    )


def serve(settings: Settings, ready: Callable[[RunningServer], None] | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain; the exit code (0 after a clean drain)."""
    # Request threads hand the GIL to each other often; the default 5 ms switch interval
    # would let one busy thread stall a lookup waiting on the GIL for that long.
    sys.setswitchinterval(0.0005)
    running = start_server(settings)
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if ready is not None:
        ready(running)
    print(
        f"kvstore serving on {running.unix_address}"
        + (f" and {running.tcp_address}" if running.tcp_address else ""),
        flush=True,
    )
    stop_requested.wait()
    running.stop()
    return 0
