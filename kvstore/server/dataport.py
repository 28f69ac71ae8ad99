"""The raw data port: the fast remote data plane, beside gRPC.

gRPC in Python moves 2 MiB messages at a fraction of what a socket can (every message is
copied into and out of gRPC's own buffers), so remote block bytes can also travel over a plain
TCP connection with a tiny framing. The server sends straight out of the arena slots it pinned
and receives straight into the arena slots it reserved: no copy in the service process at all.
Lookups, the hottest control call, can go over it too: a gRPC round trip in Python costs about
a millisecond on a busy small host, a framed socket round trip a tenth of that. The TCP port and
the Unix-socket twin of the sidecar are announced by the ServerInfo RPC.

Framing (little-endian), one request at a time per connection:

    hello    client: b"KVD1" u16 len + bearer token, u16 len + scope   server: status
    resolve  client: u8 4, fingerprint[32], u32 n, n x key[32], f64 ttl_s      (Unix socket only)
             server: status, u16 len + arena name, u32 hit, hit x (u64 offset, u64 size, u8 tier),
                     u64 lease id
    release  client: u8 5, u64 lease id                                       server: status
    lookup   client: u8 3, fingerprint[32], u32 n, n x key[32], f64 pin_ttl_s
             server: status, u32 hit, hit x u8 tier (1 hbm, 2 dram, 3 nvme), u64 lease id
    get      client: u8 1, fingerprint[32], u32 n, n x key[32]
             server: status; per block of the present prefix: u64 size + bytes; u64 END; status
    put      client: u8 2, fingerprint[32], u8 has_parent, parent[32], u32 n, n x (key[32], u64 size),
                     then the n payloads back to back
             server: status, u32 stored
    status   u8 gRPC status code (0 = OK, ``kvstore.status.Status``), u32 len + UTF-8 message

A request that fails is answered with its status and the connection closes. The message of a
failure starts with its detail in brackets, ``[LeaseExpired] lease 7 expired ...``: the name of
the error class the server raised (``kvstore.status``), which the client raises again. A client
that knows no details reads the code alone, as before, and shows the bracket as part of the text.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.auth import Authenticator, Caller
from kvstore.dataplane import DataPlane
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvStoreError,
    ResourceExhausted,
)
from kvstore.keys import BlockKey, Fingerprint
from kvstore.status import Status, error_for, status_of
from kvstore.store import Scope

log = logging.getLogger(__name__)

MAGIC = b"KVD1"
OP_GET, OP_PUT, OP_LOOKUP, OP_RESOLVE, OP_RELEASE = 1, 2, 3, 4, 5
OP_NAMES = {OP_GET: "Get", OP_PUT: "Put", OP_LOOKUP: "Lookup", OP_RESOLVE: "Resolve", OP_RELEASE: "Release"}
TIER_CODES = {"hbm": 1, "dram": 2, "nvme": 3}  # the Tier enum of the proto
TIER_NAMES = {v: k for k, v in TIER_CODES.items()}
END = (1 << 64) - 1
_OK = struct.pack("<BI", Status.OK, 0)
IO_TIMEOUT_S = 30.0  # the client's per-operation default
REQUEST_S = 30.0  # a whole request, however its bytes trickle: well inside dataplane.LEASE_S
HELLO_S = 5.0  # magic, token and scope must arrive within this
IDLE_S = 600.0  # a connection idle between requests longer than this is closed
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_TENANT = 256
MAX_BLOCKS_PER_REQUEST = 65536


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


REARM_S = 0.25


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; ``deadline`` (``time.monotonic()``) bounds the whole read, not each recv,
    so a peer trickling bytes cannot stretch it. Without one the socket's own timeout applies."""
    got = 0
    armed_at = -REARM_S
    while got < len(view):
        if deadline is not None:
            # A timeout armed at ``armed_at`` can end a recv at most (now - armed_at) past the
            # deadline: re-arm once that passes REARM_S, not per recv (a TLS socket returns
            # one 16 KiB record per recv, and a settimeout per record costs).
            now = time.monotonic()
            if now - armed_at > REARM_S:
                sock.settimeout(time_left_s(deadline))
                armed_at = now
        n = sock.recv_into(view[got:], len(view) - got)
        if not n:
            raise ConnectionError("peer closed the data connection mid-message")
        got += n


def send_parts(sock: socket.socket, head: bytes, body: memoryview) -> None:
    """Header and payload in one gathered send (fewer syscalls than two sendall calls)."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS: two records
        sock.sendall(head)
        sock.sendall(body)
        return
    sent = sock.sendmsg([head, body])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent - len(head) < len(body):
        sock.sendall(body[sent - len(head) :])


def send_error(sock: socket.socket, error: KvStoreError) -> None:
    """The status frame of a failure: its code and, before its message, its detail."""
    code, detail = status_of(error)
    body = f"[{detail}] {error}".encode()
    sock.sendall(struct.pack("<BI", code, len(body)) + body)


def read_status(sock: socket.socket, deadline: float | None = None) -> tuple[int, str]:
    """The code (a ``Status`` number) and message of a status frame, the detail left in."""
    code, length = struct.unpack("<BI", recv_exact(sock, 5, deadline))
    return code, recv_exact(sock, length, deadline).decode(errors="replace")


def status_error(code: int, message: str) -> KvStoreError:
    """The exception for a failed status frame: the detail taken off the message."""
    detail, sep, rest = message[1:].partition("] ") if message.startswith("[") else ("", "", "")
    if sep and detail.isidentifier():
        return error_for(code, rest, detail)
    return error_for(code, message)


def time_left_s(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError once it has passed (a zero socket timeout would
    mean non-blocking, not "no time left")."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left


@dataclass
class _Session:
    caller: Caller
    namespace: str
    deadline: float = 0.0  # time.monotonic() by which the current request must be done

    def begin(self) -> None:
        """A request starts: it gets REQUEST_S, all of it, however its bytes trickle in."""
        self.deadline = time.monotonic() + REQUEST_S


def _send(conn: socket.socket, deadline: float, data: bytes) -> None:
    conn.settimeout(time_left_s(deadline))
    conn.sendall(data)


class DataPort:
    """A thread per connection; ``close()`` stops accepting and waits for them."""

    def __init__(
        self,
        auth: Authenticator,
        address: str,
        plane: DataPlane,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``address`` is ``host:port`` (TCP) or ``unix:/path`` (a socket file made mode 0600);
        ``ssl_context``: TLS on every connection (TCP only), the handshake within HELLO_S."""
        self._ssl_context = ssl_context
        self.auth = auth
        self.plane = plane
        # Called after each request with the gRPC method it stands for and its seconds, so the
        # request metrics are the same whichever transport carried it.
        self.on_request: Callable[[str, float], None] | None = None
        self.unix_path: str | None = None
        self.port = 0
        if address.startswith("unix:"):
            self.unix_path = address.removeprefix("unix:").removeprefix("//")
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
            host, _, port = address.rpartition(":")
            self._listener = socket.create_server((host or "127.0.0.1", int(port)))
            self.port = self._listener.getsockname()[1]
        self._threads: set[threading.Thread] = set()
        self._idle: set[socket.socket] = set()  # connections waiting for their next request
        self._conns: set[socket.socket] = set()  # every open connection (cut at the drain's end)
        self._per_tenant: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
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

    def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting; in-flight requests get ``grace_s`` in all (one deadline shared by
        every connection, not each in turn); then every connection is cut."""
        deadline = time.monotonic() + grace_s
        self._closing.set()
        self._listener.close()
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
            session = self._hello(conn, peer, hello_deadline)
            self._admit(session)
            while not self._closing.is_set():
                op = self._next_op(conn)
                if not op:
                    return
                session.begin()
                started = time.perf_counter()
                try:
                    self._dispatch(op[0], conn, session)
                finally:
                    if self.on_request is not None and op[0] in OP_NAMES:
                        self.on_request(OP_NAMES[op[0]], time.perf_counter() - started)
        except KvStoreError as exc:
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)  # a peer that reads nothing must not hold the thread
                send_error(conn, exc)
        except (OSError, ConnectionError, struct.error) as exc:
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

    def _dispatch(self, op: int, conn: socket.socket, session: _Session) -> None:
        if op == OP_LOOKUP:
            self._lookup(conn, session)
        elif op == OP_RESOLVE:
            self._resolve(conn, session)
        elif op == OP_RELEASE:
            (lease_id,) = struct.unpack("<Q", recv_exact(conn, 8, session.deadline))
            self.plane.release(session.caller, lease_id)
            self._ok(conn, session)
        elif op == OP_GET:
            self._get(conn, session)
        elif op == OP_PUT:
            self._put(conn, session)
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

    def _ok(self, conn: socket.socket, session: _Session) -> None:
        conn.settimeout(time_left_s(session.deadline))
        conn.sendall(_OK)

    def _next_op(self, conn: socket.socket) -> bytes:
        """Wait up to IDLE_S for the next request (a connection idle longer is closed; the client
        reconnects). Within a request, the request's deadline bounds every read and write."""
        with self._lock:
            if self._closing.is_set():
                return b""
            self._idle.add(conn)
        conn.settimeout(IDLE_S)
        try:
            return conn.recv(1)
        except TimeoutError:
            return b""
        finally:
            with self._lock:
                self._idle.discard(conn)

    def _hello(self, conn: socket.socket, peer: Any, deadline: float) -> _Session:
        """Magic, token and scope, all within HELLO_S: a slowloris is cut there."""
        if recv_exact(conn, 4, deadline) != MAGIC:
            raise InvalidArgument("not a kvstore data port client (bad magic)")
        (token_len,) = struct.unpack("<H", recv_exact(conn, 2, deadline))
        token = recv_exact(conn, token_len, deadline).decode(errors="replace")
        (scope_len,) = struct.unpack("<H", recv_exact(conn, 2, deadline))
        scope = recv_exact(conn, scope_len, deadline).decode(errors="replace")
        metadata = [("authorization", f"Bearer {token}")] if token else []
        peer_name = "unix:" if conn.family == socket.AF_UNIX else f"ipv4:{peer[0]}:{peer[1]}"
        caller = self.auth.caller(metadata, peer_name)
        session = _Session(caller, self.auth.namespace(caller, scope), deadline)
        self._ok(conn, session)
        return session

    def _keys(self, conn: socket.socket, session: _Session) -> tuple[Fingerprint, list[BlockKey]]:
        fingerprint = Fingerprint(recv_exact(conn, 32, session.deadline))
        (n,) = struct.unpack("<I", recv_exact(conn, 4, session.deadline))
        if n > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgument(f"at most {MAX_BLOCKS_PER_REQUEST} blocks per request, got {n}")
        raw = recv_exact(conn, 32 * n, session.deadline)
        return fingerprint, [BlockKey(raw[i * 32 : (i + 1) * 32]) for i in range(n)]

    def _resolve(self, conn: socket.socket, session: _Session) -> None:
        """Same-host restore: arena slots of the present prefix, pinned under a lease."""
        fingerprint, keys = self._keys(conn, session)
        (ttl_s,) = struct.unpack("<d", recv_exact(conn, 8, session.deadline))
        if conn.family != socket.AF_UNIX:
            raise FailedPrecondition(
                "resolve hands out arena slots: same-host clients on the Unix socket only"
            )
        scope = Scope(session.namespace, fingerprint)
        resolved = self.plane.resolve(session.caller, scope, keys, ttl_s if ttl_s > 0 else None)
        name = self.plane.arena().arena.name.encode()
        body = [struct.pack("<H", len(name)), name, struct.pack("<I", len(resolved.slots))]
        body.extend(
            struct.pack("<QQB", slot.offset, slot.size_bytes, TIER_CODES[tier])
            for slot, tier in zip(resolved.slots, resolved.tiers, strict=True)
        )
        body.append(struct.pack("<Q", resolved.lease.lease_id if resolved.lease else 0))
        self._ok(conn, session)
        _send(conn, session.deadline, b"".join(body))

    def _lookup(self, conn: socket.socket, session: _Session) -> None:
        fingerprint, keys = self._keys(conn, session)
        (pin_ttl_s,) = struct.unpack("<d", recv_exact(conn, 8, session.deadline))
        scope = Scope(session.namespace, fingerprint)
        result = self.plane.lookup(session.caller, scope, keys, pin_ttl_s if pin_ttl_s > 0 else None)
        tiers = bytes(TIER_CODES[t] for t in result.tiers)
        lease_id = result.lease.lease_id if result.lease else 0
        self._ok(conn, session)
        _send(
            conn, session.deadline, struct.pack("<I", result.hit_blocks) + tiers + struct.pack("<Q", lease_id)
        )

    def _get(self, conn: socket.socket, session: _Session) -> None:
        fingerprint, keys = self._keys(conn, session)
        scope = Scope(session.namespace, fingerprint)
        self.plane.arena()
        self._ok(conn, session)  # from here on a failure can only close the connection

        def send(key: BlockKey, payload: memoryview) -> None:  # straight out of the pinned slot
            conn.settimeout(time_left_s(session.deadline))
            send_parts(conn, struct.pack("<Q", len(payload)), payload)

        for _ in self.plane.read(session.caller, scope, keys, send):
            pass
        _send(conn, session.deadline, struct.pack("<Q", END))
        self._ok(conn, session)

    def _put(self, conn: socket.socket, session: _Session) -> None:
        deadline = session.deadline
        fingerprint = Fingerprint(recv_exact(conn, 32, deadline))
        has_parent, parent_raw = struct.unpack("<B32s", recv_exact(conn, 33, deadline))
        (n,) = struct.unpack("<I", recv_exact(conn, 4, deadline))
        if n > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgument(f"at most {MAX_BLOCKS_PER_REQUEST} blocks per request, got {n}")
        headers = recv_exact(conn, 40 * n, deadline)
        keys = [BlockKey(headers[i * 40 : i * 40 + 32]) for i in range(n)]
        sizes = [struct.unpack_from("<Q", headers, i * 40 + 32)[0] for i in range(n)]
        parent = BlockKey(parent_raw) if has_parent else None
        scope = Scope(session.namespace, fingerprint)
        stored = self.plane.write(
            session.caller, scope, parent, keys, sizes, lambda i, view: recv_into_exact(conn, view, deadline)
        )
        self._ok(conn, session)
        _send(conn, session.deadline, struct.pack("<I", stored))


def _refuse(conn: socket.socket, message: str) -> None:
    with contextlib.suppress(OSError):
        conn.settimeout(1.0)
        send_error(conn, ResourceExhausted(message))
    conn.close()


class DataPortClient:
    """One connection to a data port; not for use from several threads at once.

    Timeouts: connecting and the hello take at most ``connect_timeout_s`` (default IO_TIMEOUT_S)
    together. Each operation then ends by ``deadline`` (a ``time.monotonic()`` value the caller
    sets before it, or None: IO_TIMEOUT_S per socket operation). A timeout raises TimeoutError
    and leaves the stream mid-message: the connection must be closed, never reused.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        scope: str = "",
        unix_path: str = "",
        connect_timeout_s: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str = "",
    ) -> None:
        timeout_s = IO_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s
        self.deadline: float | None = time.monotonic() + timeout_s  # the hello's, until it is done
        self.last_used = time.monotonic()  # the owner's note, against the server's IDLE_S
        self._default_timeout = False  # the socket's timeout is IO_TIMEOUT_S
        if unix_path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            try:
                self.sock.connect(unix_path)
            except OSError:
                self.sock.close()
                raise
        else:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                try:
                    self.sock = ssl_context.wrap_socket(self.sock, server_hostname=server_name or host)
                except OSError:
                    self.sock.close()
                    raise
        token_b, scope_b = (token or "").encode(), scope.encode()
        try:
            self._arm()
            self.sock.sendall(
                MAGIC + struct.pack("<H", len(token_b)) + token_b + struct.pack("<H", len(scope_b)) + scope_b
            )
            self._check()
        except OSError:
            self.sock.close()
            raise
        self.deadline = None

    def _arm(self) -> None:
        """Bound the next send by the deadline (sendall's timeout covers the whole send); without
        one, put back IO_TIMEOUT_S if a deadline changed it (a syscall saved on the hot path)."""
        if self.deadline is not None:
            self.sock.settimeout(time_left_s(self.deadline))
            self._default_timeout = False
        elif not self._default_timeout:
            self.sock.settimeout(IO_TIMEOUT_S)
            self._default_timeout = True

    def _recv(self, n: int) -> bytes:
        return recv_exact(self.sock, n, self.deadline)

    def _check(self) -> None:
        code, message = read_status(self.sock, self.deadline)
        if code != Status.OK:
            self.sock.close()
            raise status_error(code, message)

    def resolve(
        self, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float
    ) -> tuple[str, list[tuple[int, int]], tuple[str, ...], int]:
        """(arena name, (offset, size) of each block of the present prefix, their tiers, lease id)."""
        _check_ids(fingerprint, keys)
        self._arm()
        self.sock.sendall(
            struct.pack("<B", OP_RESOLVE)
            + fingerprint
            + struct.pack("<I", len(keys))
            + b"".join(keys)
            + struct.pack("<d", ttl_s)
        )
        self._check()
        (name_len,) = struct.unpack("<H", self._recv(2))
        arena_name = self._recv(name_len).decode()
        (hit,) = struct.unpack("<I", self._recv(4))
        raw = self._recv(17 * hit + 8)
        slots, tiers = [], []
        for i in range(hit):
            offset, size, tier = struct.unpack_from("<QQB", raw, 17 * i)
            slots.append((offset, size))
            tiers.append(TIER_NAMES.get(tier, "unknown"))
        (lease_id,) = struct.unpack_from("<Q", raw, 17 * hit)
        return arena_name, slots, tuple(tiers), int(lease_id)

    def release(self, lease_id: int) -> None:
        self._arm()
        self.sock.sendall(struct.pack("<BQ", OP_RELEASE, lease_id))
        self._check()

    def lookup(
        self, fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float = 0.0
    ) -> tuple[int, tuple[str, ...], int]:
        """(hit blocks, tier of each hit, lease id or 0)."""
        _check_ids(fingerprint, keys)
        self._arm()
        self.sock.sendall(
            struct.pack("<B", OP_LOOKUP)
            + fingerprint
            + struct.pack("<I", len(keys))
            + b"".join(keys)
            + struct.pack("<d", pin_ttl_s)
        )
        self._check()
        (hit,) = struct.unpack("<I", self._recv(4))
        tiers = tuple(TIER_NAMES.get(code, "unknown") for code in self._recv(hit))
        (lease_id,) = struct.unpack("<Q", self._recv(8))
        return hit, tiers, lease_id

    def _request_get(self, fingerprint: bytes, keys: Sequence[bytes]) -> None:
        _check_ids(fingerprint, keys)
        self._arm()
        self.sock.sendall(
            struct.pack("<B", OP_GET) + fingerprint + struct.pack("<I", len(keys)) + b"".join(keys)
        )
        self._check()

    def get_into(self, fingerprint: bytes, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        """Copy the present prefix into ``outs`` (each at least as long as its block)."""
        self._request_get(fingerprint, keys)
        n = 0
        while True:
            (size,) = struct.unpack("<Q", self._recv(8))
            if size == END:
                break
            if n >= len(outs) or len(outs[n]) < size:
                raise InvalidArgument(f"block {n} of {size} B does not fit its buffer")
            recv_into_exact(self.sock, outs[n][:size], self.deadline)
            n += 1
        self._check()
        return n

    def get(self, fingerprint: bytes, keys: Sequence[bytes]) -> list[bytes]:
        self._request_get(fingerprint, keys)
        blocks: list[bytes] = []
        while True:
            (size,) = struct.unpack("<Q", self._recv(8))
            if size == END:
                break
            blocks.append(self._recv(size))
        self._check()
        return blocks

    def put(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[bytes | bytearray | memoryview],
        parent: bytes | None = None,
    ) -> int:
        _check_ids(fingerprint, keys if parent is None else [*keys, parent])
        head = [
            struct.pack("<B", OP_PUT),
            fingerprint,
            struct.pack("<B32s", parent is not None, parent or b""),
        ]
        head.append(struct.pack("<I", len(keys)))
        head.extend(key + struct.pack("<Q", len(block)) for key, block in zip(keys, blocks, strict=True))
        self._arm()
        try:
            self.sock.sendall(b"".join(head))
            for block in blocks:
                self.sock.sendall(block)
        except OSError:
            pass  # the server refused early and closed: its status says why
        self._check()
        (stored,) = struct.unpack("<I", self._recv(4))
        return int(stored)

    def close(self) -> None:
        self.sock.close()


def _check_ids(fingerprint: bytes, keys: Sequence[bytes]) -> None:
    """The framing has no lengths for ids: refuse a wrong one before it desynchronizes the stream."""
    if len(fingerprint) != 32 or any(len(k) != 32 for k in keys):
        raise InvalidArgument("keys and fingerprints are 32 bytes")
