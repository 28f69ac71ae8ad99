"""The service through real gRPC on 127.0.0.1 and a Unix socket: both data planes byte for
byte, tenancy, the status code of every bad request, health, reflection, metrics."""

from __future__ import annotations

import itertools
import os
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import Client, connect
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.frames import encode_frame
from kvstore.keys import BlockKey, Fingerprint, ModelIdentity, block_keys
from kvstore.store import TieredStore
from tests.service_fixtures import BLOCK, MODEL, Served, served

__all__ = ["served"]


def chain(n: int, salt: str = "s", start: int = 0) -> list[BlockKey]:
    return block_keys(MODEL.fingerprint(), list(range(start, start + n * 16)), 16, cache_salt=salt)


def blocks_for(keys: list[BlockKey]) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in keys]


def stored_chain(kv: Client, n: int, salt: str) -> tuple[Fingerprint, list[BlockKey], list[bytes]]:
    """A chain of ``n`` random blocks written through ``kv``: (fingerprint, keys, blocks)."""
    fp = kv.register(MODEL)
    keys = chain(n, salt=salt)
    blocks = blocks_for(keys)
    kv.write(fp, keys, blocks)
    return fp, keys, blocks


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


def _leases_drop_to_zero(store: TieredStore, within_s: float = 5.0) -> bool:
    """Whether the store holds no lease within ``within_s`` (a release sent without waiting
    lands when the server reads it)."""
    import time

    deadline = time.monotonic() + within_s
    while store.stats().leases and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.stats().leases == 0


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined same-host writes in chunks of two blocks."""
    from kvstore.client import inplace

    for name in ("FIRST_CHUNK_BYTES", "CHUNK_BYTES", "LAST_CHUNK_BYTES"):
        monkeypatch.setattr(inplace, name, 2 * BLOCK)


@pytest.mark.parametrize("copies", ["native copies", "python"])
def test_a_pipelined_write_stores_the_whole_chain_with_its_depths(
    served: Served, small_chunks: None, copies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With native copies, and with the Python ones a build without a C compiler runs."""
    from kvstore.client import inplace

    if copies == "python":
        monkeypatch.setattr(inplace, "_gather", None)
    store = served.server.store
    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(9, salt=copies)  # chunks 2 2 2 2 1
        blocks = blocks_for(keys)
        assert kv.write(fp, [*keys[:1]], blocks[:1]) == 1  # the chain's root stored before
        assert kv.write(fp, keys[1:], blocks[1:], parent=keys[0]) == 8
        assert kv.write(fp, keys[1:], blocks[1:], parent=keys[0]) == 0  # all there
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys, outs) == 9
        assert [bytes(o) for o in outs] == blocks
    index = store._index
    found = [b for b in index.blocks.values() if b.key in set(keys)]
    assert sorted((b.depth, b.parent) for b in found) == [(0, None), *((i, keys[i - 1]) for i in range(1, 9))]
    assert _leases_drop_to_zero(store)  # the read's release went out without its answer, and landed


def test_a_pipelined_write_that_fails_midway_gives_its_slots_back(
    served: Served, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.client import inplace

    copies = []
    real_copy = inplace._copy_spans

    def failing_copy(
        region: memoryview,
        offsets: list[int],
        sizes: list[int],
        blocks: Sequence[inplace.Data],
        into_region: bool,
    ) -> None:
        if len(copies) == 2:  # the third chunk
            raise ValueError("the caller's buffer went away")
        copies.append(1)
        real_copy(region, offsets, sizes, blocks, into_region)

    monkeypatch.setattr(inplace, "_copy_spans", failing_copy)
    arena = served.server.store.arena
    assert arena is not None
    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(8, salt="fails")
        with pytest.raises(ValueError, match="went away"):
            kv.write(fp, keys, blocks_for(keys))
        usage = arena.usage()
        assert usage.stored_bytes == usage.used_bytes  # no slot left reserved
        present = kv.lookup(fp, keys)
        assert present == 4  # the two chunks committed before the failing one
        monkeypatch.setattr(inplace, "_copy_spans", real_copy)
        blocks = blocks_for(keys)
        assert kv.write(fp, keys, blocks) == 8 - present  # the connection after the failure works
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys, outs) == 8
        assert [bytes(o) for o in outs][present:] == blocks[present:]


def test_a_pipelined_write_given_a_block_it_cannot_copy_fails_and_gives_its_slots_back(
    served: Served, small_chunks: None
) -> None:
    """A block the copy cannot take as it is (here not contiguous) fails the write: the chunks
    before stay committed, the reservations sent ahead are given back, the connection is usable."""
    arena = served.server.store.arena
    assert arena is not None
    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(8, salt="strided")  # chunks 2 2 2 2
        blocks: list[Any] = list(blocks_for(keys))
        blocks[4] = np.frombuffer(blocks[4] * 2, dtype=np.uint8)[::2]  # the third chunk: strided
        with pytest.raises(Exception, match="contiguous"):
            kv.write(fp, keys, blocks)
        usage = arena.usage()
        assert usage.stored_bytes == usage.used_bytes  # no slot left reserved
        assert kv.lookup(fp, keys) == 4  # the two chunks committed before the third
        plain = blocks_for(keys)
        assert kv.write(fp, keys, plain) == 4  # the connection after the failure works
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys, outs) == 8
        assert [bytes(o) for o in outs] == [*blocks[:4], *plain[4:]]  # (each call's bytes are fresh)


def test_read_into_reads_blocks_outside_the_arena_through_resolve(served: Served) -> None:
    store = served.server.store
    with connect(served.unix) as kv:
        fp, keys, blocks = stored_chain(kv, 4, "demoted")
        assert store.demote("dram", fingerprint=fp) == 4
        assert kv.lookup_tiers(fp, keys).tiers == ("nvme",) * 4
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys, outs) == 4
        assert [bytes(o) for o in outs] == blocks
        assert kv.lookup_tiers(fp, keys).tiers == ("dram",) * 4  # promoted by the resolve
    assert _leases_drop_to_zero(store)


def test_read_into_refuses_a_copy_that_outlasted_its_pin(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from kvstore.client import inplace, transport

    real_copy = inplace._copy_spans

    def slow_copy(
        region: memoryview,
        offsets: list[int],
        sizes: list[int],
        outs: Sequence[memoryview],
        into_region: bool,
    ) -> None:
        time.sleep(0.6)  # past READ_TTL_S - READ_MARGIN_S
        real_copy(region, offsets, sizes, outs, into_region)

    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(2, salt="slow")
        kv.write(fp, keys, blocks_for(keys))
        monkeypatch.setattr(transport, "READ_TTL_S", 1.0)
        monkeypatch.setattr(transport, "READ_MARGIN_S", 0.5)
        monkeypatch.setattr(inplace, "_copy_spans", slow_copy)
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        with pytest.raises(LeaseExpired, match="outlasted"):
            kv.read_into(fp, keys, outs)
    assert _leases_drop_to_zero(served.server.store)  # the pin given back, not left to run out


def test_write_chunks_start_small_grow_and_end_small() -> None:
    from kvstore.client.inplace import CHUNK_BYTES, FIRST_CHUNK_BYTES, LAST_CHUNK_BYTES, chunks

    def counts(sizes: list[int]) -> list[int]:
        parts = chunks(sizes)
        assert parts[0][0] == 0 and parts[-1][1] == len(sizes)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(parts))
        return [end - first for first, end in parts]

    kib256 = 256 << 10
    n = counts([kib256] * 512)
    assert n[0] * kib256 == FIRST_CHUNK_BYTES and n[1] == 2 * n[0]  # small, then doubling
    assert max(n) * kib256 == CHUNK_BYTES
    assert n[-1] * kib256 == LAST_CHUNK_BYTES and n[-2] >= n[-1]  # and small again at the end
    assert counts([2 << 20] * 64)[:3] == [1, 1, 2]  # at least a block, however large
    assert counts([64 << 20] * 3) == [1, 1, 1]
    assert counts([kib256]) == [1]
    assert chunks([]) == []


def test_read_chunks_start_small_and_grow() -> None:
    from kvstore.client.inplace import FIRST_READ_KEYS, READ_GROWTH, read_chunks

    assert read_chunks(0) == []
    assert read_chunks(3) == [(0, 3)]
    f, g = FIRST_READ_KEYS, READ_GROWTH
    assert read_chunks(f + f * g + 1) == [(0, f), (f, f + f * g), (f + f * g, f + f * g + 1)]
    parts = read_chunks(5000)
    assert parts[0][0] == 0 and parts[-1][1] == 5000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))  # contiguous, in order


@pytest.fixture
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined same-host reads in chunks of 1, 2, 4, 8, ... blocks."""
    from kvstore.client import inplace

    monkeypatch.setattr(inplace, "FIRST_READ_KEYS", 1)
    monkeypatch.setattr(inplace, "READ_GROWTH", 2)


def test_a_pipelined_read_copies_every_chunk_and_gives_every_pin_back(
    served: Served, small_reads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """read_into and get over 11 blocks (chunks 1 2 4 4): the lookup of the next chunk goes out
    before the copy of this one, each chunk's pin is released, the bytes are the blocks'. A
    release waits for the next send rather than waking the server alone: the third chunk's goes
    out with the last one's, four sends in all."""
    from kvstore.client import inplace
    from kvstore.client.dataport import DataPortClient
    from kvstore.wire import OP_LOOKUP_SLOTS, OP_RELEASE_NOWAIT

    store = served.server.store
    copies: list[int] = []
    asked_before_copy: list[int] = []
    asked: list[int] = []
    real_copy, real_request = inplace._copy_spans, inplace.lookup_slots_request

    def copy(
        region: memoryview,
        offsets: list[int],
        sizes: list[int],
        outs: Sequence[memoryview],
        into_region: bool,
    ) -> None:
        if not into_region:
            copies.append(len(offsets))
            asked_before_copy.append(len(asked))
        real_copy(region, offsets, sizes, outs, into_region)

    def request(fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float) -> bytes:
        asked.append(len(keys))
        return real_request(fingerprint, keys, pin_ttl_s)

    sends: list[list[int]] = []  # the first byte (the op) of each request of each send
    real_send = DataPortClient.send

    def send(self: DataPortClient, requests: Sequence[bytes]) -> None:
        sends.append([r[0] for r in requests])
        real_send(self, requests)

    monkeypatch.setattr(inplace, "_copy_spans", copy)
    monkeypatch.setattr(inplace, "lookup_slots_request", request)
    with connect(served.unix) as kv:
        fp, keys, blocks = stored_chain(kv, 11, "pipelined read")
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        monkeypatch.setattr(DataPortClient, "send", send)
        assert kv.read_into(fp, keys, outs) == 11
        monkeypatch.setattr(DataPortClient, "send", real_send)
        assert [bytes(o) for o in outs] == blocks
        assert copies == [1, 2, 4, 4] and asked == [1, 2, 4, 4]
        assert asked_before_copy == [2, 3, 4, 4]  # one chunk's lookup ahead of each copy
        look, release = OP_LOOKUP_SLOTS, OP_RELEASE_NOWAIT
        assert sends == [[look, look], [release, look], [release, look], [release, release]]
        assert _leases_drop_to_zero(store)
        copies.clear()
        assert kv.get(fp, keys) == blocks
        assert copies == [1, 2, 4, 4]
    assert _leases_drop_to_zero(store)


def test_a_pipelined_read_ends_at_the_first_miss_and_releases_what_it_asked_past_it(
    served: Served, small_reads: None
) -> None:
    """Block 4 missing: the chunk of blocks 3-6 ends the prefix there; the lookup of the chunk
    after it (blocks 7-14, present) went out already, and its pin is given back."""
    store = served.server.store
    with connect(served.unix) as kv:
        fp, keys, blocks = stored_chain(kv, 15, "gap")
        assert kv.delete(fp, [keys[4]]) == 1
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys, outs) == 4
        assert [bytes(o) for o in outs[:4]] == blocks[:4]
        assert kv.get(fp, keys) == blocks[:4]
        assert _leases_drop_to_zero(store)
        assert kv.lookup(fp, keys[5:]) == 10  # still there


def test_a_pipelined_read_whose_first_chunk_finds_nothing_copies_nothing_past_it(
    served: Served, small_reads: None
) -> None:
    """Block 0 missing, blocks 1-7 present: the lookup of blocks 1-2, sent before the first
    answer came, finds them, but they are past the end of the prefix: nothing is copied or
    counted, and their pin is given back."""
    store = served.server.store
    with connect(served.unix) as kv:
        fp, keys, _ = stored_chain(kv, 8, "no root")
        assert kv.delete(fp, [keys[0]]) == 1
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys, outs) == 0
        assert all(not any(o) for o in outs)
        assert kv.get(fp, keys) == []
    assert _leases_drop_to_zero(store)


def test_a_pipelined_read_that_meets_a_block_below_the_arena_resolves_the_chain(
    served: Served, small_reads: None
) -> None:
    """Blocks 3-7 in nvme: the chunks before them were copied out of the arena, then the read
    goes the way that promotes the rest; every byte right, every pin given back."""
    store = served.server.store
    with connect(served.unix) as kv:
        fp, keys, blocks = stored_chain(kv, 8, "partly demoted")
        assert store.demote("dram", fingerprint=fp) >= 8
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert kv.read_into(fp, keys[:3], outs[:3]) == 3  # promoted by the resolve
        assert kv.lookup_tiers(fp, keys).tiers == ("dram",) * 3 + ("nvme",) * 5
        assert kv.read_into(fp, keys, outs) == 8
        assert [bytes(o) for o in outs] == blocks
        assert kv.lookup_tiers(fp, keys).tiers == ("dram",) * 8
        assert store.demote("dram", fingerprint=fp) >= 8
        kv.read_into(fp, keys[:3], outs[:3])
        assert kv.get(fp, keys) == blocks
    assert _leases_drop_to_zero(store)


def read_copy_failing_at(chunk: int, copies: list[int]) -> Callable[..., None]:
    """``inplace._copy_spans`` that fails the copy out of the arena of read chunk ``chunk``
    (from 0), as a caller's buffer gone away would, and records each earlier one's block count
    in ``copies``."""
    from kvstore.client import inplace

    real_copy = inplace._copy_spans

    def failing_copy(
        region: memoryview,
        offsets: list[int],
        sizes: list[int],
        outs: Sequence[memoryview],
        into_region: bool,
    ) -> None:
        if not into_region and len(copies) == chunk:
            raise ValueError("the caller's buffer went away")
        copies.append(len(offsets))
        real_copy(region, offsets, sizes, outs, into_region)

    return failing_copy


def test_a_pipelined_read_whose_copy_fails_gives_back_the_pins_it_asked_ahead(
    served: Served, small_reads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.client import inplace

    real_copy = inplace._copy_spans
    failing_copy = read_copy_failing_at(1, [])  # the second chunk, the third's lookup out already
    store = served.server.store
    with connect(served.unix) as kv:
        fp, keys, blocks = stored_chain(kv, 8, "read fails")
        monkeypatch.setattr(inplace, "_copy_spans", failing_copy)
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        with pytest.raises(ValueError, match="went away"):
            kv.read_into(fp, keys, outs)
        assert _leases_drop_to_zero(store, within_s=2.0)  # not left to run out their 30 s
        monkeypatch.setattr(inplace, "_copy_spans", real_copy)
        assert kv.read_into(fp, keys, outs) == 8  # the next read works
        assert [bytes(o) for o in outs] == blocks


def test_a_read_whose_last_copy_fails_gives_back_the_release_it_held_for_the_next_send(
    served: Served, small_reads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 blocks in chunks 1 2 4 1: the third chunk's release has no lookup left to go with and
    waits for the next send; the last chunk's copy fails before that send. Both pins go back
    at once, not after their 30 s."""
    from kvstore.client import inplace

    copies: list[int] = []
    failing_copy = read_copy_failing_at(3, copies)  # the last chunk
    store = served.server.store
    with connect(served.unix) as kv:
        fp, keys, _ = stored_chain(kv, 8, "last copy fails")
        monkeypatch.setattr(inplace, "_copy_spans", failing_copy)
        with pytest.raises(ValueError, match="went away"):
            kv.read_into(fp, keys, [memoryview(bytearray(BLOCK)) for _ in keys])
        assert copies == [1, 2, 4]
        assert _leases_drop_to_zero(store, within_s=2.0)


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
    assert _leases_drop_to_zero(store)


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


def test_tcp_needs_a_valid_token(served: Served) -> None:
    keys = chain(1)
    with connect(served.tcp) as anonymous, pytest.raises(Unauthenticated):
        anonymous.lookup(MODEL.fingerprint(), keys)
    with connect(served.tcp, token="wrong") as bad, pytest.raises(Unauthenticated):
        bad.lookup(MODEL.fingerprint(), keys)


def test_tenants_cannot_reach_each_others_blocks(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(4)
    blocks = blocks_for(keys)
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-b") as b:
        a.put(fp, keys, blocks)
        assert b.lookup(fp, keys) == 0
        assert b.exists(fp, keys) == [False] * 4
        assert b.get(fp, keys) == []
        assert b.delete(fp, keys) == 0
        assert b.invalidate(fp) == 0
        with pytest.raises(PermissionDenied):
            b.invalidate(fp, tenant="tenant-a")
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        with pytest.raises(NotFound):
            b.release(lease)  # not b's lease: indistinguishable from none
        a.release(lease)
        b_blocks = blocks_for(keys)
        b.put(fp, keys, b_blocks)  # same keys, b's own copy
        assert a.get(fp, keys) == blocks
        assert b.get(fp, keys) == b_blocks


def test_shared_scope_is_shared_only_with_grantees(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(3, salt="public-prompt")
    blocks = blocks_for(keys)
    with (
        connect(served.tcp, token="tok-a") as a,
        connect(served.tcp, token="tok-b") as b,
        connect(served.tcp, token="tok-c") as c,
    ):
        a.put(fp, keys, blocks, scope="public")
        assert b.get(fp, keys, scope="public") == blocks
        assert b.lookup(fp, keys) == 0  # not in b's own namespace
        with pytest.raises(PermissionDenied):
            c.lookup(fp, keys, scope="public")


def test_invalidate_own_and_admin_everything(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(2)
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-ops") as ops:
        a.put(fp, keys, blocks_for(keys))
        assert a.invalidate(fp) == 2
        a.put(fp, keys, blocks_for(keys))
        assert ops.invalidate(everything=True, tenant="*") >= 2
        assert a.lookup(fp, keys) == 0


def test_demote_moves_own_blocks_to_nvme_and_admins_any(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys, other = chain(3, "d"), chain(2, "e")
    with (
        connect(served.tcp, token="tok-a") as a,
        connect(served.tcp, token="tok-b") as b,
        connect(served.tcp, token="tok-ops") as ops,
    ):
        blocks = blocks_for(keys)
        a.put(fp, keys, blocks)
        b.put(fp, other, blocks_for(other))
        assert a.demote("dram", fp) == 3
        assert a.lookup_tiers(fp, keys).tiers == ("nvme",) * 3
        assert b.lookup_tiers(fp, other).tiers == ("dram",) * 2  # not a's to move
        assert a.get(fp, keys) == blocks  # served from nvme (and promoted again)
        with pytest.raises(PermissionDenied):
            a.demote("dram", tenant="tenant-b")
        assert ops.demote("dram", tenant="*") >= 2
        assert b.lookup_tiers(fp, other).tiers == ("nvme",) * 2
        with pytest.raises(InvalidArgument):
            a.demote("nvme")
        with pytest.raises(InvalidArgument):
            a.demote("dram", b"short")


def test_bad_requests_get_actionable_codes(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(2)
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-c") as c:
        a.register(MODEL)
        with pytest.raises(InvalidArgument, match="32 bytes"):
            a.lookup(fp, [b"short"])
        with pytest.raises(InvalidArgument, match="32 bytes"):
            a.lookup(b"\x00" * 31, keys)
        with pytest.raises(InvalidArgument, match="layout"):
            a.put(fp, keys[:1], [b"x" * (BLOCK - 1)])
        with pytest.raises(NotFound):
            a.release(987654)
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        assert lease == 0  # nothing hit, nothing pinned
        a.put(fp, keys, blocks_for(keys))
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        a.release(lease)
        with pytest.raises(NotFound):
            a.release(lease)  # double release
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=0.05).lease_id
        import time

        time.sleep(0.1)
        a.lookup(fp, keys)  # any call collects expired leases
        with pytest.raises(LeaseExpired):
            a.release(lease)
        with pytest.raises(ResourceExhausted, match="quota"):
            c.put(fp, chain(5, "c"), blocks_for(chain(5, "c")))
        with pytest.raises(NotFound):
            a.commit(424242)
        with pytest.raises(FailedPrecondition):
            a.attach()  # the arena is for the Unix socket


def test_oversized_and_malformed_frames(served: Served) -> None:
    channel = grpc.insecure_channel(served.tcp)
    put = channel.stream_unary("/kvstore.v1.KvStore/Put")
    meta = (("authorization", "Bearer tok-a"),)
    with pytest.raises(grpc.RpcError) as info:
        put(iter([encode_frame(b"k" * 32, b"x" * (5 << 20), MODEL.fingerprint())]), metadata=meta)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        put(iter([b"\x0a\xff\xff"]), metadata=meta)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        put(iter([encode_frame(b"k" * 32, b"x")]), metadata=meta)  # no fingerprint on frame 1
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_draining_server_refuses_new_requests(served: Served) -> None:
    served.server.service.draining.set()
    with connect(served.unix) as kv, pytest.raises(Unavailable, match="draining"):
        kv.lookup(MODEL.fingerprint(), chain(1))
    served.server.service.draining.clear()


def test_health_and_reflection(served: Served) -> None:
    channel = grpc.insecure_channel(served.tcp)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KvStore"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "kvstore.v1.KvStore" in names
    channel.close()


def test_metrics_count_tokens_by_tenant_and_tier(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(4)
    with connect(served.tcp, token="tok-a") as a:
        a.register(MODEL)
        a.put(fp, keys, blocks_for(keys))
        a.lookup(fp, [*keys, *chain(2, "miss")])
    text = urllib.request.urlopen(f"http://127.0.0.1:{served.server.metrics_port}/metrics").read().decode()
    assert 'kvstore_lookup_tokens_total{result="hit",tenant="tenant-a"} 64.0' in text
    assert 'kvstore_lookup_tokens_total{result="miss",tenant="tenant-a"} 32.0' in text
    assert 'kvstore_hit_tokens_total{tenant="tenant-a",tier="dram"} 64.0' in text
    assert 'kvstore_tier_used_bytes{tier="dram"}' in text
    assert "kvstore_request_seconds_bucket" in text
    assert "kvstore_checksum_failures_total 0.0" in text


def test_data_port_refuses_strangers_and_bad_tokens(served: Served) -> None:
    import socket

    from kvstore.client.dataport import DataPortClient
    from kvstore.status import Status
    from kvstore.wire import read_status

    port = served.server.service.data_port
    assert port > 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"HTTP")
        assert read_status(s)[0] == Status.INVALID_ARGUMENT
    with pytest.raises(Unauthenticated):
        DataPortClient("127.0.0.1", port, "wrong", "")
    with pytest.raises(Unauthenticated):
        DataPortClient("127.0.0.1", port, None, "")
    with pytest.raises(PermissionDenied):
        DataPortClient("127.0.0.1", port, "tok-c", "public")
    client = DataPortClient("127.0.0.1", port, "tok-a", "")
    with pytest.raises(FailedPrecondition, match="Unix socket"):
        client.resolve(MODEL.fingerprint(), chain(1), 5.0)  # arena slots mean nothing remotely
    client = DataPortClient("127.0.0.1", port, "tok-a", "")
    with pytest.raises(InvalidArgument, match="layout"):
        connect(served.tcp, token="tok-a").register(MODEL)
        client.put(MODEL.fingerprint(), chain(1), [b"x" * 10])
    client.close()


def test_a_tenant_sees_only_its_own_figures(served: Served) -> None:
    fp = MODEL.fingerprint()
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-b") as b:
        a.put(fp, chain(6, salt="a"), blocks_for(chain(6, salt="a")))
        b.put(fp, chain(2, salt="b"), blocks_for(chain(2, salt="b")))
        a_stats, b_stats = a.stats(), b.stats()
    with connect(served.unix) as admin:  # the Unix tenant is an admin here
        everything = admin.stats()
    assert b_stats["blocks"] == 2 and a_stats["blocks"] == 6
    dram = next(t for t in b_stats["tiers"] if t["name"] == "dram")
    assert dram["blocks"] == 2 and dram["used_bytes"] == 2 * BLOCK  # (nvme may hold copies too)
    assert all(t["blocks"] <= 2 for t in b_stats["tiers"])
    assert [(f["fingerprint"], f["blocks"]) for f in b_stats["fingerprints"]] == [(fp.hex(), 2)]
    assert list(b_stats["tenant_bytes"]) == ["t/tenant-b"]
    assert everything["blocks"] >= 8 and sum(f["blocks"] for f in everything["fingerprints"]) >= 8


def test_lease_lifetimes_are_capped_and_checked(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(2, salt="ttl")
    with connect(served.tcp, token="tok-a") as a:
        a.put(fp, keys, blocks_for(keys))
        with pytest.raises(InvalidArgument, match="lease lifetime"):
            a.lookup_tiers(fp, keys, pin_ttl_s=float("inf"))
        assert a.lookup_tiers(fp, keys, pin_ttl_s=-1.0).lease_id == 0  # <= 0: look, do not pin
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=1e9).lease_id  # accepted, capped by the server
    expires = served.server.store.leases._held[lease][0]
    assert expires - served.server.store.leases._clock() <= served.server.store.config.max_lease_ttl_s


def test_a_huge_announced_block_is_refused_before_anything_is_evicted(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(8, salt="victim")
    with connect(served.tcp, token="tok-b") as b, connect(served.tcp, token="tok-a") as a:
        stored = blocks_for(keys)
        b.put(fp, keys, stored)
        before = served.server.store.stats().counters.get("evictions", 0)
        for size in (1 << 62, (64 << 20) + 1):
            with pytest.raises(InvalidArgument, match="max_block_bytes"):
                _announce(served, size)
        assert b.get(fp, keys) == stored
        assert served.server.store.stats().counters.get("evictions", 0) == before
        assert a.lookup(fp, chain(1, salt="huge")) == 0


def _announce(served: Served, size: int) -> None:
    """A data-port put header announcing ``size`` bytes, and no payload."""
    import socket
    import struct

    from kvstore.status import Status
    from kvstore.wire import MAGIC, read_status, status_error

    host = served.tcp.rpartition(":")[0]
    data_port = served.server.data_port
    assert data_port is not None
    with socket.create_connection((host, data_port.port), timeout=10) as sock:
        token = b"tok-a"
        sock.sendall(MAGIC + struct.pack("<H", len(token)) + token + struct.pack("<H", 0))
        assert read_status(sock)[0] == Status.OK
        key = chain(1, salt="huge")[0]
        sock.sendall(put_header(key, size))
        raise status_error(*read_status(sock))


def put_header(key: bytes, size: int) -> bytes:
    """A one-block data-port put, up to where its payload begins."""
    import struct

    from kvstore.wire import OP_PUT

    head = struct.pack("<B", OP_PUT) + MODEL.fingerprint() + struct.pack("<B32s", 0, b"\0" * 32)
    return head + struct.pack("<I", 1) + key + struct.pack("<Q", size)


def test_a_same_host_write_that_finds_no_room_says_so(served: Served) -> None:
    from kvstore.errors import StoreFull

    fp = MODEL.fingerprint()
    pinned = chain(64, salt="pinned")  # the whole arena (64 blocks), pinned by a lease
    with connect(served.unix) as kv:
        kv.write(fp, pinned, blocks_for(pinned))
        lease = kv.lookup_tiers(fp, pinned, pin_ttl_s=30).lease_id
        assert served.server.store.stats().tiers[0].blocks == 64
        more = chain(8, salt="no-room")
        with pytest.raises(StoreFull) as full:
            kv.write(fp, more, blocks_for(more))
        assert "found no room" in str(full.value)
        assert full.value.stored == 8 - sum(not p for p in kv.exists(fp, more))
        again = chain(2, salt="pinned")  # present already: not a failure
        assert kv.write(fp, again, blocks_for(again)) == 0
        kv.release(lease)


def test_removals_and_admin_actions_are_audited_without_secrets(served: Served) -> None:
    from pathlib import Path

    from kvstore.server.audit import read_audit

    fp = MODEL.fingerprint()
    keys = chain(3, salt="audited")
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-ops") as ops:
        a.put(fp, keys, blocks_for(keys))
        assert a.delete(fp, keys[2:]) == 1
        assert ops.invalidate(fp, tenant="tenant-a") == 2  # an admin acting on another tenant
    text = (Path(served.data_dir) / "audit.log").read_text()
    read = read_audit(Path(served.data_dir) / "audit.log")
    assert read.skipped == 0 and all(r["phase"] == "done" for r in read.actions)
    records = read.actions
    delete = next(r for r in records if r["action"] == "delete" and r["tenant"] == "tenant-a")
    assert delete["key_hashes"] == [keys[2].hex()] and delete["outcome"] == 1
    assert delete["fingerprint"] == fp.hex() and delete["namespace"] == "t/tenant-a"
    admin = next(r for r in records if r["action"] == "invalidate" and r["tenant"] == "ops")
    assert admin["namespace"] == "t/tenant-a" and admin["outcome"] == 2
    assert "tok-" not in text  # never a token (nor prompt text or block bytes: only hashes)
    assert (Path(served.data_dir) / "audit.log").stat().st_mode & 0o777 == 0o600


def test_one_tenant_cannot_fill_the_model_registry(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses
    import hashlib

    import kvstore.server.models as models
    from kvstore.errors import ResourceExhausted

    def model(name: str) -> ModelIdentity:  # other weights: the name alone is no new model
        return dataclasses.replace(
            MODEL, model_id=name, weights_digest=hashlib.sha256(name.encode()).hexdigest()
        )

    monkeypatch.setattr(models, "MAX_MODELS_PER_TENANT", 3)
    with connect(served.tcp, token="tok-b") as b, connect(served.tcp, token="tok-a") as a:
        for i in range(3):
            b.register(model(f"flood/{i}"))
        with pytest.raises(ResourceExhausted, match="registered 3 new model"):
            b.register(model("flood/3"))
        b.register(model("flood/0"))  # known already: fine
        a.register(model("a/own"))  # others still can


@pytest.mark.parametrize("data_plane", ["auto", "grpc"])
def test_request_metrics_are_the_same_whichever_transport(served: Served, data_plane: str) -> None:
    import re

    def count(method: str) -> float:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{served.server.metrics_port}/metrics").read().decode()
        )
        found = re.search(rf'kvstore_request_seconds_count{{method="{method}"}} ([0-9.e+]+)', text)
        return float(found.group(1)) if found else 0.0

    fp = MODEL.fingerprint()
    keys = chain(2, salt=f"metrics-{data_plane}")
    before = {m: count(m) for m in ("Lookup", "Put", "Get")}
    with connect(served.tcp, token="tok-a", data_plane=data_plane) as a:
        a.put(fp, keys, blocks_for(keys))
        a.lookup(fp, keys)
        a.get(fp, keys)
    assert (
        count("Put") > before["Put"] and count("Lookup") > before["Lookup"] and count("Get") > before["Get"]
    )


def test_a_release_without_answer_lets_go_and_the_connection_carries_on(served: Served) -> None:
    """``release(wait=False)`` on the data port: no round trip; another tenant's lease, an
    unknown one or one released twice is ignored, not an error that would cut the connection."""
    fp = MODEL.fingerprint()
    keys = chain(3, salt="nowait")
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-b") as b:
        a.put(fp, keys, blocks_for(keys))
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        assert lease and a.stats()["leases"] >= 1
        b.release(lease, wait=False)  # not b's: ignored, b's connection carries on
        b.release(987654, wait=False)
        assert b.lookup(fp, keys) == 0
        assert a.stats()["leases"] >= 1  # still pinned: b could not release it
        a.release(lease, wait=False)
        a.release(lease, wait=False)  # twice: ignored
        assert a.lookup(fp, keys) == 3  # the same connection, answered in order
        with pytest.raises(NotFound):
            a.release(lease)  # a waited release still says so


def test_a_pinning_lookup_hands_out_arena_slots_whose_lease_can_be_checked(served: Served) -> None:
    """``lookup_tiers(..., slots=True)`` on the Unix socket: where each pinned hit lies in the
    arena (the same bytes a resolve reads), and ``lease_held`` says whether its pin still
    holds: true until released, false after, and false for any other tenant's lease."""
    fp = MODEL.fingerprint()
    keys = chain(3, salt="in-place")
    with connect(served.unix) as kv, connect(served.tcp, token="tok-a") as a:
        stored = blocks_for(keys)
        kv.put(fp, keys, stored)
        found = kv.lookup_tiers(fp, [*keys, *chain(1, salt="absent")], pin_ttl_s=30, slots=True)
        assert found.hit_blocks == 3 and found.tiers == ("dram",) * 3
        assert found.arena and len(found.slots) == 3 and None not in found.slots
        views = kv.arena_views(found.arena, [s for s in found.slots if s is not None])
        assert [bytes(v) for v in views] == stored
        del views
        assert kv.lease_held(found.lease_id)
        assert not a.lease_held(found.lease_id)  # another tenant's: as if there were none
        kv.release(found.lease_id)
        assert not kv.lease_held(found.lease_id)
        assert not kv.lease_held(found.lease_id + 1)  # never granted
        plain = kv.lookup_tiers(fp, keys, pin_ttl_s=30)
        assert plain.slots == () and plain.arena == ""  # only when asked for
        kv.release(plain.lease_id)
        unpinned = kv.lookup_tiers(fp, keys, slots=True)  # slots mean something only pinned
        assert unpinned.lease_id == 0 and unpinned.slots == ()
        a.put(fp, keys, stored)
        remote = a.lookup_tiers(fp, keys, pin_ttl_s=30, slots=True)  # TCP: no arena to map
        assert remote.hit_blocks == 3 and remote.slots == ()
        a.release(remote.lease_id)


def test_arena_slots_are_refused_over_tcp_at_the_wire(served: Served) -> None:
    from kvstore.client.dataport import DataPortClient

    client = DataPortClient("127.0.0.1", served.server.service.data_port, "tok-a", "")
    with pytest.raises(FailedPrecondition, match="Unix socket"):
        client.lookup_slots(MODEL.fingerprint(), chain(1), 5.0)


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


def test_a_pipelined_write_keeps_its_connection_awake_between_chunks_only(
    served: Served, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data port polls for the next request while a write on that connection has a
    reservation open (a chunk being copied), and sleeps as before once the last commit is in, or
    after an abort, and after any other request."""
    from kvstore.stream import Stream

    port = served.server.data_socket
    assert port is not None
    monkeypatch.setattr(port, "spin_s", 0.25)  # as configured on a machine with two CPUs or more
    spins: list[float] = []
    real_spin = Stream.spin

    def spin(self: Stream, seconds: float, yielding: bool = False) -> bool:
        spins.append(seconds)
        return real_spin(self, seconds, yielding)

    monkeypatch.setattr(Stream, "spin", spin)
    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(7, salt="awake")  # chunks 2 2 2 1: requests R0 R1 C0 R2 C1 R3 C2 C3
        assert kv.write(fp, keys, blocks_for(keys)) == 7
        assert spins == [0.25] * 7  # after each request but the last commit
        spins.clear()
        assert kv.lookup(fp, keys) == 7
        reservation = kv.reserve(fp, chain(2, salt="given back"), [BLOCK] * 2)
        kv.abort(reservation.reservation_id)
        assert kv.lookup(fp, keys) == 7
        assert spins == [0.25]  # after the reserve alone: its commit (here an abort) comes next


@pytest.mark.parametrize("yielding", [False, True], ids=["busy", "yielding"])
def test_a_spin_ends_when_the_next_message_comes_or_its_time_is_up(yielding: bool) -> None:
    import socket
    import threading
    import time

    from kvstore.stream import Stream

    a, b = socket.socketpair()
    with a, b:
        stream = Stream(a, 5.0)
        started = time.monotonic()
        assert not stream.spin(0.05, yielding)  # nothing comes
        # (a yielding spin stops sooner when another thread wanted its CPU meanwhile)
        assert yielding or time.monotonic() - started >= 0.05
        sender = threading.Timer(0.1, lambda: b.sendall(b"next"))
        sender.start()
        started = time.monotonic()
        while not stream.spin(30.0, yielding):  # a yielding one may stop early: spin again
            assert yielding
        assert time.monotonic() - started < 20.0  # returned when the message came, not after 30 s
        assert stream.wait(1.0) and stream.read(2) == b"ne"
        assert stream.spin(0.0, yielding)  # the rest is buffered already
        assert stream.read(2) == b"xt"
        sender.join()


def test_a_yielding_spin_gives_its_cpu_to_a_busy_thread_there() -> None:
    """A spin that yields stops polling once a yield gave its CPU to another runnable thread (on
    a machine with fewer CPUs than busy threads, the peer it waits for may be the one waiting
    for that CPU); a busy spin polls on to its end."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from kvstore.stream import Stream

    cpu = min(os.sched_getaffinity(0))
    mask = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    a, b = socket.socketpair()
    try:
        os.sched_setaffinity(busy.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.1)
        with a, b:
            stream = Stream(a, 5.0)
            started = time.monotonic()
            assert not stream.spin(2.0, yielding=True)
            assert time.monotonic() - started < 1.0
            started = time.monotonic()
            assert not stream.spin(0.3)
            assert time.monotonic() - started >= 0.3
    finally:
        os.sched_setaffinity(0, mask)
        busy.kill()
        busy.wait()
