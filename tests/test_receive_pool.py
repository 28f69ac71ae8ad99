"""The receive pool ``Client.get`` receives into, and the buffered ``wire.Stream`` both ends read
through: a buffer is reused only once nothing refers to it; a stream's over-read is never lost."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvstore.client.pool import ReceivePool
from kvstore.stream import Stream

KiB = 1 << 10


def test_a_dropped_view_gives_its_buffer_back() -> None:
    pool = ReceivePool(capacity_bytes=64 * KiB)
    pool.begin()
    first = pool.take(8 * KiB)
    buffer_id = id(first.obj)  # not the buffer itself: holding it would keep it busy
    del first
    pool.begin()
    again = pool.take(8 * KiB)
    assert id(again.obj) == buffer_id  # the same memory: warm, no page faults
    assert pool.held_bytes == 8 * KiB
    pool.begin()
    assert id(pool.take(8 * KiB).obj) != buffer_id  # ``again`` still holds it


def test_a_kept_view_is_never_overwritten() -> None:
    pool = ReceivePool(capacity_bytes=64 * KiB)
    pool.begin()
    kept = pool.take(8 * KiB)
    kept[:] = b"k" * len(kept)
    derived = np.frombuffer(pool.take(8 * KiB), dtype=np.uint8)  # kept through numpy only
    derived[:] = 7
    pool.begin()  # a later get: both buffers still referred to
    for _ in range(2):
        fresh = pool.take(8 * KiB)
        assert fresh.obj is not kept.obj and fresh.obj is not derived.base.obj
        fresh[:] = b"x" * len(fresh)
    assert bytes(kept) == b"k" * len(kept)
    assert set(derived.tolist()) == {7}


def test_a_released_view_counts_as_dropped() -> None:
    pool = ReceivePool(capacity_bytes=64 * KiB)
    pool.begin()
    view = pool.take(4 * KiB)
    buffer_id = id(view.obj)
    view.release()
    del view
    pool.begin()
    assert id(pool.take(4 * KiB).obj) == buffer_id


def test_take_many_reuses_free_buffers_and_adds_new_ones_for_the_rest() -> None:
    pool = ReceivePool(capacity_bytes=64 * KiB)
    pool.begin()
    first = pool.take_many([4 * KiB] * 3)
    ids = {id(v.obj) for v in first}
    kept = first[0]
    del first
    pool.begin()  # two free, one still held through ``kept``
    again = pool.take_many([4 * KiB] * 4)
    assert len(again) == 4 and all(len(v) == 4 * KiB and not v.readonly for v in again)
    assert len({id(v.obj) for v in again} & ids) == 2 and id(kept.obj) not in {id(v.obj) for v in again}
    assert len({id(v.obj) for v in again}) == 4  # no buffer handed out twice
    mixed = pool.take_many([KiB, 2 * KiB])
    assert [len(v) for v in mixed] == [KiB, 2 * KiB]


def test_the_pool_keeps_at_most_its_capacity() -> None:
    pool = ReceivePool(capacity_bytes=16 * KiB)
    pool.begin()
    views = [pool.take(8 * KiB) for _ in range(4)]  # the last two are plain buffers, not kept
    assert pool.held_bytes == 16 * KiB
    del views
    pool.begin()
    reused = [pool.take(8 * KiB) for _ in range(3)]
    assert pool.held_bytes == 16 * KiB
    assert len({id(v.obj) for v in reused}) == 3
    unpooled = ReceivePool(capacity_bytes=0)
    unpooled.begin()
    assert len(unpooled.take(KiB)) == KiB and unpooled.held_bytes == 0
    with pytest.raises(ValueError):
        ReceivePool(capacity_bytes=-1)


def test_sizes_are_matched_exactly() -> None:
    pool = ReceivePool(capacity_bytes=64 * KiB)
    pool.begin()
    small = pool.take(4 * KiB)
    small_id = id(small.obj)
    del small
    pool.begin()
    assert len(pool.take(8 * KiB)) == 8 * KiB  # no 4 KiB buffer grown or sliced for it
    assert id(pool.take(4 * KiB).obj) == small_id


# ----------------------------------------------------------------------------- wire.Stream


def test_views_made_ahead_are_of_free_buffers_and_hold_none_past_the_next_begin() -> None:
    """``begin(expect=n)`` makes views of free buffers of the last size taken: take and
    take_many hand those out first, never one the caller still holds, never one twice; those
    not handed out keep no buffer busy after the next ``begin``."""
    pool = ReceivePool(capacity_bytes=64 * KiB)
    pool.begin()
    first = pool.take_many([4 * KiB] * 4)
    ids = [id(v.obj) for v in first]
    kept = first[0]
    del first
    pool.begin(expect=8)  # three free: three views made
    assert len(pool._ready) == 3 and id(kept.obj) not in {id(v.obj) for v in pool._ready}
    again = [*pool.take_many([4 * KiB] * 2), pool.take(4 * KiB), *pool.take_many([4 * KiB] * 2)]
    assert len({id(v.obj) for v in again}) == 5 and id(kept.obj) not in {id(v.obj) for v in again}
    assert len({id(v.obj) for v in again} & set(ids[1:])) == 3  # the three free ones, then new
    del again
    pool.begin(expect=2)
    assert len(pool._ready) == 2
    other = pool.take(KiB)  # another size: not from the views made ahead
    assert len(other) == KiB and all(v.obj is not other.obj for v in pool._ready)
    pool.begin()  # the two views made ahead and not taken are dropped: their buffers free again
    held = pool.take_many([4 * KiB] * 4)  # five free of the six: nothing new made
    assert len({id(v.obj) for v in held}) == 4 and pool.held_bytes == 6 * 4 * KiB + KiB
    pool.begin(expect=4)
    assert len(pool._ready) == 1  # of the six 4 KiB buffers, ``kept`` and ``held`` hold five


def test_stream_reads_fields_from_one_recv_and_keeps_the_rest() -> None:
    a, b = socket.socketpair()
    with a, b:
        stream = Stream(b, default_timeout_s=5.0, buffer_bytes=64)
        stream.begin(None)
        a.sendall(b"\x01" + b"F" * 32 + b"tail-of-message" + b"NEXT")
        assert stream.read(1) == b"\x01"
        assert stream.read(32) == b"F" * 32
        assert stream.read(15) == b"tail-of-message"
        assert stream.wait(1.0)  # the next message's bytes are buffered already
        assert stream.read(4) == b"NEXT"


def test_stream_read_into_drains_the_buffer_first() -> None:
    a, b = socket.socketpair()
    payload = bytes(range(256)) * 64  # 16 KiB, larger than the stream's buffer
    with a, b:
        stream = Stream(b, default_timeout_s=5.0, buffer_bytes=1024)
        stream.begin(None)
        sender = threading.Thread(target=a.sendall, args=(b"HEAD" + payload + b"END",))
        sender.start()
        assert stream.read(4) == b"HEAD"  # the read brought part of the payload along
        out = memoryview(bytearray(len(payload)))
        stream.read_into(out)
        assert bytes(out) == payload
        assert stream.read(3) == b"END"
        sender.join()


def test_stream_reads_larger_than_its_buffer_and_across_a_wrap() -> None:
    a, b = socket.socketpair()
    with a, b:
        stream = Stream(b, default_timeout_s=5.0, buffer_bytes=16)
        stream.begin(None)
        a.sendall(b"0123456789" + b"abcdefghij" + b"Z" * 100)
        assert stream.read(10) == b"0123456789"
        assert stream.read(10) == b"abcdefghij"  # leftover moved to the buffer's front
        assert stream.read(100) == b"Z" * 100  # a read of its own


def test_stream_deadline_and_closed_peer() -> None:
    a, b = socket.socketpair()
    with a, b:
        stream = Stream(b, default_timeout_s=5.0)
        stream.begin(time.monotonic() + 0.05)
        with pytest.raises(TimeoutError):
            stream.read(1)  # nothing arrives within the deadline
        a.sendall(b"ab")
        a.shutdown(socket.SHUT_WR)
        late = Stream(b, default_timeout_s=5.0)
        late.begin(None)
        with pytest.raises(ConnectionError):
            late.read(3)  # the peer closed mid-message
    c, d = socket.socketpair()
    with c, d:
        c.close()
        assert not Stream(d, default_timeout_s=5.0).wait(1.0)  # closed between messages
