"""Clients that stall: one tenant cannot occupy every worker, the health check still answers,
and a stream that stays open past ``server.stream_timeout_s`` is cut."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import connect
from kvstore.errors import ResourceExhausted
from kvstore.frames import encode_frame
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from tests.service_fixtures import MODEL, settings_for


@pytest.fixture
def small_server() -> Iterator[RunningServer]:
    data_dir = tempfile.mkdtemp(prefix="kvslow-", dir="/tmp")
    overrides = settings_for(
        data_dir,
        **{"server.workers": "6", "server.max_requests_per_tenant": "2", "server.stream_timeout_s": "2s"},
    )
    server = start_server(load_settings(env={}, overrides=overrides))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def stalled_put(address: str, token: str, release: threading.Event) -> grpc.Future:
    """A Put stream that sends one frame, then nothing until ``release``."""
    channel = grpc.insecure_channel(address)
    put = channel.stream_unary("/kvstore.v1.KvStore/Put", response_deserializer=lambda b: b)
    key = b"\x01" * 32

    def frames() -> Iterator[bytes]:
        yield encode_frame(key, b"x" * MODEL.block_bytes, MODEL.fingerprint(), b"", "")
        release.wait(30)

    return put.future(frames(), metadata=(("authorization", f"Bearer {token}"),))


def test_a_stalling_tenant_gets_its_share_and_no_more(small_server: RunningServer) -> None:
    tcp = small_server.tcp_address
    assert tcp is not None
    release = threading.Event()
    try:
        stalled = [stalled_put(tcp, "tok-a", release) for _ in range(2)]
        time.sleep(0.5)  # both are in flight now
        third = stalled_put(tcp, "tok-a", release)
        with pytest.raises(grpc.RpcError) as refused:
            third.result(timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_requests_per_tenant" in (refused.value.details() or "")
        with grpc.insecure_channel(tcp) as channel:  # the health check answers meanwhile
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        with connect(tcp, token="tok-b", timeout_s=5) as b:  # and another tenant is served
            assert b.lookup(MODEL.fingerprint(), [b"\x02" * 32]) == 0
        started = time.monotonic()
        for call in stalled:  # cut by the server after stream_timeout_s, not by the client
            with pytest.raises(grpc.RpcError) as cut:
                call.result(timeout=15)
            assert cut.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - started < 10
        with connect(tcp, token="tok-a", timeout_s=5) as a:  # its places are free again
            assert a.lookup(MODEL.fingerprint(), [b"\x02" * 32]) == 0
    finally:
        release.set()


def test_the_limit_is_a_clear_error_through_the_client(small_server: RunningServer) -> None:
    tcp = small_server.tcp_address
    assert tcp is not None
    release = threading.Event()
    try:
        stalled = [stalled_put(tcp, "tok-c", release) for _ in range(2)]
        time.sleep(0.5)
        with (
            connect(tcp, token="tok-c", timeout_s=5, data_plane="grpc") as c,
            pytest.raises(ResourceExhausted),
        ):
            c.stats()
    finally:
        release.set()
        for call in stalled:
            call.exception(timeout=15)  # released: they end, stored or cut
