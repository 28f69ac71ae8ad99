"""Both data planes through a real server, byte for byte: gRPC streams and the data port over
TCP, the data socket and the mapped arena on the same host, and the way between them when the
arena cannot be mapped or has no room."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.errors import InvalidArgument
from tests.service_fixtures import BLOCK, MODEL, Served, blocks_for, chain, leases_drop_to_zero, served

__all__ = ["served"]


@pytest.mark.parametrize("data_plane", ["auto", "grpc"], ids=["data-socket", "grpc"])
def test_same_host_write_then_read_in_place(served: Served, data_plane: str) -> None:
    with connect(served.unix, data_plane=data_plane) as kv:
        fp = kv.register(MODEL)
        keys = chain(8)
        blocks = blocks_for(keys)
        assert kv.write(fp, keys, blocks) == 8
        assert kv.lookup(fp, keys) == 8
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys, outs) == 8
        assert [bytes(o) for o in outs] == blocks
        assert kv.write(fp, keys, blocks) == 0  # already there


@pytest.mark.parametrize("data_plane", ["auto", "grpc"], ids=["data-port", "grpc-streams"])
def test_remote_put_and_get_over_tcp(served: Served, data_plane: str) -> None:
    with connect(served.tcp, token="tok-a", data_plane=data_plane) as kv:
        fp = kv.register(MODEL)
        keys = chain(6)
        blocks = blocks_for(keys)
        assert kv.put(fp, keys, blocks) == 6
        assert kv.get(fp, keys) == blocks
        assert kv.get(fp, [*keys[:3], chain(1, "other")[0], keys[4]]) == blocks[:3]  # prefix only
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.get_into(fp, keys, outs) == 6
        assert [bytes(o) for o in outs] == blocks


@pytest.mark.parametrize("data_plane", ["auto", "grpc"], ids=["data-port", "grpc-streams"])
def test_get_returns_views_the_caller_keeps_and_reuses_dropped_ones(served: Served, data_plane: str) -> None:
    with connect(served.tcp, token="tok-a", data_plane=data_plane) as kv:
        fp = kv.register(MODEL)
        keys, other = chain(3), chain(3, "other")
        blocks, other_blocks = blocks_for(keys), blocks_for(other)
        kv.put(fp, keys, blocks)
        kv.put(fp, other, other_blocks)
        kept = kv.get(fp, keys)
        assert all(isinstance(v, memoryview) and not v.readonly for v in kept)
        kept_ids = {id(v.obj) for v in kept}
        assert kv.get(fp, other) == other_blocks  # a second get while the first is held ...
        assert kept == blocks  # ... never overwrites it
        dropped_ids = {id(v.obj) for v in kv.get(fp, other)}  # dropped at once
        assert {id(v.obj) for v in kv.get(fp, keys)} == dropped_ids  # received into the same memory
        assert kept_ids.isdisjoint(dropped_ids)


def test_a_same_host_get_copies_out_of_the_arena_and_reads_the_rest_through_the_socket(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the Unix socket ``get`` names the blocks' slots in one pinning lookup and copies
    them out of the mapped arena into its receive pool (the socket's get is not used, and the
    pin is released); a prefix with blocks in nvme goes through the socket, which promotes them;
    views kept are never overwritten by the next get."""
    from kvstore.client.dataport import DataPortClient

    store = served.server.store
    sent: list[int] = []
    real_get = DataPortClient.get

    def socket_get(self: DataPortClient, *args: object, **kwargs: object) -> list[memoryview]:
        sent.append(1)
        return real_get(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DataPortClient, "get", socket_get)
    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys, other = chain(4, salt="in place"), chain(3, salt="demoted")
        blocks, other_blocks = blocks_for(keys), blocks_for(other)
        kv.write(fp, other, other_blocks)
        assert store.demote("dram", fingerprint=fp) == 3
        kv.write(fp, keys, blocks)
        kept = kv.get(fp, keys)
        assert kept == blocks and all(not v.readonly for v in kept) and not sent
        assert kv.get(fp, [*keys[:2], chain(1, salt="absent")[0], keys[3]]) == blocks[:2]  # the prefix
        assert not sent
        assert kv.lookup_tiers(fp, other).tiers == ("nvme",) * 3
        assert kv.get(fp, other) == other_blocks and sent == [1]  # through the socket: promoted
        assert kv.lookup_tiers(fp, other).tiers == ("dram",) * 3
        assert kv.get(fp, other) == other_blocks and sent == [1]  # in place again
        assert kept == blocks  # never overwritten behind the caller's back
    assert leases_drop_to_zero(store)


def test_a_same_host_put_writes_in_place_and_sends_only_what_finds_no_room(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the Unix socket ``put`` copies into the arena (the socket's put is not used; a
    second put of the chain stores nothing new); with the arena full of pinned blocks the
    chain goes through the socket instead, and the store places it in nvme."""
    from kvstore.client.dataport import DataPortClient

    sent: list[int] = []
    real_put = DataPortClient.put

    def socket_put(self: DataPortClient, *args: object, **kwargs: object) -> int:
        sent.append(1)
        return real_put(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DataPortClient, "put", socket_put)
    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(4, salt="put in place")
        blocks = blocks_for(keys)
        assert kv.put(fp, keys, blocks) == 4 and not sent
        assert kv.put(fp, keys, blocks) == 0 and not sent
        assert kv.lookup_tiers(fp, keys).tiers == ("dram",) * 4 and kv.get(fp, keys) == blocks
        filler = chain(60, salt="pinned")  # with the 4 above: the 64-block arena, all pinned
        kv.write(fp, filler, blocks_for(filler))
        held = [kv.resolve(fp, keys, ttl_s=60), kv.resolve(fp, filler, ttl_s=60)]
        more = chain(3, salt="no room")
        more_blocks = blocks_for(more)
        assert kv.put(fp, more, more_blocks) == 3 and sent == [1]
        assert kv.lookup_tiers(fp, more).tiers == ("nvme",) * 3
        for resolved in held:
            kv.release(resolved.lease_id)
        assert kv.get(fp, more) == more_blocks


@pytest.mark.parametrize("why", ["no shared /dev/shm", "no arena"])
def test_a_same_host_get_that_cannot_map_the_arena_reads_through_the_socket(
    served: Served, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """A client that shares the socket but not the server's /dev/shm (another container), or a
    server that has no arena to map: ``get`` and ``put`` work through the socket, and the
    client asks to map the arena once."""
    from kvstore.client import mapping
    from kvstore.client.translate import translated
    from kvstore.errors import FailedPrecondition

    tried: list[str] = []

    def unmappable(name: str, pin_with_cuda: bool) -> None:
        tried.append(name)
        with translated(f"mapping the server's arena {name}"):
            raise FileNotFoundError(2, "No such file or directory", f"/dev/shm/{name}")

    def no_arena() -> None:
        tried.append("attach")
        raise FailedPrecondition("this server has no dram arena to move blocks through")

    if why == "no arena":
        monkeypatch.setattr(served.server.service, "_arena", no_arena)
    else:
        monkeypatch.setattr(mapping, "_map", unmappable)
    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(3, salt="no shm")
        blocks = blocks_for(keys)
        assert kv.put(fp, keys, blocks) == 3
        assert kv.get(fp, keys) == blocks
        assert kv.get(fp, keys) == blocks
        assert len(tried) == 1  # asked once


def test_get_without_a_receive_pool_still_returns_the_blocks(served: Served) -> None:
    with connect(served.tcp, token="tok-a", receive_pool_bytes=0) as kv:
        fp = kv.register(MODEL)
        keys = chain(2)
        blocks = blocks_for(keys)
        kv.put(fp, keys, blocks)
        assert kv.get(fp, keys) == blocks
    with pytest.raises(InvalidArgument):
        connect(served.tcp, receive_pool_bytes=-1)


@pytest.mark.parametrize("data_plane", ["auto", "grpc"], ids=["data-port", "grpc-streams"])
def test_get_into_refuses_a_buffer_too_small(served: Served, data_plane: str) -> None:
    with connect(served.tcp, token="tok-a", data_plane=data_plane) as kv:
        fp = kv.register(MODEL)
        keys = chain(2)
        blocks = blocks_for(keys)
        kv.put(fp, keys, blocks)
        with pytest.raises(InvalidArgument):
            kv.get_into(fp, keys, [memoryview(bytearray(BLOCK)), memoryview(bytearray(BLOCK - 1))])
        with pytest.raises(InvalidArgument):
            kv.get_into(fp, keys, [memoryview(bytearray(BLOCK))])  # fewer buffers than blocks
        wide = np.zeros(BLOCK // 4, dtype=np.float32)  # a buffer of another format: its bytes count
        assert kv.get_into(fp, keys[:1], [memoryview(wide)]) == 1
        assert wide.tobytes() == blocks[0]
        assert kv.get(fp, keys) == blocks  # the connection dropped after the failure is replaced


def test_blocks_promoted_from_nvme_read_back_exactly(served: Served) -> None:
    with connect(served.tcp, token="tok-a") as kv, connect(served.unix) as local:
        fp = kv.register(MODEL)
        keys = chain(150)  # more than the 64-block arena: the tail goes to nvme
        blocks = blocks_for(keys)
        assert kv.put(fp, keys, blocks) == 150
        tiers = kv.lookup_tiers(fp, keys).tiers
        assert "nvme" in tiers
        assert kv.get(fp, keys) == blocks
        local.register(MODEL)
        lkeys = chain(100, salt="local")
        lblocks = blocks_for(lkeys)
        local.write(fp, lkeys[:60], lblocks[:60])
        local.put(fp, lkeys[60:], lblocks[60:], parent=lkeys[59])
        # A restore reads from the head, and no more than the 64-block arena can pin at once.
        outs = [memoryview(bytearray(BLOCK)) for _ in lkeys]
        assert local.read_into(fp, lkeys, outs) == 64
        assert [bytes(o) for o in outs[:64]] == lblocks[:64]


@pytest.mark.parametrize("count", [5, 1100], ids=["parsed-in-one-call", "past-the-cached-layouts"])
def test_requests_of_few_and_of_many_keys_parse_alike(served: Served, count: int) -> None:
    """The data port parses a request's keys (and a put's headers) in one struct call up to
    RECORDS_PER_STRUCT keys and in several past it: both give the same keys in the same order."""
    from kvstore.wire import RECORDS_PER_STRUCT

    assert (count > RECORDS_PER_STRUCT) == (count == 1100)
    fp = MODEL.fingerprint()
    keys = chain(count, salt=f"parse-{count}")
    stored = [bytes([i % 251]) * BLOCK for i in range(count)]
    with connect(served.tcp, token="tok-a") as kv:
        assert kv.put(fp, keys, stored) == count
        assert kv.lookup(fp, [*keys, *chain(1, salt="absent")]) == count
        assert kv.lookup(fp, [*keys[:-1], chain(1, salt="absent")[0], keys[-1]]) == count - 1
        got = kv.get(fp, [keys[0], keys[count // 2], keys[-1]])
        assert [bytes(g) for g in got] == [stored[0], stored[count // 2], stored[-1]]


def test_a_remote_put_in_small_steps_keeps_its_chain(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data plane reserves a put step by step (at most WRITE_STEP_BYTES each, so each step is
    paced for the disk on its own); across the steps every block keeps its parent and depth."""
    from kvstore.server import dataplane

    monkeypatch.setattr(dataplane, "WRITE_STEP_BYTES", 2 * BLOCK)
    store = served.server.store
    fp = MODEL.fingerprint()
    keys = chain(9, salt="steps")  # steps of 2 2 2 2 1 blocks
    stored = blocks_for(keys)
    with connect(served.tcp, token="tok-a") as kv:
        assert kv.put(fp, keys, stored) == 9
        assert [bytes(b) for b in kv.get(fp, keys)] == stored
    found = {b.key: b for b in store._index.blocks.values() if b.key in set(keys)}
    assert [(found[k].depth, found[k].parent) for k in keys] == [
        (0, None),
        *((i, keys[i - 1]) for i in range(1, 9)),
    ]
