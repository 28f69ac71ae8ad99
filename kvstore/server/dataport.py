"""The raw data port: the fast remote data plane, beside gRPC.

gRPC in Python moves 2 MiB messages at a fraction of what a socket can (every message is
copied into and out of gRPC's own buffers), so remote block bytes can also travel over a plain
TCP connection with a tiny framing. The server sends straight out of the arena slots it pinned
and receives straight into the arena slots it reserved: no copy in the service process at all.
Lookups, the hottest control call, can go over it too: a gRPC round trip in Python costs about
a millisecond on a busy small host, a framed socket round trip a tenth of that. The TCP port and
the Unix-socket twin of the sidecar are announced by the ServerInfo RPC.

The protocol itself (framing, opcodes, every message's layout and codec) is ``kvstore.wire``; the client end is
``kvstore.client.dataport``. Here: accepting connections within limits (MAX_CONNECTIONS,
MAX_CONNECTIONS_PER_TENANT), the hello within HELLO_S, every request within REQUEST_S however
its bytes trickle, and each request handed to ``kvstore.server.dataport_ops``, which serves its
operation over the data plane.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore import wire
from kvstore.address import Address, UnixAddress
from kvstore.errors import KvStoreError, ResourceExhausted
from kvstore.server.answering import AnsweringLoop, Connection
from kvstore.server.auth import Authenticator
from kvstore.server.dataplane import DataPlane
from kvstore.server.dataport_ops import AnswerCut, Session, serve_op
from kvstore.server.fairness import SERVED_AT_ONCE_PER_TENANT, TenantShares
from kvstore.server.workers import Workers
from kvstore.stream import Stream
from kvstore.wire import OK_FRAME, OP_COMMIT, OP_NAMES, OP_RESERVE, send_error

log = logging.getLogger(__name__)

REQUEST_S = 30.0  # a whole request, however its bytes trickle: well inside dataplane.LEASE_S
HELLO_S = 5.0  # magic, token and scope must arrive within this
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_TENANT = 256
# After a request the loop does not answer, a worker waits this long for the connection's next
# (a same-host restore's next resolve comes after the client's copy, a few ms).
FOLLOW_S = 0.05
# A connection's requests a worker serves in a row before its tenant's other connections.
REQUESTS_PER_TURN = 32


@dataclass(eq=False)
class _Link(Connection):
    session: Session = field(kw_only=True)


class DataPort:
    """One loop holds every connection between requests and answers the small ones
    (``kvstore.server.answering``); a pool of workers serves the rest, tenants in turn
    (``kvstore.server.workers``); a short-lived thread takes each hello. ``close()`` stops
    accepting and waits for the requests under way."""

    def __init__(
        self,
        auth: Authenticator,
        address: Address,
        plane: DataPlane,
        ssl_context: ssl.SSLContext | None = None,
        spin_s: float = 0.0,
        shares: TenantShares | None = None,
    ) -> None:
        """``address``: TCP, or a Unix socket (its file made mode 0600);
        ``ssl_context``: TLS on every connection (TCP only), the handshake within HELLO_S.
        ``spin_s``: how long a worker in the middle of a same-host write polls for its
        connection's next request before it sleeps (one at a time; never on a single CPU).
        ``shares``: the server's places per tenant, which the workers take to serve a request
        (the server's gRPC workers take the same ones); else a set of its own."""
        self._ssl_context = ssl_context
        self.shares = shares or TenantShares(SERVED_AT_ONCE_PER_TENANT)
        # Between two chunks of a pipelined write (kvstore.client.inplace) the client copies for
        # a millisecond or so. A thread asleep meanwhile must be woken for the next request:
        # measured here, each send into a sleeping thread cost the client 22-31 us against 7 us,
        # and the server answered later. Polling keeps it awake; on one CPU it would only take
        # the client's time.
        self.spin_s = spin_s if len(os.sched_getaffinity(0)) >= 2 else 0.0
        self.auth = auth
        self.plane = plane
        # Called after each request with the gRPC method it stands for and its seconds, so the
        # request metrics are the same whichever transport carried it.
        self.on_request: Callable[[str, float], None] | None = None
        self.unix_path: str | None = None
        self.port = 0
        if isinstance(address, UnixAddress):
            self.unix_path = address.path
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)  # a stale socket of a process that died
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)
            try:
                self._listener.bind(self.unix_path)
            finally:
                os.umask(old_umask)
            self._listener.listen(64)
        else:
            self._listener = socket.create_server((address.host or "127.0.0.1", address.port))
            self.port = self._listener.getsockname()[1]
        self._hellos: set[threading.Thread] = set()  # connections still in their hello
        self._conns: set[socket.socket] = set()  # every open connection (cut at the drain's end)
        self._per_tenant: dict[str, int] = {}
        self._lock = threading.Lock()
        self._spinner = threading.Lock()  # held by the one worker spinning for a next request
        self._closing = threading.Event()
        self._workers: Workers[_Link] = Workers(self.shares, self._serve_turn, self._end, REQUEST_S)
        self._loop = AnsweringLoop(
            lookups=not plane.store.has_remote, elsewhere=self._to_worker, end=self._end
        )
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvstore-dataport", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._closing.is_set():
                    return  # listener closed
                time.sleep(0.05)  # out of descriptors, say: keep the port, try again
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                _refuse(conn, f"the data port has {MAX_CONNECTIONS} connections already; retry later")
                continue
            # A thread of its own for the hello (HELLO_S at most): a client trickling its hello
            # holds up nobody else's, and the TLS handshake needs a blocking socket.
            thread = threading.Thread(target=self._greet, args=(conn, peer), daemon=True)
            with self._lock:
                self._hellos.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: refuse this one, keep accepting
                log.warning("data port cannot start a hello thread: %s", exc)
                with self._lock:
                    self._hellos.discard(thread)
                    self._conns.discard(conn)
                _refuse(conn, "the server is out of threads; retry later")

    def connections(self) -> tuple[int, dict[str, int]]:
        """Open connections (those still in their hello too), and by tenant those past it: for
        Stats."""
        with self._lock:
            return len(self._conns), {t: n for t, n in self._per_tenant.items() if n > 0}

    def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting; in-flight requests get ``grace_s`` in all (one deadline shared by
        every connection, not each in turn); then every connection is cut."""
        deadline = time.monotonic() + grace_s
        self._closing.set()
        self._listener.close()
        self._loop.close()  # the connections between requests: nothing to finish, closed now
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
        self._workers.close(deadline)
        with self._lock:
            hellos = list(self._hellos)
        for thread in hellos:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            late = list(self._conns)
        for conn in late:  # past the grace: cut, so the drain can spill and exit
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._workers.join(1.0)
        for thread in hellos:
            thread.join(1.0)

    # ----------------------------------------------------------------- one connection

    def _greet(self, conn: socket.socket, peer: Any) -> None:
        """The TLS handshake and the hello, within HELLO_S; then the connection is the loop's."""
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link: _Link | None = None
        try:
            hello_deadline = time.monotonic() + HELLO_S
            if self._ssl_context is not None and conn.family != socket.AF_UNIX:
                conn.settimeout(HELLO_S)
                tls = self._ssl_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                with self._lock:
                    self._conns.discard(conn)
                    self._conns.add(tls)
                conn = tls
                conn.do_handshake()
            stream = Stream(conn, REQUEST_S)
            stream.begin(hello_deadline)
            session = self._hello(stream, peer)
            self._admit(session)
            answer = functools.partial(self._serve_one, stream, session)
            tls_on = isinstance(conn, ssl.SSLSocket)
            link = _Link(conn, stream, answer, session.caller.tenant, tls_on, session=session)
        except Exception as exc:  # noqa: BLE001 (told to the client and logged by _ended)
            _ended(conn, exc, peer)
            conn.close()
            with self._lock:
                self._conns.discard(conn)
        finally:
            with self._lock:
                self._hellos.discard(threading.current_thread())
        if link is not None:
            self._give_back(link)

    def _to_worker(self, conn: Connection) -> None:
        if not isinstance(conn, _Link):
            raise TypeError(f"not a data-port connection: {conn!r}")
        self._workers.submit(conn.tenant, conn)

    def _give_back(self, link: _Link) -> None:
        """To the loop until its next request; to a worker again if a request of a TLS
        connection waits already (the loop cannot read it)."""
        if link.tls and _request_waiting(link):
            self._workers.submit(link.tenant, link)
        else:
            self._loop.watch(link)

    def _serve_turn(self, link: _Link) -> None:
        """On a worker: what the loop passed on (answers to send, an error, a request), then the
        connection's next requests while they come (REQUESTS_PER_TURN at most); then back to the
        loop, or in line again behind its tenant's others."""
        stream = link.stream
        try:
            if link.unsent:  # the answers before an error too
                stream.begin(time.monotonic() + REQUEST_S)
                stream.send(link.unsent)
                link.unsent = b""
            if link.error is not None:
                raise link.error
            op = -1
            for _ in range(REQUESTS_PER_TURN):
                if self._closing.is_set() or not self._next_request(link, op):
                    break
                op = self._serve_one(stream, link.session)
        except Exception as exc:  # noqa: BLE001 (told to the client and logged by _ended)
            _ended(link.sock, exc, link.session.peer)
            self._end(link)
            return
        if self._closing.is_set():
            self._end(link)
        elif _request_waiting(link):
            self._workers.submit(link.tenant, link)  # its tenant's other connections first
        else:
            self._give_back(link)

    def _serve_one(self, stream: Stream, session: Session) -> int:
        """Serve the request whose first bytes have come; its operation."""
        stream.begin(time.monotonic() + REQUEST_S)  # all of it, however its bytes trickle
        op = wire.read_op(stream.read)
        started = time.perf_counter()
        try:
            serve_op(op, stream, session, self.plane)
        finally:
            if self.on_request is not None and op in OP_NAMES:
                self.on_request(OP_NAMES[op], time.perf_counter() - started)
        return op

    def _next_request(self, link: _Link, op: int) -> bool:
        """Whether the connection's next request has begun. After a request the loop does not
        answer (a write, bytes over the socket, a resolve), the next is likely another such, soon:
        the worker waits FOLLOW_S for it (spinning first between a write's chunks), unless its
        tenant's other connections wait for a worker. (Passed through the loop each time,
        same-host writes ran 5-35% slower now and then.) Under TLS every request is a worker's,
        the first of a turn included. Raises ConnectionError when the peer has left."""
        stream = link.stream
        spin_s = self.spin_s if link.session.reserved and op in (OP_RESERVE, OP_COMMIT) else 0.0
        if spin_s > 0 and self._spinner.acquire(blocking=False):  # one worker spins at a time
            try:
                stream.spin(spin_s, yielding=True)
            finally:
                self._spinner.release()
        if _request_waiting(link):
            return True
        if not link.tls and (op < 0 or self._loop.answers(op)):
            return False
        if op >= 0 and self._workers.queued(link.tenant):
            return False
        if stream.wait(FOLLOW_S):
            return True
        if stream.peer_closed:
            raise ConnectionError("the peer closed the data connection")
        return False

    def _end(self, conn: Connection) -> None:
        """Close the connection and forget it (once: its owner calls this, the loop or a worker)."""
        with contextlib.suppress(OSError):
            conn.sock.close()
        with self._lock:
            self._conns.discard(conn.sock)
            self._per_tenant[conn.tenant] -= 1

    def _admit(self, session: Session) -> None:
        """At most MAX_CONNECTIONS_PER_TENANT connections per tenant: one tenant cannot take
        every place (RESOURCE_EXHAUSTED otherwise; the connection then closes)."""
        tenant = session.caller.tenant
        with self._lock:
            if self._per_tenant.get(tenant, 0) >= MAX_CONNECTIONS_PER_TENANT:
                raise ResourceExhausted(
                    f"tenant {tenant} has {MAX_CONNECTIONS_PER_TENANT} data connections already"
                )
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1

    def _hello(self, stream: Stream, peer: Any) -> Session:
        """Magic, token and scope, all within HELLO_S: a slowloris is cut there."""
        token, scope = wire.read_hello(stream.read)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        conn = stream.sock
        peer_name = "unix:" if conn.family == socket.AF_UNIX else f"ipv4:{peer[0]}:{peer[1]}"
        caller = self.auth.caller(metadata, peer_name)
        session = Session(caller, self.auth.namespace(caller, scope), peer_name)
        stream.send(OK_FRAME)
        return session


def _ended(conn: socket.socket, exc: Exception, peer: object) -> None:
    """Tell the client why its connection ends: a ``KvStoreError`` as its status, a bug as an
    internal error (logged); a connection that broke or spoke no protocol is only logged, and
    one whose answer was cut short (``AnswerCut``) logged as a warning."""
    if isinstance(exc, AnswerCut):
        log.warning("data connection from %s closed: %s", peer, exc)
        return
    if isinstance(exc, (OSError, ConnectionError, wire.MalformedMessage)) and not isinstance(
        exc, KvStoreError
    ):
        log.debug("data connection from %s ended: %s", peer, exc)
        return
    if not isinstance(exc, KvStoreError):  # a bug must not kill the port silently
        log.error("data port request from %s failed", peer, exc_info=exc)
        exc = KvStoreError("internal error in the data port; see the server log")
    with contextlib.suppress(OSError):
        conn.settimeout(1.0)  # a peer that reads nothing must not hold the thread
        send_error(conn, exc)


def _request_waiting(link: _Link) -> bool:
    """Whether the connection's next request has begun here already: bytes its stream buffered,
    or, under TLS, bytes the TLS layer has read and not handed over yet (out of epoll's sight)."""
    sock = link.sock
    return bool(link.stream.buffered()) or (isinstance(sock, ssl.SSLSocket) and sock.pending() > 0)


def _refuse(conn: socket.socket, message: str) -> None:
    with contextlib.suppress(OSError):
        conn.settimeout(1.0)
        send_error(conn, ResourceExhausted(message))
    conn.close()
