"""A server's life seen from its clients: the service demo against a live server, a client that
outlives a server restart without reading the old arena, idle data connections that neither
die early nor hold up a drain. Each test starts its own server."""

from __future__ import annotations

import pytest

from kvstore.client import connect
from tests.service_fixtures import BLOCK, MODEL, blocks_for, chain


def test_the_service_demo_runs_against_a_live_server() -> None:
    import shutil
    import tempfile

    from kvstore.cli.demo_service import run_service_demo
    from kvstore.server.config import load_settings
    from kvstore.server.serve import start_server
    from tests.service_fixtures import settings_for

    data_dir = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    overrides = settings_for(data_dir, **{"dram.capacity_bytes": "128MiB", "dram.page_bytes": "32MiB"})
    server = start_server(load_settings(env={}, overrides=overrides))
    lines: list[str] = []
    try:
        run_service_demo(server.unix_address, server.tcp_address or "", "tok-a", lines.append)
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    text = "\n".join(lines)
    assert "wrote 93 of 93 blocks" in text
    assert "restored 93 blocks" in text and "byte for byte" in text  # a mismatch would raise
    assert "93 of 93 blocks present, fetched 93" in text
    assert "refused (Unauthenticated)" in text
    assert "another tenant (the socket's default one): 0 blocks visible" in text


@pytest.mark.parametrize("data_plane", ["auto", "grpc"], ids=["data-socket", "grpc"])
def test_a_client_survives_a_server_restart_without_reading_a_stale_arena(data_plane: str) -> None:
    import shutil
    import tempfile

    from kvstore.errors import KvStoreError
    from kvstore.server.config import load_settings
    from kvstore.server.serve import start_server
    from tests.service_fixtures import settings_for

    data_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    settings = load_settings(env={}, overrides=settings_for(data_dir))
    server = start_server(settings)
    keys = chain(4)
    blocks = blocks_for(keys)
    outs = [memoryview(bytearray(BLOCK)) for _ in keys]
    try:
        kv = connect(server.unix_address, data_plane=data_plane)
        fp = kv.register(MODEL)
        kv.write(fp, keys, blocks)
        server.stop()  # blocks spill to nvme; the arena goes away
        server = start_server(settings)  # a new arena under a new name
        for _ in range(3):  # the first call may meet the dead connection
            try:
                assert kv.read_into(fp, keys, outs) == 4
                break
            except KvStoreError:
                continue
        assert [bytes(o) for o in outs] == blocks
        more = chain(2, "after")
        more_blocks = blocks_for(more)
        assert kv.write(fp, more, more_blocks) == 2  # written into the new arena, not the old one
        assert kv.get(fp, more) == more_blocks
        kv.close()
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_idle_data_connections_live_on_and_do_not_hold_up_a_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    import tempfile
    import time

    from kvstore.client import dataport
    from kvstore.server.config import load_settings
    from kvstore.server.serve import start_server
    from tests.service_fixtures import settings_for

    monkeypatch.setattr(dataport, "IO_TIMEOUT_S", 0.3)  # the per-request deadline, shortened
    data_dir = tempfile.mkdtemp(prefix="kvi-", dir="/tmp")
    server = start_server(load_settings(env={}, overrides=settings_for(data_dir)))
    try:
        clients = [connect(server.unix_address), connect(server.tcp_address or "", token="tok-a")]
        for kv in clients:
            kv.register(MODEL)
            assert kv.lookup(MODEL.fingerprint(), chain(2)) == 0  # opens its data connection
        time.sleep(0.8)  # idle for longer than a request may take
        for kv in clients:
            assert kv.lookup(MODEL.fingerprint(), chain(2)) == 0  # same connection, still served
        start = time.perf_counter()
        server.stop()  # drain_grace_s is 2 s; idle connections must not use it up
        assert time.perf_counter() - start < 1.5
        for kv in clients:
            kv.close()
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
