"""Pipelined same-host writes and reads through a real server: chunk sizes, the lookup sent
ahead of each copy, every slot and pin given back when a copy fails or a chain ends early, and
the data port staying awake between a write's chunks."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.errors import LeaseExpired
from tests.service_fixtures import (
    BLOCK,
    MODEL,
    Served,
    blocks_for,
    chain,
    leases_drop_to_zero,
    served,
    stored_chain,
)

__all__ = ["served"]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined same-host writes in chunks of two blocks."""
    from kvstore.client import inplace

    for name in ("FIRST_CHUNK_BYTES", "CHUNK_BYTES", "LAST_CHUNK_BYTES"):
        monkeypatch.setattr(inplace, name, 2 * BLOCK)


def copy_spans_after(first: Callable[[list[int], bool], None]) -> Callable[..., None]:
    """``inplace._copy_spans`` that calls ``first(offsets, into_region)`` before each copy: to
    count it, to wait, or to fail it (as a caller's buffer gone away would)."""
    from kvstore.client import inplace

    real_copy = inplace._copy_spans

    def copy(
        region: memoryview,
        offsets: list[int],
        sizes: list[int],
        data: Sequence[inplace.Data],
        into_region: bool,
    ) -> None:
        first(offsets, into_region)
        real_copy(region, offsets, sizes, data, into_region)

    return copy


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
    assert leases_drop_to_zero(store)  # the read's release went out without its answer, and landed


def test_a_pipelined_write_that_fails_midway_gives_its_slots_back(
    served: Served, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.client import inplace

    copies = []
    real_copy = inplace.scatter_hashed

    def third_fails(
        region: memoryview, offsets: list[int], sizes: list[int], data: Sequence[inplace.Data]
    ) -> list[int]:
        if len(copies) == 2:  # the third chunk
            raise ValueError("the caller's buffer went away")
        copies.append(1)
        return real_copy(region, offsets, sizes, data)

    monkeypatch.setattr(inplace, "scatter_hashed", third_fails)
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
        monkeypatch.setattr(inplace, "scatter_hashed", real_copy)
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
    assert leases_drop_to_zero(store)


def test_read_into_refuses_a_copy_that_outlasted_its_pin(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from kvstore.client import inplace, transport

    def slow(offsets: list[int], into_region: bool) -> None:
        time.sleep(0.6)  # past READ_TTL_S - READ_MARGIN_S

    with connect(served.unix) as kv:
        fp = kv.register(MODEL)
        keys = chain(2, salt="slow")
        kv.write(fp, keys, blocks_for(keys))
        monkeypatch.setattr(transport, "READ_TTL_S", 1.0)
        monkeypatch.setattr(transport, "READ_MARGIN_S", 0.5)
        monkeypatch.setattr(inplace, "_copy_spans", copy_spans_after(slow))
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        with pytest.raises(LeaseExpired, match="outlasted"):
            kv.read_into(fp, keys, outs)
    assert leases_drop_to_zero(served.server.store)  # the pin given back, not left to run out


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
    real_request = inplace.lookup_slots_request

    def count(offsets: list[int], into_region: bool) -> None:
        if not into_region:
            copies.append(len(offsets))
            asked_before_copy.append(len(asked))

    def request(fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float) -> bytes:
        asked.append(len(keys))
        return real_request(fingerprint, keys, pin_ttl_s)

    sends: list[list[int]] = []  # the first byte (the op) of each request of each send
    real_send = DataPortClient.send

    def send(self: DataPortClient, requests: Sequence[bytes]) -> None:
        sends.append([r[0] for r in requests])
        real_send(self, requests)

    monkeypatch.setattr(inplace, "_copy_spans", copy_spans_after(count))
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
        assert leases_drop_to_zero(store)
        copies.clear()
        assert kv.get(fp, keys) == blocks
        assert copies == [1, 2, 4, 4]
    assert leases_drop_to_zero(store)


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
        assert leases_drop_to_zero(store)
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
    assert leases_drop_to_zero(store)


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
    assert leases_drop_to_zero(store)


def read_copy_failing_at(chunk: int, copies: list[int]) -> Callable[..., None]:
    """``inplace._copy_spans`` that fails the copy out of the arena of read chunk ``chunk``
    (from 0), as a caller's buffer gone away would, and records each earlier one's block count
    in ``copies``."""

    def fail_at_chunk(offsets: list[int], into_region: bool) -> None:
        if not into_region and len(copies) == chunk:
            raise ValueError("the caller's buffer went away")
        copies.append(len(offsets))

    return copy_spans_after(fail_at_chunk)


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
        assert leases_drop_to_zero(store, within_s=2.0)  # not left to run out their 30 s
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
        assert leases_drop_to_zero(store, within_s=2.0)


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
