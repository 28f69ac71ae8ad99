"""A kvstore server's address, parsed once into a typed value.

    address = parse_address("unix:///run/kvstore/kvstore.sock")   # UnixAddress("/run/kvstore/kvstore.sock")
    address = parse_address("10.0.0.7:50051")                     # TcpAddress("10.0.0.7", 50051)
    connect(address, ...)                                          # the client takes it as it is

The two kinds differ in more than syntax: the Unix socket is same-host (blocks can move through
the server's mapped arena, TLS does not apply, a token is optional), TCP is not. Code asks the
value (``same_host``) rather than testing the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidArgument

_UNIX = "unix://"


@dataclass(frozen=True)
class UnixAddress:
    """The server's Unix socket on this host."""

    path: str  # absolute

    same_host = True

    @property
    def target(self) -> str:
        return f"{_UNIX}{self.path}"

    def __str__(self) -> str:
        return self.target


@dataclass(frozen=True)
class TcpAddress:
    """A TCP listener; ``host`` keeps an IPv6 literal's brackets (``[::1]``)."""

    host: str
    port: int

    same_host = False

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.target


Address = UnixAddress | TcpAddress


def parse_address(text: str, setting: str = "address", listener: bool = False) -> Address:
    """``unix:///absolute/path`` or ``host:port``; anything else is ``InvalidArgument`` naming
    ``setting`` and the two forms. A ``listener``'s address (one a server binds) may also leave
    the host empty (every interface) and name port 0 (any free port)."""
    forms = f"{setting} is unix:///absolute/path or host:port, got {text!r}"
    if text.startswith("unix:"):
        path = text[len(_UNIX) :] if text.startswith(_UNIX) else ""
        if not path.startswith("/"):
            raise InvalidArgument(forms)
        return UnixAddress(path)
    host, sep, port = text.rpartition(":")
    lowest = 0 if listener else 1
    if not sep or not (host or listener) or "://" in text or not port.isdigit():
        raise InvalidArgument(forms)
    if not lowest <= int(port) < 65536:
        raise InvalidArgument(forms)
    return TcpAddress(host, int(port))
