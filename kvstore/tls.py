"""TLS for the TCP listeners (gRPC and the raw data port) and for clients that reach them.

Server: ``server.tls_cert_file`` and ``server.tls_key_file`` (PEM) turn TLS on for every TCP
listener; ``server.tls_client_ca_file`` also requires a client certificate signed by that CA
(mutual TLS). The Unix sockets stay plain: they are local and 0600. Client: ``ClientTls`` names
the CA that signed the server's certificate (and, for mutual TLS, the client's own pair); the
same settings serve gRPC and the data port.

Files are read once, at start; a missing or unreadable file is a ``FailedPrecondition`` naming
the setting.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.errors import FailedPrecondition


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"{setting} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ServerTls:
    cert_file: str
    key_file: str
    client_ca_file: str = ""

    def grpc_credentials(self) -> grpc.ServerCredentials:
        key = _read(self.key_file, "server.tls_key_file")
        cert = _read(self.cert_file, "server.tls_cert_file")
        ca = _read(self.client_ca_file, "server.tls_client_ca_file") if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file:
                context.load_verify_locations(self.client_ca_file)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            raise FailedPrecondition(f"TLS certificate or key unusable: {exc}") from None
        return context


@dataclass(frozen=True)
class ClientTls:
    """``ca_file``: the CA of the server's certificate (empty: the system's); ``cert_file`` and
    ``key_file``: this client's own, for servers that require mutual TLS; ``server_name``: the
    name to check the certificate against (default: the address's host)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca_file, "tls ca_file") if self.ca_file else None
        key = _read(self.key_file, "tls key_file") if self.key_file else None
        cert = _read(self.cert_file, "tls cert_file") if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def ssl_context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise FailedPrecondition(f"tls ca_file {self.ca_file}: {exc.strerror or exc}") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file or None)
            except (OSError, ssl.SSLError) as exc:
                raise FailedPrecondition(f"TLS client certificate or key unusable: {exc}") from None
        return context
