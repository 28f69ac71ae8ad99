"""A shared kvstore node on which the model is registered with its layout takes the sidecars'
copies: each is the block framed (73 bytes longer than the layout), and the node checks the
payload's length under the frame, sealed or not. Real processes: a shared ``kvstore serve`` node,
the model registered there by a client of the tenant, two sidecars over it (plain, then with
encryption on); B restores A's chain (the node refused every put before: ``InvalidArgument``,
nothing stored, B restored 0)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import connect
from kvstore.errors import InvalidArgument
from kvstore.remote.layout import FRAME_BYTES
from tests.service_fixtures import BLOCK, MODEL
from tests.test_fleet_encryption import Backend, Encrypted
from tests.test_fleet_sidecars import Sidecar, check_restored_through_the_other, sidecars


@pytest.fixture(scope="module")
def node_with_layout() -> Iterator[Sidecar]:
    node = Sidecar()
    address = node.server.tcp_address
    assert address is not None
    with connect(address, token="tok-a") as kv:
        kv.register(MODEL)
    yield node
    node.close()


def test_sidecars_restore_each_others_chain_through_a_node_with_the_layout_registered(
    node_with_layout: Sidecar,
) -> None:
    address = node_with_layout.server.tcp_address
    assert address is not None
    fleet = sidecars(backend="kvstore", nodes=address, tokens="t/local=tok-a")
    a, b = next(fleet)
    try:
        check_restored_through_the_other(a, b)
    finally:
        next(fleet, None)  # runs its finally: both sidecars closed
        cleared(address)


def test_sealed_copies_fit_the_registered_layout_too(node_with_layout: Sidecar) -> None:
    address = node_with_layout.server.tcp_address
    assert address is not None
    settings = {"backend": "kvstore", "nodes": address, "tokens": "t/local=tok-a"}
    backend = Backend(settings, raw=lambda keys: [], plant=lambda keys, values: None, clear=lambda: None)
    keys_dir = Path(tempfile.mkdtemp(prefix="kvk-", dir="/tmp"))
    a = Encrypted(backend, keys_dir)
    try:
        b = Encrypted(backend, keys_dir)
        try:
            check_restored_through_the_other(a, b)
        finally:
            b.close()
    finally:
        a.close()
        shutil.rmtree(keys_dir, ignore_errors=True)
        cleared(address)


def cleared(address: str) -> None:
    """The node's copies gone: each test stores the same chain, and a copy there is no new put."""
    with connect(address, token="tok-a") as kv:
        kv.invalidate(everything=True)


def test_the_node_still_refuses_a_block_of_another_length(node_with_layout: Sidecar) -> None:
    address = node_with_layout.server.tcp_address
    assert address is not None
    with connect(address, token="tok-a") as kv:
        fp = kv.register(MODEL)
        for size in (BLOCK - 1, BLOCK + 1, BLOCK + FRAME_BYTES + 1):
            with pytest.raises(InvalidArgument, match="layout registered"):
                kv.put(fp, [bytes([size % 256]) * 32], [bytes(size)])
