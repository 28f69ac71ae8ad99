"""The metrics port: ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for probes.

    GET /metrics   the registry, in the format the scraper asks for (Prometheus text or
                   OpenMetrics; gzip when accepted)
    GET /healthz   200 while the process answers at all (a liveness probe)
    GET /readyz    200 while the store is open and serving; 503 while it starts or drains, the
                   body saying which (a readiness probe: no traffic before the store is open)
    anything else  404: a probe or a scrape job pointed at the wrong path fails visibly instead
                   of reading metrics as if all were well

``server.metrics_address = "auto"`` (the default) binds ``DEFAULT_ADDRESS`` and, when another
process holds that port (a second sidecar on the host), a free port of the same host instead,
logged at WARNING and listed by ``kvstore stats``. An address given explicitly is bound as given
or the start fails: whoever named a port has a scrape job pointing at it.

Requests are served on threads of their own (``serve_forever`` on a daemon thread); a scrape
reads the store under its lock, as ``kvstore stats`` does.
"""

from __future__ import annotations

import errno
import gzip
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

log = logging.getLogger(__name__)

AUTO = "auto"
DEFAULT_ADDRESS = "127.0.0.1:9464"
PATHS = ("/metrics", "/healthz", "/readyz")


class MetricsHttpServer:
    """One HTTP listener for a registry and a readiness state (``"ready"``, or what the server is
    doing instead: ``"starting"``, ``"draining"``). ``start`` once, ``close`` once; thread-safe."""

    def __init__(self, registry: CollectorRegistry, readiness: Callable[[], str]) -> None:
        self._registry = registry
        self._readiness = readiness
        self._server: _OpsServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""  # http://host:port, once started

    def start(self, address: str) -> int:
        """Bind and serve ``address`` (``host:port``, ``host:0`` for a free port, or ``"auto"``);
        the port bound. Raises OSError or ValueError when the address cannot be bound."""
        server = _bind(address, self)
        self._server = server
        host = server.server_name  # the address bound (server_bind)
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{server.server_port}"
        self._thread = threading.Thread(target=server.serve_forever, name="kvstore-metrics", daemon=True)
        self._thread.start()
        return int(server.server_port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def answer(self, path: str, accept: str, accept_encoding: str) -> tuple[int, str, bytes, str]:
        """(status, content type, body, content encoding) for a GET of ``path``."""
        if path == "/metrics":
            encoder, content_type = choose_encoder(accept)
            body = encoder(self._registry)
            if gzip_accepted(accept_encoding):
                return 200, content_type, gzip.compress(body), "gzip"
            return 200, content_type, body, ""
        if path == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n", ""
        if path == "/readyz":
            state = self._readiness()
            return (200 if state == "ready" else 503), "text/plain; charset=utf-8", f"{state}\n".encode(), ""
        return (
            404,
            "text/plain; charset=utf-8",
            f"not found; this port serves {', '.join(PATHS)}\n".encode(),
            "",
        )


class _OpsServer(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in flight does not hold the process at exit

    def __init__(self, host: str, port: int, owner: MetricsHttpServer) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.owner = owner
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own would look the host's name up (getfqdn: DNS, seconds where it hangs)
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = (
            str(host, "ascii") if not isinstance(host, str) else host,
            int(port),
        )


class _Handler(BaseHTTPRequestHandler):
    server: _OpsServer

    def do_GET(self) -> None:
        try:
            status, content_type, body, encoding = self.server.owner.answer(
                urlsplit(self.path).path,
                self.headers.get("Accept", ""),
                self.headers.get("Accept-Encoding", ""),
            )
        except Exception:  # a collector that failed: the scrape fails loudly, the server goes on
            log.exception("metrics: a scrape failed")
            status, content_type, body, encoding = 500, "text/plain; charset=utf-8", b"scrape failed\n", ""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds and probes every few more: no access log


def _bind(address: str, owner: MetricsHttpServer) -> _OpsServer:
    auto = address == AUTO
    host, _, port = (DEFAULT_ADDRESS if auto else address).rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        return _OpsServer(host, int(port), owner)
    except OSError as exc:
        if not (auto and exc.errno == errno.EADDRINUSE):
            raise
    server = _OpsServer(host, 0, owner)
    log.warning(
        "metrics port %s is in use (another kvstore on this host?): serving /metrics on %s:%d "
        "instead; set server.metrics_address to choose one",
        DEFAULT_ADDRESS,
        host,
        server.server_port,
    )
    return server
