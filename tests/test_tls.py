"""TLS on the TCP listeners: gRPC and the data port both speak it when configured, a plain or
wrongly trusting client is refused, and mutual TLS refuses a client without a certificate."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.tls_certs import Certs, make_certs
from kvstore.client import connect
from kvstore.errors import Unavailable
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from kvstore.tls import ClientTls
from tests.service_fixtures import MODEL, blocks_for, chain, settings_for


@pytest.fixture(scope="module")
def certs() -> Iterator[Certs]:
    folder = Path(tempfile.mkdtemp(prefix="kvtls-"))
    yield make_certs(folder)
    shutil.rmtree(folder, ignore_errors=True)


def tls_server(certs: Certs, mutual: bool) -> tuple[RunningServer, str]:
    data_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    extra = {"server.tls_cert_file": str(certs.server_cert), "server.tls_key_file": str(certs.server_key)}
    if mutual:
        extra["server.tls_client_ca_file"] = str(certs.ca)
    return start_server(load_settings(env={}, overrides=settings_for(data_dir, **extra))), data_dir


@pytest.mark.parametrize("data_plane", ["auto", "grpc"])
def test_blocks_travel_over_tls(certs: Certs, data_plane: str) -> None:
    server, data_dir = tls_server(certs, mutual=False)
    try:
        assert server.tcp_address is not None
        fp = MODEL.fingerprint()
        keys = chain(6, salt=f"tls-{data_plane}")
        blocks = blocks_for(keys)
        tls = ClientTls(ca_file=str(certs.ca))
        with connect(server.tcp_address, token="tok-a", tls=tls, data_plane=data_plane) as kv:
            kv.put(fp, keys, blocks)
            assert kv.lookup(fp, keys) == 6
            assert kv.get(fp, keys) == blocks
        with connect(server.tcp_address, token="tok-a", timeout_s=3) as plain, pytest.raises(Unavailable):
            plain.lookup(fp, keys)  # TLS is not optional on a TLS listener
        other = make_certs(Path(data_dir) / "other", ca_name="someone else's CA")
        with (
            connect(
                server.tcp_address, token="tok-a", tls=ClientTls(ca_file=str(other.ca)), timeout_s=3
            ) as wrong,
            pytest.raises(Unavailable),
        ):
            wrong.lookup(fp, keys)  # a server this client does not trust
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_mutual_tls_refuses_a_client_without_a_certificate(certs: Certs) -> None:
    server, data_dir = tls_server(certs, mutual=True)
    try:
        assert server.tcp_address is not None
        fp = MODEL.fingerprint()
        keys = chain(2, salt="mtls")
        anonymous = ClientTls(ca_file=str(certs.ca))
        with (
            connect(server.tcp_address, token="tok-a", tls=anonymous, timeout_s=3) as kv,
            pytest.raises(Unavailable),
        ):
            kv.lookup(fp, keys)
        known = ClientTls(
            ca_file=str(certs.ca), cert_file=str(certs.client_cert), key_file=str(certs.client_key)
        )
        with connect(server.tcp_address, token="tok-a", tls=known) as kv:
            kv.put(fp, keys, blocks_for(keys))
            assert kv.lookup(fp, keys) == 2
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_the_native_tls_probe_measures_tls_and_plain_tcp(certs: Certs) -> None:
    """bench service's ceiling row: the C probe builds where a compiler and OpenSSL headers
    exist and reports both figures; elsewhere it says why instead of failing the bench."""
    from benchmarks import tls_ceiling

    outcome = tls_ceiling.measure(certs.server_cert, certs.server_key, nbytes=64 << 20, rounds=1)
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        assert outcome == "no C compiler"
        return
    if isinstance(outcome, str):
        assert outcome.startswith("could not build"), outcome
        assert not Path("/usr/include/openssl/ssl.h").exists()
        return
    tls, tcp = outcome
    assert tls > 0 and tcp > 0
