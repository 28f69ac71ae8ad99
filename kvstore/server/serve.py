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
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.address import Address, TcpAddress, UnixAddress, parse_address
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.extras import require
from kvstore.server.audit import AuditLog
from kvstore.server.auth import Authenticator, Caller, tenant_namespace
from kvstore.server.builder import open_store
from kvstore.server.config import ServerSettings, Settings
from kvstore.server.datadir import DataDir
from kvstore.server.dataport import DataPort
from kvstore.server.handlers import SERVICE_NAME
from kvstore.server.metrics import Metrics
from kvstore.server.models import FILE_NAME as MODELS_FILE
from kvstore.server.models import ModelRegistry
from kvstore.server.service import KvStoreService
from kvstore.server.shredding import Shredder
from kvstore.server.stats import Connections
from kvstore.store import TieredStore
from kvstore.tls import ServerTls

if TYPE_CHECKING:
    from kvstore.server.events import EventPublisher

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
    settings: ServerSettings  # its [server] section, as parsed
    _stopped: threading.Event
    data_port: DataPort | None = None
    data_socket: DataPort | None = None
    events: EventPublisher | None = None  # events.publish_address (kvstore.server.events)
    socket_path: str = ""  # the file of unix_address, removed at stop

    def stop(self) -> None:
        """Drain and close; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace_s = self.settings.drain_grace_s
        log.info("draining: refusing new requests, %.1fs for in-flight ones", grace_s)
        self.service.draining.set()
        self.health.enter_graceful_shutdown()
        if self.metrics is not None:
            self.metrics.state = "draining"  # /readyz: 503, so no new traffic is sent here
        for port in (self.data_port, self.data_socket):
            if port is not None:
                port.close(grace_s)
        self.grpc_server.stop(grace_s).wait()
        self.service.shredder.close()  # its key checks take the store's lock
        self.store.close()
        if self.events is not None:
            self.events.close()  # after the store: its last changes go out first
        if self.service.audit is not None:
            self.service.audit.close()
        if self.metrics is not None:
            self.metrics.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        log.info("stopped")

    def wait(self) -> None:
        self._stopped.wait()


def start_server(settings: Settings) -> RunningServer:
    """Open the store and start listening; returns once requests can be served. A failure part
    way (a port in use, the data folder locked by another server) undoes what was started —
    arena, lock, listeners — and raises a ``KvStoreError`` that says what to change."""
    # Quotas are configured per tenant; the store keeps them per namespace.
    quotas = {tenant_namespace(tenant): nbytes for tenant, nbytes in settings.store.quota_bytes.items()}
    retention = {tenant_namespace(tenant): s for tenant, s in settings.store.retention_s.items()}
    settings = dataclasses.replace(
        settings, store=dataclasses.replace(settings.store, quota_bytes=quotas, retention_s=retention)
    )
    with contextlib.ExitStack() as undo:
        # The folder's lock before anything else: a second server on it is refused in one line,
        # not after binding (or warning about) ports the first one holds.
        data_dir = DataDir.open(settings.data_dir)
        undo.callback(data_dir.close)  # idempotent; the store closes it too
        metrics = _serve_metrics(settings, undo)  # before the store: /healthz answers while it opens
        store = open_store(settings, data_dir)
        undo.callback(store.close)
        if metrics is not None:
            metrics.watch(store)
        running = _start_listeners(settings, store, metrics, undo)
        undo.pop_all()  # started: from here on, stop() owns the cleanup
        return running


def _serve_metrics(settings: Settings, undo: contextlib.ExitStack) -> Metrics | None:
    """The metrics port, /readyz saying "starting" until the server is up; None when off."""
    if not settings.server.metrics_address:
        return None
    metrics = Metrics()
    undo.callback(metrics.close)
    try:
        metrics.serve(settings.server.metrics_address)
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(
            f"cannot serve metrics on {settings.server.metrics_address} ({_reason(exc)}): set "
            "server.metrics_address to a free host:port, to auto (a free port when the default "
            "is taken), or to nothing to turn metrics off (--set server.metrics_address=)"
        ) from None
    return metrics


def _start_listeners(
    settings: Settings, store: TieredStore, metrics: Metrics | None, undo: contextlib.ExitStack
) -> RunningServer:
    for line in store.absent_tiers:
        # Off by choice is not worth a warning at every start; absent when asked for is.
        level = logging.INFO if "disabled in the configuration" in line else logging.WARNING
        log.log(level, "tier absent: %s", line)
    auth = Authenticator(settings.server)
    audit = _audit_log(settings, undo)
    shredder = Shredder(store, audit)
    undo.callback(shredder.close)
    models = ModelRegistry(Path(settings.data_dir) / MODELS_FILE)
    events = _publish_events(settings, store, models, metrics, undo)
    service = KvStoreService(
        store,
        auth,
        metrics,
        models,
        max_requests_per_tenant=settings.server.max_requests_per_tenant,
        stream_timeout_s=settings.server.stream_timeout_s,
        audit=audit,
        shredder=shredder,
    )
    options = [
        ("grpc.max_receive_message_length", settings.server.max_message_bytes),
        ("grpc.max_send_message_length", settings.server.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.server.workers), options=options)
    undo.callback(lambda: server.stop(None))
    service.add_to(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    socket_path = settings.socket_path
    try:
        socket_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"server.socket_path {socket_path}: cannot make its folder: {exc}") from None
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()  # a dead server's (the data folder's lock says none is alive)
    unix = UnixAddress(str(socket_path))
    unix_address = unix.target
    old_umask = os.umask(0o177)  # the socket is born 0600: only this user reaches the sidecar
    try:
        _listen(server, unix, "server.socket_path")
    finally:
        os.umask(old_umask)
    tls = _server_tls(settings)
    tcp_address = None
    tcp: TcpAddress | None = None  # as bound: the port chosen when it was 0
    if settings.server.tcp_address:
        tcp = _tcp(settings.server.tcp_address, "server.tcp_address")
        tcp = TcpAddress(tcp.host, _listen(server, tcp, "server.tcp_address (--tcp)", tls))
        tcp_address = tcp.target
        if tls is None and tcp.host.strip("[]") not in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "TCP listener %s without TLS: tokens and KV bytes cross the network in clear text; "
                "set server.tls_cert_file and server.tls_key_file",
                tcp_address,
            )
    data_port = None
    data: TcpAddress | None = None
    if settings.server.data_address == "auto":
        data = TcpAddress(tcp.host, 0) if tcp is not None else None  # beside the TCP listener
    elif settings.server.data_address:
        data = _tcp(settings.server.data_address, "server.data_address")
    if data is not None:
        data_port = _data_port(auth, service, data, "server.data_address", tls)
        undo.callback(data_port.close, 0.0)
        service.data_port = data_port.port
    data_socket = None
    data_socket_path = settings.server.data_socket_path
    if data_socket_path == "auto":
        data_socket_path = str(Path(settings.data_dir) / "kvstore-data.sock")
    if data_socket_path:
        spin_s = settings.server.data_spin_s
        data_socket = _data_port(
            auth, service, UnixAddress(data_socket_path), "server.data_socket_path", spin_s=spin_s
        )
        undo.callback(data_socket.close, 0.0)
        service.data_socket = data_socket_path
    server.start()
    os.chmod(socket_path, 0o600)
    service.addresses = [unix_address] + [a for a in (tcp_address,) if a]
    service.connections = Connections({"data port": data_port, "data socket": data_socket}, str(socket_path))
    if metrics is not None:
        metrics.watch_connections(partial(service.connections.figures, Caller("", admin=True)))
    if data_port is not None and data is not None:
        service.addresses.append(f"data port {TcpAddress(data.host, data_port.port)}")
    if data_socket is not None:
        service.addresses.append(f"data socket {UnixAddress(data_socket_path)}")
    if events is not None:
        service.addresses.append(f"events {events.endpoint}")  # the port bound, where it was 0
    metrics_port = None
    if metrics is not None:
        metrics_port = metrics.port
        service.addresses.append(f"metrics {metrics.url}/metrics")
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if metrics is not None:
        metrics.state = "ready"
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
        settings.server,
        threading.Event(),
        data_port,
        data_socket,
        events=events,
        socket_path=unix.path,
    )


def _publish_events(
    settings: Settings,
    store: TieredStore,
    models: ModelRegistry,
    metrics: Metrics | None,
    undo: contextlib.ExitStack,
) -> EventPublisher | None:
    """The KV event feed (off unless events.publish_address); its library only when on."""
    if not settings.events.publish_address:
        return None
    for module in ("zmq", "msgspec"):
        require(module, "events.publish_address")
    from kvstore.server.events import start_publisher

    def block_size_of(fingerprint: bytes) -> int:
        identity = models.get(fingerprint)
        return 0 if identity is None else identity.tokens_per_block

    events = start_publisher(settings.events, [t.name for t in store.tiers], block_size_of)
    undo.callback(events.close)
    store.listen(events)
    if metrics is not None:
        metrics.registry.register(events.collector())
    return events


def _audit_log(settings: Settings, undo: contextlib.ExitStack) -> AuditLog | None:
    path = settings.server.audit_log
    if path == "auto":
        path = str(Path(settings.data_dir) / "audit.log")
    if not path:
        return None
    try:
        audit = AuditLog(path)
    except OSError as exc:
        raise FailedPrecondition(f"server.audit_log {path}: {exc.strerror or exc}") from None
    undo.callback(audit.close)
    return audit


def _server_tls(settings: Settings) -> ServerTls | None:
    s = settings.server
    if not (s.tls_cert_file or s.tls_key_file):
        if s.tls_client_ca_file:
            raise InvalidArgument("server.tls_client_ca_file needs server.tls_cert_file and tls_key_file")
        return None
    if not (s.tls_cert_file and s.tls_key_file):
        raise InvalidArgument("TLS needs both server.tls_cert_file and server.tls_key_file")
    return ServerTls(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)


def _listen(server: grpc.Server, address: Address, setting: str, tls: ServerTls | None = None) -> int:
    """Bind one gRPC listener (TLS on TCP when configured); a refusal names the setting."""
    _check_free(address, setting)
    try:
        if tls is not None and not address.same_host:
            port = server.add_secure_port(address.target, tls.grpc_credentials())
        else:
            port = server.add_insecure_port(address.target)
    except RuntimeError as exc:  # grpcio raises this where older versions returned 0
        raise FailedPrecondition(f"cannot listen on {address} ({exc}): change {setting}") from None
    if port == 0:
        raise FailedPrecondition(
            f"cannot listen on {address} (in use, or not an address of this machine): change {setting}"
        )
    return int(port)


def _tcp(text: str, setting: str) -> TcpAddress:
    """A TCP listener's address (port 0: any free port)."""
    address = parse_address(text, setting, listener=True)
    if not isinstance(address, TcpAddress):
        raise InvalidArgument(f"{setting} is host:port, got {text!r}")
    return address


def _check_free(address: Address, setting: str) -> None:
    """Refuse a TCP port in use with a clear line (gRPC's own refusal says little)."""
    if not isinstance(address, TcpAddress) or address.port == 0:
        return
    host = address.host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host or "0.0.0.0", address.port))
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot listen on {address} ({_reason(exc)}): change {setting}"
            ) from None


def _data_port(
    auth: Authenticator,
    service: KvStoreService,
    address: Address,
    setting: str,
    tls: ServerTls | None = None,
    spin_s: float = 0.0,
) -> DataPort:
    context = tls.ssl_context() if tls is not None and not address.same_host else None
    try:
        # One set of places per tenant across both data ports and gRPC: a tenant's flood on one
        # transport waits its turn there, not everyone's on another.
        port = DataPort(auth, address, service.plane, context, spin_s=spin_s, shares=service.shares)
    except OSError as exc:
        raise FailedPrecondition(
            f"cannot listen on {address} for the data port ({_reason(exc)}): change {setting}"
        ) from None
    if service.metrics is not None:
        port.on_request = service.metrics.observe_request
    return port


def _reason(exc: BaseException) -> str:
    return str(exc.strerror) if isinstance(exc, OSError) and exc.strerror else str(exc)


FULL_COLLECTION_NEVER = 1 << 30  # gen-1 collections before a full one: not in any server's life


def hold_full_collections() -> None:
    """The server process's garbage collector: young collections as usual, no full one.

    A full (generation 2) collection walks every object the collector tracks with the GIL
    held, so every request of every client waits for it: measured here, 97 ms in a fresh
    server (the ~180k objects of its imports, gRPC and protobuf) and 600 ms with 500k blocks in
    the index (five tracked objects a block), and CPython starts one each time the long-lived
    objects grew by a quarter, which a cache turning its index over keeps doing. Objects that
    outlive the young collections are still freed by reference counting the moment they are
    dropped; only garbage in reference cycles among them would stay, and the server makes
    next to none that lives that long (see RELIABILITY.md). What stands once the server is up
    (imports, the index rebuilt at start) is collected once and frozen: no collection looks
    at it again."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_NEVER)


def serve(settings: Settings, ready: Callable[[RunningServer], None] | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain; the exit code (0 after a clean drain)."""
    # Request threads hand the GIL to each other often; the default 5 ms switch interval
    # would let one busy thread stall a lookup waiting on the GIL for that long.
    sys.setswitchinterval(0.0005)
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop_requested.set()

    # Before the listeners open: a SIGTERM the moment the server answers must drain it, not kill
    # it (one that comes while it starts takes effect once it has started).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # `kill -USR1`: every thread's stack to stderr, the server going on (a drain that hangs
    # can then be seen, not only killed)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    running = start_server(settings)
    hold_full_collections()
    if ready is not None:
        ready(running)
    print(
        f"kvstore serving on {running.unix_address}"
        + (f" and {running.tcp_address}" if running.tcp_address else "")
        + (f"; metrics {running.metrics.url}/metrics" if running.metrics is not None else ""),
        flush=True,
    )
    # Woken at least twice a second: a SIGTERM the kernel hands to another thread only flags it for
    # the main thread, which an untimed wait would never see (a CI run's drain never began)
    while not stop_requested.wait(0.5):
        pass
    running.stop()
    return 0
