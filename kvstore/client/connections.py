"""A client's connections to the server's raw data port (``kvstore.client.dataport``).

One connection per thread and scope: a connection carries one request at a time, and its hello
fixed its scope. The server's ServerInfo says whether it has a data port (TCP) and a data socket
(its Unix twin, for clients on the Unix socket); it is asked once, on first use. A connection is
opened on first use, dropped after a failed call (the server closed it, or its stream stopped
mid-message: it cannot be reused) and replaced before it has sat idle long enough for the server
to close it (``IDLE_S``). Every failure leaves here translated (``kvstore.client.translate``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvstore.address import Address, TcpAddress
from kvstore.client.dataport import DataPortClient
from kvstore.client.translate import translated
from kvstore.tls import ClientTls
from kvstore.wire import IDLE_S

R = TypeVar("R")
_IDLE_MARGIN_S = 30.0  # replace a connection this long before the server would close it


class DataConnections:
    """``deadline()`` gives the ``time.monotonic()`` by which the next operation must end (None:
    the data port's per-operation default); ``server_info()`` is the client's ServerInfo call.
    Safe to share between threads: each thread uses only its own connections."""

    def __init__(
        self,
        address: Address,
        token: str | None,
        tls: ClientTls | None,
        deadline: Callable[[], float | None],
        server_info: Callable[[], dict[str, Any]],
    ) -> None:
        self._unix = address.same_host
        self._host = address.host.strip("[]") if isinstance(address, TcpAddress) else ""
        self._token = token
        self._tls = tls
        self._ssl_context = tls.ssl_context() if tls is not None else None
        self._deadline = deadline
        self._server_info = server_info
        self._port: int | None = None  # None: not asked yet; 0: the server has none
        self._socket = ""
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[DataPortClient] = []

    def available(self) -> bool:
        """Whether the server offers this client a data connection."""
        if self._port is None:
            info = self._server_info()
            self._port, self._socket = int(info["data_port"]), str(info["data_socket"])
        return bool(self._socket if self._unix else self._port)

    def call(self, scope: str, call: Callable[[DataPortClient], R]) -> R:
        """``call(conn)`` on this thread's connection for ``scope``; a failure drops it."""
        conn = self._connection(scope)
        conn.begin(self._deadline())
        conn.last_used = time.monotonic()
        try:
            with translated("the data port call"):
                return call(conn)
        except BaseException:
            # The stream may have stopped mid-message (and the server closes a connection on
            # an error it sends): never reuse it.
            self._conns().pop(scope, None)
            conn.close()
            raise

    @property
    def checksum_failures(self) -> int:
        """Blocks a get received that failed the checksum the server sent with them."""
        with self._lock:
            return sum(conn.checksum_failures for conn in self._all)

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()

    def _conns(self) -> dict[str, DataPortClient]:
        conns: dict[str, DataPortClient] = self._local.__dict__.setdefault("conns", {})
        return conns

    def _connection(self, scope: str) -> DataPortClient:
        conns = self._conns()
        conn = conns.get(scope)
        if conn is not None and time.monotonic() - conn.last_used > IDLE_S - _IDLE_MARGIN_S:
            conns.pop(scope, None)  # rather than find the server closed it mid-request
            conn.close()
            conn = None
        if conn is None:
            deadline = self._deadline()
            connect_s = None if deadline is None else deadline - time.monotonic()
            with translated("connecting to the data port"):
                if self._unix:
                    conn = DataPortClient(
                        "", 0, self._token, scope, unix_path=self._socket, connect_timeout_s=connect_s
                    )
                else:
                    assert self._port
                    conn = DataPortClient(
                        self._host,
                        self._port,
                        self._token,
                        scope,
                        connect_timeout_s=connect_s,
                        ssl_context=self._ssl_context,
                        server_name=self._tls.server_name if self._tls is not None else "",
                    )
            conns[scope] = conn
            with self._lock:
                self._all.append(conn)
        return conn
