"""The client's seam: its address parsed once, at connect, and its transport chosen once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvstore.address import UnixAddress, parse_address
from kvstore.client import Client, connect
from kvstore.errors import InvalidArgument
from kvstore.keys import block_keys
from tests.service_fixtures import MODEL, Served, served

__all__ = ["served"]


@pytest.mark.parametrize("text", ["localhost", "unix:kvstore.sock", "dns:///host:5000", "host:0"])
def test_a_malformed_address_is_refused_at_connect(text: str) -> None:
    with pytest.raises(InvalidArgument, match="unix:///absolute/path or host:port"):
        connect(text)


def test_the_transport_is_chosen_once_per_client(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the server has a data port is asked once, by the first data call, whatever the
    calls and threads after it; a gRPC-only client never asks. A client takes a parsed address
    as it takes the text."""
    asked: list[str] = []
    real = Client.server_info

    def counted(self: Client) -> dict[str, Any]:
        asked.append(str(self.address))
        return real(self)

    monkeypatch.setattr(Client, "server_info", counted)
    for address in (served.unix, parse_address(served.tcp)):
        asked.clear()
        with connect(address, token="tok-a") as kv:
            _data_calls(kv, asked)
            assert asked == [str(kv.address)]
            assert isinstance(kv.address, UnixAddress) == (address == served.unix)
    asked.clear()
    with connect(served.tcp, token="tok-a", data_plane="grpc") as kv:
        fp = kv.register(MODEL)
        assert kv.lookup(fp, [bytes(32)]) == 0
    assert asked == []


def _data_calls(kv: Client, asked: list[str]) -> None:
    """Control calls, then data calls from three threads and this one."""
    fp = kv.register(MODEL)
    tokens = list(range(4 * MODEL.tokens_per_block))
    keys = block_keys(fp, tokens, MODEL.tokens_per_block, cache_salt=str(kv.address))
    blocks = [bytes([i]) * MODEL.block_bytes for i in range(len(keys))]
    assert asked == []  # control calls choose nothing
    assert kv.put(fp, keys, blocks) == len(keys)

    def reads() -> tuple[list[int], list[bool]]:
        rounds = range(3)
        return [kv.lookup(fp, keys) for _ in rounds], [kv.get(fp, keys) == blocks for _ in rounds]

    with ThreadPoolExecutor(3) as pool:
        for future in [pool.submit(reads) for _ in range(3)]:
            assert future.result() == ([len(keys)] * 3, [True] * 3)
    assert kv.lookup_tiers(fp, keys).hit_blocks == len(keys)
