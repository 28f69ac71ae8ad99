"""Errors across the wire: every class the server raises comes back as the same class over both
transports (gRPC and the data port), the detail telling apart classes that share a code; the
status numbers are gRPC's; and a client whose server is gone raises Unavailable, never a raw
OSError or grpc.RpcError, from every public method."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore import errors
from kvstore.client import Client, connect
from kvstore.errors import FailedPrecondition, KvStoreError, LeaseExpired, LeaseNotFound, Unavailable
from kvstore.server.config import load_settings
from kvstore.server.serve import RunningServer, start_server
from kvstore.status import Status, error_for, status_of
from kvstore.tls import ClientTls
from kvstore.wire import MAGIC, OP_RELEASE, read_status
from tests.service_fixtures import BLOCK, MODEL, Served, blocks_for, chain, settings_for
from tests.service_fixtures import served as served  # the fixture
from tiers.dram import Arena

ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__]
TRANSPORTS = {"data-port": "auto", "grpc": "grpc"}


# ----------------------------------------------------------------- the table


def test_status_numbers_are_grpcs() -> None:
    # The data port writes these numbers on the wire: they must stay gRPC's own.
    assert {s.name: s.value for s in Status} == {c.name: c.value[0] for c in grpc.StatusCode}


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_class_survives_its_own_status(cls: type[KvStoreError]) -> None:
    code, detail = status_of(cls("boom"))
    assert type(error_for(code, "boom", detail)) is cls


def test_a_detail_refines_the_code_and_never_contradicts_it() -> None:
    assert type(error_for(Status.NOT_FOUND, "m", "LeaseExpired")) is LeaseExpired
    assert type(error_for(Status.NOT_FOUND, "m")) is errors.NotFound  # an old server: no detail
    assert type(error_for(Status.NOT_FOUND, "m", "NoSuchClass")) is errors.NotFound
    assert type(error_for(Status.NOT_FOUND, "m", "StoreFull")) is errors.NotFound  # another code's
    assert type(error_for(Status.UNAVAILABLE, "m", "DeadlineExceeded")) is Unavailable
    assert type(error_for(Status.INTERNAL, "m")) is KvStoreError


def test_a_subclass_defined_elsewhere_travels_as_its_public_ancestor() -> None:
    class TierGone(errors.StoreFull):
        pass

    assert status_of(TierGone("m")) == (Status.RESOURCE_EXHAUSTED, "StoreFull")


# ----------------------------------------------------------------- over both transports


@pytest.mark.parametrize("data_plane", TRANSPORTS.values(), ids=TRANSPORTS.keys())
def test_the_server_s_class_is_the_client_s_class(
    served: Served, data_plane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Table-driven: the store raises each class in turn; both transports carry it to the client.
    raised: list[BaseException] = []

    def lookup(*args: object, **kwargs: object) -> None:
        raise raised[-1]

    monkeypatch.setattr(served.server.store, "lookup", lookup)
    fp = MODEL.fingerprint()
    with connect(served.tcp, token="tok-a", data_plane=data_plane) as kv:
        for cls in ERROR_CLASSES:
            raised.append(cls("boom"))
            with pytest.raises(KvStoreError) as info:
                kv.lookup(fp, chain(1))
            assert type(info.value) is cls
            assert str(info.value).endswith("boom")
        # A bug is no KvStoreError of the server's: it still reaches the client as the base class.
        raised.append(RuntimeError("a bug"))
        with pytest.raises(KvStoreError) as info:
            kv.lookup(fp, chain(1))
        assert type(info.value) is KvStoreError


@pytest.mark.parametrize("data_plane", TRANSPORTS.values(), ids=TRANSPORTS.keys())
def test_lease_expired_and_lease_not_found_are_told_apart(served: Served, data_plane: str) -> None:
    import time

    fp = MODEL.fingerprint()
    keys = chain(2, salt=f"lease-{data_plane}")
    with connect(served.tcp, token="tok-a", data_plane=data_plane) as kv:
        kv.put(fp, keys, blocks_for(keys))
        with pytest.raises(LeaseNotFound):
            kv.release(987654)  # never granted
        lease = kv.lookup_tiers(fp, keys, pin_ttl_s=0.05).lease_id
        time.sleep(0.1)
        kv.lookup(fp, keys)  # any call collects expired leases
        with pytest.raises(LeaseExpired):
            kv.release(lease)


def test_the_data_port_status_frame_stays_readable_by_older_clients(served: Served) -> None:
    # An older client reads the code byte alone: NOT_FOUND, as before; the detail leads the text.
    assert served.server.data_port is not None
    with socket.create_connection(("127.0.0.1", served.server.data_port.port), timeout=10) as sock:
        token = b"tok-a"
        sock.sendall(MAGIC + struct.pack("<H", len(token)) + token + struct.pack("<H", 0))
        assert read_status(sock)[0] == Status.OK
        sock.sendall(struct.pack("<BQ", OP_RELEASE, 987654))
        code, message = read_status(sock)
    assert code == 5 and message.startswith("[LeaseNotFound] lease 987654")


# ----------------------------------------------------------------- a server that went away


@pytest.fixture
def server() -> Iterator[RunningServer]:
    data_dir = tempfile.mkdtemp(prefix="kve-", dir="/tmp")
    running = start_server(load_settings(env={}, overrides=settings_for(data_dir)))
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def public_calls(kv: Client) -> dict[str, Callable[[], object]]:
    """Every public call of a client, with arguments that would succeed on a live server."""
    fp = MODEL.fingerprint()
    keys = chain(2, salt="gone")
    outs = [memoryview(bytearray(BLOCK)) for _ in keys]
    return {
        "register": lambda: kv.register(MODEL),
        "lookup": lambda: kv.lookup(fp, keys),
        "lookup_tiers": lambda: kv.lookup_tiers(fp, keys, pin_ttl_s=5.0),
        "exists": lambda: kv.exists(fp, keys),
        "delete": lambda: kv.delete(fp, keys),
        "invalidate": lambda: kv.invalidate(fp),
        "demote": lambda: kv.demote("dram"),
        "stats": kv.stats,
        "server_info": kv.server_info,
        "release": lambda: kv.release(1),
        "put": lambda: kv.put(fp, keys, blocks_for(keys)),
        "get": lambda: kv.get(fp, keys),
        "get_into": lambda: kv.get_into(fp, keys, outs),
        "attach": kv.attach,
        "resolve": lambda: kv.resolve(fp, keys),
        "read_into": lambda: kv.read_into(fp, keys, outs),
        "reserve": lambda: kv.reserve(fp, keys, [BLOCK] * len(keys)),
        "commit": lambda: kv.commit(1),
        "abort": lambda: kv.abort(1),
        "write": lambda: kv.write(fp, keys, blocks_for(keys)),
    }


@pytest.mark.parametrize("data_plane", TRANSPORTS.values(), ids=TRANSPORTS.keys())
def test_a_client_whose_server_went_away_raises_unavailable(server: RunningServer, data_plane: str) -> None:
    warm = connect(server.unix_address, timeout_s=2, data_plane=data_plane)  # connected, arena mapped
    cold = connect(server.unix_address, timeout_s=2, data_plane=data_plane)  # never connected
    remote = connect(server.tcp_address or "", token="tok-a", timeout_s=2, data_plane=data_plane)
    warm.register(MODEL)
    warm.attach()
    remote.register(MODEL)
    assert warm.lookup(MODEL.fingerprint(), chain(1)) == remote.lookup(MODEL.fingerprint(), chain(1)) == 0
    server.stop()
    try:
        for who, kv in (("warm", warm), ("cold", cold), ("remote", remote)):
            for name, call in public_calls(kv).items():
                if name == "attach" and who == "warm":
                    continue  # mapped already: attach asks nothing of the server
                if who == "remote" and name in ("attach", "resolve", "read_into", "reserve", "write"):
                    with pytest.raises(FailedPrecondition):  # same-host calls on TCP: refused here
                        call()
                    continue
                with pytest.raises(Unavailable):
                    call()
    finally:
        for kv in (warm, cold, remote):
            kv.close()


def test_an_arena_that_cannot_be_mapped_is_unavailable(served: Served) -> None:
    with connect(served.unix) as first:
        name = first.attach().name
    os.unlink(Arena.path_of(name))  # someone cleaned /dev/shm; the server keeps its mapping
    with connect(served.unix) as kv, pytest.raises(Unavailable, match="arena"):
        kv.attach()


def test_an_unreadable_tls_file_is_a_failed_precondition(served: Served) -> None:
    with pytest.raises(FailedPrecondition, match="ca_file"):
        connect(served.tcp, token="tok-a", tls=ClientTls(ca_file="/nonexistent/ca.pem"))
