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
its bytes trickle, and each request handed to the data plane.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore import wire
from kvstore.address import Address, UnixAddress
from kvstore.errors import FailedPrecondition, InvalidArgument, KvStoreError, ResourceExhausted
from kvstore.keys import BlockKey
from kvstore.server.answering import AnsweringLoop, Outcome, Parked
from kvstore.server.auth import Authenticator, Caller
from kvstore.server.dataplane import DataPlane
from kvstore.server.fairness import SERVED_AT_ONCE_PER_TENANT, TenantShares
from kvstore.server.head_op import serve_heads
from kvstore.store import Scope
from kvstore.stream import Stream
from kvstore.wire import (
    BLOCKS_END,
    IDLE_S,
    OK_FRAME,
    OP_ABORT,
    OP_COMMIT,
    OP_GET,
    OP_LEASE_HELD,
    OP_LOOKUP,
    OP_LOOKUP_SLOTS,
    OP_NAMES,
    OP_PUT,
    OP_RELEASE,
    OP_RELEASE_NOWAIT,
    OP_RESERVE,
    OP_RESOLVE,
    read_id,
    read_keys,
    read_ttl,
    send_error,
)

log = logging.getLogger(__name__)

REQUEST_S = 30.0  # a whole request, however its bytes trickle: well inside dataplane.LEASE_S
HELLO_S = 5.0  # magic, token and scope must arrive within this
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_TENANT = 256
MAX_BLOCKS_PER_REQUEST = 65536
MAX_TRACKED_RESERVATIONS = 64  # per connection, for the spin between a write's chunks


@dataclass
class _Session:
    caller: Caller
    namespace: str
    reserved: set[int] = field(default_factory=set)  # reservations granted here, not committed or aborted


class DataPort:
    """A thread per connection, its small requests answered by one loop between its others
    (``kvstore.server.answering``); ``close()`` stops accepting and waits for them."""

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
        ``spin_s``: how long a connection in the middle of a same-host write polls for its
        next request before it sleeps (one connection at a time; never on a single CPU).
        ``shares``: the server's places per tenant, which its connection threads take to serve
        a request (the server's gRPC workers take the same ones); else a set of its own."""
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
        self._threads: set[threading.Thread] = set()
        self._idle: set[socket.socket] = set()  # connections waiting for their next request
        self._conns: set[socket.socket] = set()  # every open connection (cut at the drain's end)
        self._per_tenant: dict[str, int] = {}
        self._lock = threading.Lock()
        self._spinner = threading.Lock()  # held by the one connection spinning for its next request
        self._closing = threading.Event()
        # answers the small requests of connections between their others
        self._loop = AnsweringLoop(lookups=not plane.store.has_remote)
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
            thread = threading.Thread(target=self._serve_connection, args=(conn, peer), daemon=True)
            with self._lock:
                self._threads.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: refuse this one, keep accepting
                log.warning("data port cannot start a connection thread: %s", exc)
                with self._lock:
                    self._threads.discard(thread)
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
        self._loop.close()
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
        with self._lock:
            threads = list(self._threads)
            for conn in self._idle:  # between requests: nothing to finish, wake them now
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            late = list(self._conns)
        for conn in late:  # past the grace: cut, so the drain can spill and exit
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(1.0)

    # ----------------------------------------------------------------- one connection

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session: _Session | None = None
        parked: Parked | None = None
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
            if not isinstance(conn, ssl.SSLSocket):
                answer = functools.partial(self._serve_one, stream, session)
                parked = Parked(conn, stream, answer, session.caller.tenant)
            op = -1  # none yet: parked after the hello
            while not self._closing.is_set():
                # A write with a reservation still open here sends its next commit a chunk's
                # copy from now: wait for it awake.
                spin_s = self.spin_s if session.reserved and op in (OP_RESERVE, OP_COMMIT) else 0.0
                # After a request the loop does not answer (a write, bytes over the socket, a
                # resolve) the next is likely another such: this thread waits for it itself.
                # (Handed over by the loop each time, same-host writes ran 5-35% slower now and
                # then.) After one the loop answers, the connection goes back to the loop.
                answered_there = op < 0 or self._loop.answers(op)
                if parked is not None and spin_s == 0.0 and answered_there and not stream.buffered():
                    if not self._park(parked):
                        return
                    if not stream.buffered():
                        continue
                elif not self._next_request(stream, spin_s):
                    return
                with self.shares.place(session.caller.tenant, REQUEST_S):  # asleep till its turn
                    op = self._serve_one(stream, session)
        except KvStoreError as exc:
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)  # a peer that reads nothing must not hold the thread
                send_error(conn, exc)
        except (OSError, ConnectionError, wire.MalformedMessage) as exc:
            log.debug("data connection from %s ended: %s", peer, exc)
        except Exception:  # a bug must not kill the port silently: log it, tell the client
            log.exception("data port request from %s failed", peer)
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)
                send_error(conn, KvStoreError("internal error in the data port; see the server log"))
        finally:
            conn.close()
            with self._lock:
                self._threads.discard(threading.current_thread())
                self._conns.discard(conn)
                if session is not None and session.caller.tenant in self._per_tenant:
                    self._per_tenant[session.caller.tenant] -= 1

    def _serve_one(self, stream: Stream, session: _Session) -> int:
        """Serve the request whose first bytes have come; its operation."""
        stream.begin(time.monotonic() + REQUEST_S)  # all of it, however its bytes trickle
        op = wire.read_op(stream.read)
        started = time.perf_counter()
        try:
            self._dispatch(op, stream, session)
        finally:
            if self.on_request is not None and op in OP_NAMES:
                self.on_request(OP_NAMES[op], time.perf_counter() - started)
        return op

    def _park(self, parked: Parked) -> bool:
        """Leave the connection to the answering loop until a request needs this thread;
        whether the connection goes on. Sends first what the loop could not send at once."""
        outcome = self._loop.park(parked)
        if parked.unsent:
            parked.stream.begin(time.monotonic() + REQUEST_S)
            parked.stream.send(parked.unsent)
        if outcome is Outcome.FAILED and parked.error is not None:
            raise parked.error
        if outcome is not Outcome.SERVE:
            log.debug("data connection parked: %s", outcome.value)
        return outcome is Outcome.SERVE

    def _dispatch(self, op: int, stream: Stream, session: _Session) -> None:
        if op == OP_LOOKUP:
            self._lookup(stream, session)
        elif op == OP_LOOKUP_SLOTS:
            self._lookup(stream, session, slots=True)
        elif op == OP_LEASE_HELD:
            lease_id = read_id(stream.read)
            stream.send(wire.held_answer(self.plane.lease_held(session.caller, lease_id)))
        elif op == OP_RESOLVE:
            self._resolve(stream, session)
        elif op == OP_RELEASE:
            self.plane.release(session.caller, read_id(stream.read))
            stream.send(OK_FRAME)
        elif op == OP_RELEASE_NOWAIT:  # no answer: nothing to fail the connection for
            lease_id = read_id(stream.read)
            try:
                self.plane.release(session.caller, lease_id)
            except KvStoreError as exc:
                log.debug("a release without answer of lease %d: %s", lease_id, exc)
        elif op == OP_RESERVE:
            self._reserve(stream, session)
        elif op == OP_COMMIT:
            reservation_id = read_id(stream.read)
            session.reserved.discard(reservation_id)
            stream.send(wire.stored_answer(self.plane.commit(session.caller, reservation_id)))
        elif op == OP_ABORT:
            reservation_id = read_id(stream.read)
            session.reserved.discard(reservation_id)
            self.plane.abort(session.caller, reservation_id)
            stream.send(OK_FRAME)
        elif op == OP_GET:
            self._get(stream, session)
        elif op == OP_PUT:
            self._put(stream, session)
        elif op == wire.OP_HEAD:
            serve_heads(stream, self.plane, session.namespace, MAX_BLOCKS_PER_REQUEST)
        else:
            raise InvalidArgument(f"unknown data port operation {op}")

    def _admit(self, session: _Session) -> None:
        """At most MAX_CONNECTIONS_PER_TENANT connections per tenant: one tenant cannot take
        every place (RESOURCE_EXHAUSTED otherwise; the connection then closes)."""
        tenant = session.caller.tenant
        with self._lock:
            if self._per_tenant.get(tenant, 0) >= MAX_CONNECTIONS_PER_TENANT:
                raise ResourceExhausted(
                    f"tenant {tenant} has {MAX_CONNECTIONS_PER_TENANT} data connections already"
                )
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1

    def _next_request(self, stream: Stream, spin_s: float = 0.0) -> bool:
        """Wait up to IDLE_S for the next request to start (a connection idle longer is closed;
        the client reconnects). Within a request, its deadline bounds every read and write."""
        with self._lock:
            if self._closing.is_set():
                return False
            self._idle.add(stream.sock)
        try:
            if spin_s > 0 and self._spinner.acquire(blocking=False):  # one thread spins at a time
                try:
                    stream.spin(spin_s, yielding=True)
                finally:
                    self._spinner.release()
            return stream.wait(IDLE_S)
        finally:
            with self._lock:
                self._idle.discard(stream.sock)

    def _hello(self, stream: Stream, peer: Any) -> _Session:
        """Magic, token and scope, all within HELLO_S: a slowloris is cut there."""
        token, scope = wire.read_hello(stream.read)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        conn = stream.sock
        peer_name = "unix:" if conn.family == socket.AF_UNIX else f"ipv4:{peer[0]}:{peer[1]}"
        caller = self.auth.caller(metadata, peer_name)
        session = _Session(caller, self.auth.namespace(caller, scope))
        stream.send(OK_FRAME)
        return session

    def _resolve(self, stream: Stream, session: _Session) -> None:
        """Same-host restore: arena slots of the present prefix, pinned under a lease."""
        fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
        ttl_s = read_ttl(stream.read)
        if stream.sock.family != socket.AF_UNIX:
            raise FailedPrecondition(
                "resolve hands out arena slots: same-host clients on the Unix socket only"
            )
        scope = Scope(session.namespace, fingerprint)
        resolved = self.plane.resolve(session.caller, scope, keys, ttl_s if ttl_s > 0 else None)
        name = self.plane.arena().arena.name.encode()
        lease_id = resolved.lease.lease_id if resolved.lease else 0
        answer = wire.resolve_answer(name, resolved.slots, resolved.tiers, lease_id)
        if resolved.lease is not None and self._caller_left(stream, session, lease_id):
            return
        stream.send(answer)

    def _caller_left(self, stream: Stream, session: _Session, lease_id: int) -> bool:
        """Whether the client hung up while the store worked: its deadline passed (a client
        closes a connection whose call failed), say while a restore promoted blocks from a slow
        tier. It never learns the lease, so it can release nothing, and the pins would hold the
        blocks in place, against eviction and demotion, until their TTL. Release them now; the
        session ends at its next read."""
        gone = _gone(stream)
        if gone:
            with contextlib.suppress(KvStoreError):  # it expired meanwhile: nothing left to free
                self.plane.release(session.caller, lease_id)
            log.info("a caller left before its answer (its deadline passed): lease %d released", lease_id)
        return gone

    def _reserve(self, stream: Stream, session: _Session) -> None:
        """Same-host store: arena slots to fill in place, then ``commit`` (or ``abort``)."""
        fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
        parent, ttl_s, sizes = wire.read_reserve_tail(stream.read, len(keys))
        if stream.sock.family != socket.AF_UNIX:
            raise FailedPrecondition(
                "reserve hands out arena slots: same-host clients on the Unix socket only"
            )
        scope = Scope(session.namespace, fingerprint)
        reservation = self.plane.reserve(
            session.caller, scope, keys, sizes, parent, ttl_s if ttl_s > 0 else None
        )
        if _gone(stream):  # its deadline passed while the store made room: nobody will commit
            with contextlib.suppress(KvStoreError):
                self.plane.abort(session.caller, reservation.reservation_id)
            log.info("a caller left before its answer: reservation %d aborted", reservation.reservation_id)
            return
        if len(session.reserved) < MAX_TRACKED_RESERVATIONS:  # the rest run out with their lease
            session.reserved.add(reservation.reservation_id)
        name = self.plane.arena().arena.name.encode()
        stream.send(wire.reserve_answer(name, reservation.reservation_id, reservation.slots))

    def _lookup(self, stream: Stream, session: _Session, slots: bool = False) -> None:
        """A lookup; ``slots``: also where each pinned hit lies in the arena (Unix socket only)."""
        fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
        pin_ttl_s = read_ttl(stream.read)
        if slots and stream.sock.family != socket.AF_UNIX:
            raise FailedPrecondition("arena slots are for same-host clients on the Unix socket only")
        scope = Scope(session.namespace, fingerprint)
        result = self.plane.lookup(
            session.caller, scope, keys, pin_ttl_s if pin_ttl_s > 0 else None, slots=slots
        )
        lease_id = result.lease.lease_id if result.lease else 0
        if lease_id and self._caller_left(stream, session, lease_id):
            return
        if not slots:
            stream.send(wire.lookup_answer(result.hit_blocks, result.tiers, lease_id))
            return
        name = self.plane.arena().arena.name.encode() if result.slots else b""
        stream.send(wire.lookup_answer(result.hit_blocks, result.tiers, lease_id, result.slots, name))

    def _get(self, stream: Stream, session: _Session) -> None:
        fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
        scope = Scope(session.namespace, fingerprint)
        self.plane.arena()
        stream.send(OK_FRAME)  # from here on a failure can only close the connection

        def send(key: BlockKey, payload: memoryview, checksum: int) -> None:  # out of the pinned slot
            stream.send_parts(wire.block_head(len(payload), checksum), payload)

        for _ in self.plane.read(session.caller, scope, keys, send):
            pass
        stream.send(BLOCKS_END)

    def _put(self, stream: Stream, session: _Session) -> None:
        fingerprint, parent, keys, sizes = wire.read_put_head(stream.read, MAX_BLOCKS_PER_REQUEST)
        scope = Scope(session.namespace, fingerprint)
        stored = self.plane.write(
            session.caller, scope, parent, keys, sizes, lambda i, view: stream.read_into(view)
        )
        stream.send(wire.stored_answer(stored))


def _refuse(conn: socket.socket, message: str) -> None:
    with contextlib.suppress(OSError):
        conn.settimeout(1.0)
        send_error(conn, ResourceExhausted(message))
    conn.close()


def _gone(stream: Stream) -> bool:
    """Whether the client's end is closed, without waiting: readable with nothing to read (a
    pipelined next request would be bytes to peek at). Never under TLS: no peeking there (the
    same-host calls that ask are never on TLS)."""
    conn = stream.sock
    if isinstance(conn, ssl.SSLSocket):
        return False
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
