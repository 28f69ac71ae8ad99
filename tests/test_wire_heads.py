"""The data port's head request (``kvstore.wire``: op 12) and its answer: the documented layout,
field by field, round trips, and the bound on what a head may ask of each block, refused on
both ends."""

from __future__ import annotations

import pytest

from kvstore import wire
from kvstore.errors import InvalidArgument
from tests.test_wire import FP, KEYS, reader, u, whole


def test_a_head_request_is_op_fingerprint_count_keys_and_head_bytes() -> None:
    raw = wire.head_request(FP, KEYS, 266)
    assert raw == bytes([12]) + FP + u(3, 4) + b"".join(KEYS) + u(266, 4)
    read, buf = reader(raw)
    assert wire.read_op(read) == wire.OP_HEAD
    assert wire.read_keys(read, 65536) == (FP, KEYS)
    assert wire.read_head_bytes(read) == 266 and whole(buf)


@pytest.mark.parametrize("head_bytes", [-1, wire.MAX_HEAD_BYTES + 1])
def test_a_head_past_its_bound_is_refused_before_it_goes_out(head_bytes: int) -> None:
    with pytest.raises(InvalidArgument, match="head"):
        wire.head_request(FP, KEYS, head_bytes)


def test_the_server_refuses_a_head_past_its_bound() -> None:
    """A client that packs its own (not ours) cannot make the server answer megabytes a key."""
    read, _ = reader(u(wire.MAX_HEAD_BYTES + 1, 4))
    with pytest.raises(InvalidArgument, match="at most"):
        wire.read_head_bytes(read)


def test_a_heads_answer_is_status_count_lengths_then_the_heads() -> None:
    heads = [b"\x01" * 5, b"", b"abc"]
    raw = wire.heads_answer(heads)
    assert raw == wire.OK_FRAME + u(3, 4) + u(5, 4) + u(0, 4) + u(3, 4) + b"\x01" * 5 + b"abc"
    read, buf = reader(raw[len(wire.OK_FRAME) :])
    assert wire.read_heads_answer(read) == heads and whole(buf)


@pytest.mark.parametrize("count", [0, 1, 1100], ids=["none", "one", "past-the-cached-layouts"])
def test_a_heads_answer_round_trips(count: int) -> None:
    heads = [bytes([i % 251]) * (i % 300) for i in range(count)]
    read, buf = reader(wire.heads_answer([memoryview(h) for h in heads])[len(wire.OK_FRAME) :])
    assert wire.read_heads_answer(read) == heads and whole(buf)
