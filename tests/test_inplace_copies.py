"""The client's batched copies into and out of arena slots (``kvstore.client.inplace``): one
native call when ``tiers._gather`` is built, the Python loop a build without a C compiler runs
otherwise; both checked the same way before a byte moves."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.client import inplace


@pytest.fixture(params=["native", "python"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(inplace, "_gather", None)
    else:
        assert inplace._gather is not None, "tiers._gather is not built: no C compiler?"
    return str(request.param)


def test_blocks_go_into_their_slots_and_come_back_out(copy_path: str) -> None:
    region = memoryview(bytearray(1 << 20))
    blocks = [os.urandom(n) for n in (300_000, 4096, 1, 65_536)]
    slots = [(0, 300_000), (300_000, 8192), (400_000, 1), (500_000, 65_536)]  # a slot may be larger
    inplace.scatter_into_slots(region, slots, blocks)
    assert bytes(region[300_000 + 4096 : 308_192]) == bytes(4096)  # past the block: untouched
    outs = [memoryview(bytearray(size + 3)) for _, size in slots]
    inplace.gather_from_slots(region, slots, outs)
    assert bytes(outs[0][:300_000]) == blocks[0]
    assert bytes(outs[1][:4096]) == blocks[1] and bytes(outs[1][4096:8192]) == bytes(4096)
    assert bytes(outs[2][:1]) == blocks[2] and bytes(outs[3][:65_536]) == blocks[3]


def test_copies_are_exact_at_every_offset_within_a_line(copy_path: str) -> None:
    """Source and destination at each of the 64 offsets apart within a cache line (where the
    native copy leaves memcpy for its own loop: tiers/native/copy.h), at lengths about the
    loop's threshold (256 B), its 16-byte head and 64-byte steps, and a tail of each size: every
    byte of the block arrives, none past it changes."""
    lengths = [255, 256, 257, 319, 4096 + 63, 65_536 + 17]
    span = max(lengths) + 128
    region = memoryview(bytearray(64 * span))
    blocks = [os.urandom(lengths[apart % len(lengths)]) for apart in range(64)]
    slots = [(apart * span + apart, len(block)) for apart, block in enumerate(blocks)]  # every offset
    inplace.scatter_into_slots(region, slots, blocks)
    for (offset, size), block in zip(slots, blocks, strict=True):
        assert bytes(region[offset : offset + size]) == block
        assert bytes(region[offset + size : offset + size + 64]) == bytes(64)  # past it: untouched
    backing = bytearray(64 * span)
    outs = [memoryview(backing)[i * span + 7 : i * span + 7 + size + 64] for i, (_, size) in enumerate(slots)]
    inplace.gather_from_slots(region, slots, outs)
    for out, block in zip(outs, blocks, strict=True):
        assert bytes(out[: len(block)]) == block and bytes(out[len(block) :]) == bytes(64)


def test_a_block_larger_than_its_slot_copies_nothing(copy_path: str) -> None:
    region = memoryview(bytearray(4096))
    with pytest.raises(ValueError):
        inplace.scatter_into_slots(region, [(0, 16), (16, 16)], [b"a" * 16, b"b" * 17])
    assert bytes(region) == bytes(4096)
    with pytest.raises(ValueError):
        inplace.scatter_into_slots(region, [(0, 16), (4090, 16)], [b"a" * 16, b"b" * 16])  # past the end
    assert bytes(region) == bytes(4096)


def test_a_buffer_smaller_than_its_block_gets_nothing(copy_path: str) -> None:
    region = memoryview(bytes(range(256)) * 16)
    first, short = bytearray(16), bytearray(15)
    with pytest.raises(ValueError):
        inplace.gather_from_slots(region, [(0, 16), (16, 16)], [memoryview(first), memoryview(short)])
    assert first == bytearray(16) and short == bytearray(15)


def test_native_scatter_refuses_a_read_only_region_and_a_wrong_argument() -> None:
    from tiers import _gather  # type: ignore[attr-defined]

    with pytest.raises(BufferError):
        _gather.scatter(b"read only", [0], [4], [b"abcd"])
    with pytest.raises(ValueError, match="negative"):
        _gather.scatter(bytearray(8), [-1], [4], [b"abcd"])
    with pytest.raises(ValueError, match="length"):
        _gather.scatter(bytearray(8), [0, 4], [4], [b"abcd"])
    with pytest.raises(TypeError):
        _gather.scatter(bytearray(8), (0,), [4], [b"abcd"])


# ----------------------------------------------------------------- the native write loop

_OK = bytes(5)  # a status frame: OK, no message


def _reserve_answer(name: bytes, reservation_id: int, slots: list[tuple[int, int] | None]) -> bytes:
    records = b"".join(
        struct.pack("<BQQ", 0, 0, 0) if s is None else struct.pack("<BQQ", 1, *s) for s in slots
    )
    return _OK + struct.pack("<H", len(name)) + name + struct.pack("<Q", reservation_id) + records


@pytest.fixture
def loop_ends() -> Iterator[tuple[socket.socket, socket.socket]]:
    """The client's end of a data connection and the server's, for ``_writeloop.steps``."""
    assert inplace._writeloop is not None, "kvstore.client._writeloop is not built: no C compiler?"
    client, server = socket.socketpair()
    yield client, server
    client.close()
    server.close()


def _steps(
    client: socket.socket, region: bytearray, coming: list[int], unconfirmed: list[int], **kw: Any
) -> Any:
    """Chunk 1 of two (chunk 0 done), two blocks of 8 bytes, no later request to send."""
    deadline = kw.get("deadline", time.monotonic() + 5)
    blocks = kw.get("blocks", [b"a" * 8, b"b" * 8])
    return inplace._writeloop.steps(
        client.fileno(), region, b"arena", deadline, 30.0, b"", coming, [1, 2], [None, None],
        [[b"x"], blocks], unconfirmed, 1, 3,
    )  # fmt: skip


def test_the_native_write_loop_copies_a_plain_chunk_commits_it_and_reads_the_commit(
    loop_ends: tuple[socket.socket, socket.socket],
) -> None:
    client, server = loop_ends
    region = bytearray(64)
    server.sendall(_reserve_answer(b"arena", 7, [(0, 8), (16, 8)]) + _OK + struct.pack("<I", 2) + b"next")
    coming: list[int] = [1]
    unconfirmed: list[int] = []
    assert _steps(client, region, coming, unconfirmed) == (2, 2, b"next")  # done; what came after
    assert region[0:8] == b"a" * 8 and region[16:24] == b"b" * 8 and region[8:16] == bytes(8)
    assert server.recv(64) == struct.pack("<BQ", 7, 7)  # OP_COMMIT of reservation 7
    assert coming == [] and unconfirmed == []  # read, then confirmed


@pytest.mark.parametrize(
    "answer",
    [
        _reserve_answer(b"arena", 7, [(0, 8), None]),  # a block without a slot
        _reserve_answer(b"other", 7, [(0, 8), (16, 8)]),  # another arena
        _reserve_answer(b"arena", 7, [(0, 8), (60, 8)]),  # a slot past the region
        struct.pack("<BI", 8, 4) + b"full",  # RESOURCE_EXHAUSTED
    ],
    ids=["no slot", "other arena", "outside", "error status"],
)
def test_the_native_write_loop_leaves_anything_but_the_plain_case_unread(
    loop_ends: tuple[socket.socket, socket.socket], answer: bytes
) -> None:
    client, server = loop_ends
    region = bytearray(64)
    server.sendall(answer)
    coming, unconfirmed = [1], []
    assert _steps(client, region, coming, unconfirmed) == (1, 0, answer)  # for the Python loop
    assert region == bytearray(64) and coming == [1] and unconfirmed == []


def test_the_native_write_loop_hands_back_a_block_it_cannot_take_as_it_is(
    loop_ends: tuple[socket.socket, socket.socket],
) -> None:
    client, server = loop_ends
    region = bytearray(64)
    answer = _reserve_answer(b"arena", 7, [(0, 8), (16, 8)])
    server.sendall(answer)
    strided = memoryview(b"s" * 16)[::2]
    for blocks in ([b"a" * 8, strided], [b"a" * 8, b"b" * 9]):  # not contiguous; larger than its slot
        coming: list[int] = [1]
        assert _steps(client, region, coming, [], blocks=blocks) == (1, 0, answer)
        assert region == bytearray(64)
        server.sendall(answer)  # (the answer comes back for the next round)


def test_the_native_write_loop_ends_at_its_deadline_and_on_a_closed_peer(
    loop_ends: tuple[socket.socket, socket.socket],
) -> None:
    client, server = loop_ends
    region = bytearray(64)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        _steps(client, region, [1], [], deadline=start + 0.2)  # an answer that never comes
    assert 0.2 <= time.monotonic() - start < 2.0
    server.sendall(_reserve_answer(b"arena", 7, [(0, 8), (16, 8)])[:10])  # then the server dies
    server.close()
    with pytest.raises(ConnectionError, match="closed"):
        _steps(client, region, [1], [])
