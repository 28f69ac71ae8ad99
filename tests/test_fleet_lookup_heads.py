"""A lookup over a shared kvstore node reads copies' headers, not their values, on real
processes: a real ``kvstore serve`` node behind a counting TCP relay (127.0.0.2 to 127.0.0.1, its
gRPC port and its data port), the sidecars' own remote tier code in front. With a cutoff to check
(a retention, an invalidation), plain and sealed, a lookup of 16 blocks of 8 KiB moves about the
header and the bytes asked per key back from the node (~270 B), not the 8 KiB values it moved
before. And the node's head request itself: the first bytes of each block of the present prefix,
out of nvme too without promoting it, and nothing of another tenant's."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.server.builder import build_remote
from kvstore.server.config import load_settings
from kvstore.store.model import Scope, namespace_of_tier_key, tier_key
from tests.service_fixtures import MODEL, blocks_for, chain, process_settings
from tiers.cipher import KEY_ID_BYTES, BlockCipher
from tiers.remote import HEAD_SLACK, RemoteBlock, RemoteTier
from tiers.sealed_remote import SealedRemote

NAMESPACE = "t/local"
KEYS = 16
RELAY_HOST = "127.0.0.2"  # the node listens on 127.0.0.1: the same ports here are the relay's
# What a heads call may move back per key: the u16, the header's slack, the bytes asked (the key
# id, sealed) and the answer's u32 length; plus the call's own status and counts.
PER_KEY_BYTES = 2 + HEAD_SLACK + KEY_ID_BYTES + 4
CALL_BYTES = 2048  # the status, counts, and room for a gRPC ping or two


class CountingRelay:
    """Relays each of ``ports`` from RELAY_HOST to 127.0.0.1, counting the bytes that come back."""

    def __init__(self, ports: list[int]) -> None:
        self.back = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listeners = [socket.create_server((RELAY_HOST, port)) for port in ports]
        for listener in self._listeners:
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if counted:
                    with self._lock:
                        self.back += len(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in [*self._listeners, *self._socks]:
            sock.close()


@pytest.fixture(scope="module")
def node() -> Iterator[ServerProcess]:
    node = ServerProcess(process_settings(), tcp=True)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def relayed(node: ServerProcess) -> Iterator[tuple[CountingRelay, str]]:
    """The relay and the node's address through it."""
    with connect(node.tcp, token="tok-a") as kv:
        data_port = int(kv.server_info()["data_port"])
    grpc_port = int(node.tcp.rpartition(":")[2])
    try:
        relay = CountingRelay([grpc_port, data_port])
    except OSError as exc:  # a loopback without 127.0.0.2 (not Linux's default)
        pytest.skip(f"cannot listen on {RELAY_HOST}: {exc}")
    yield relay, f"{RELAY_HOST}:{grpc_port}"
    relay.close()


def sidecar_tier(address: str) -> RemoteTier:
    remote = {"remote.backend": "kvstore", "remote.nodes": address, "remote.tokens": f"{NAMESPACE}=tok-a"}
    tier = build_remote(load_settings(env={}, overrides=process_settings(**remote)))
    assert tier is not None
    return tier


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_lookup_with_a_cutoff_moves_headers_not_values(
    relayed: tuple[CountingRelay, str], sealed: bool
) -> None:
    relay, address = relayed
    keys_dir = tempfile.TemporaryDirectory(prefix="kvk-", dir="/tmp")
    tier = sidecar_tier(address)
    if sealed:
        tier = SealedRemote(tier, BlockCipher(Path(keys_dir.name), namespace_of_tier_key))
    scope = Scope(NAMESPACE, MODEL.fingerprint())
    block_keys = chain(KEYS, f"heads-bytes-{sealed}")
    keys = [tier_key(scope, k) for k in block_keys]
    now = time.time()
    try:
        payloads = blocks_for(block_keys)
        blocks = [RemoteBlock(k, scope.fingerprint, b, now) for k, b in zip(keys, payloads, strict=True)]
        assert tier.put_many(blocks) == KEYS
        assert tier.heads(keys[:1], scope.fingerprint, now - 60) == [b""]  # connections made
        before = relay.back
        heads = tier.heads(keys, scope.fingerprint, now - 60)
        moved = relay.back - before
        assert heads == [b""] * KEYS
        # whole values were KEYS x (8 KiB + header): ~132 KiB; headers are ~4.3 KiB
        assert moved <= KEYS * PER_KEY_BYTES + CALL_BYTES, f"{moved} B back for {KEYS} keys"
        assert tier.heads(keys, scope.fingerprint, now + 60) == [None] * KEYS  # born before: refused
        assert tier.contains(keys) == [False] * KEYS  # and deleted there, as a get would
    finally:
        tier.delete_many(keys)
        tier.close()
        keys_dir.cleanup()


def test_a_nodes_head_request_reads_in_place_and_only_the_callers_own(node: ServerProcess) -> None:
    keys = chain(4, "heads-request")
    blocks = blocks_for(keys)
    with connect(node.tcp, token="tok-a") as kv, connect(node.tcp, token="tok-b") as other:
        fp = kv.register(MODEL)
        assert kv.put(fp, keys[:3], blocks[:3]) == 3
        assert kv.demote("dram", fp) >= 3  # out of the arena: the heads come from nvme
        promotions = kv.stats()["counters"].get("promotions", 0)
        assert kv.heads(fp, keys, 100) == [b[:100] for b in blocks[:3]]  # the present prefix
        assert kv.lookup_tiers(fp, keys).tiers == ("nvme",) * 3  # left where they were
        assert kv.stats()["counters"].get("promotions", 0) == promotions
        other.register(MODEL)
        assert other.heads(fp, keys, 100) == []  # tenant-b holds none of tenant-a's
        with connect(node.tcp, token="tok-a", data_plane="grpc") as over_grpc:
            assert over_grpc.heads(fp, keys, 100) == [b[:100] for b in blocks[:3]]
        kv.delete(fp, keys)
