"""The client's batched copies into and out of arena slots (``kvstore.client.inplace``): one
native call when ``tiers._gather`` is built, the Python loop a build without a C compiler runs
otherwise; both checked the same way before a byte moves."""

from __future__ import annotations

import os

import pytest
import xxhash

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


@pytest.mark.parametrize("size", [1, 240, 241, 4096, 300_001, 2 << 20, 17 << 20])
def test_a_hashed_scatter_copies_each_block_and_gives_its_xxh3(copy_path: str, size: int) -> None:
    """Lengths about xxh3's classes (240 B, the long loop, its 1 KiB blocks, the streamed stores
    from 16 MiB) at an offset off the line: the digest is xxhash's, every byte arrives."""
    region = memoryview(bytearray(2 * size + 4096 + 64))
    blocks = [os.urandom(size), os.urandom(size)]
    offsets = [3, size + 4096 + 3]
    assert inplace.scatter_hashed(region, offsets, [size, size], blocks) == [
        xxhash.xxh3_64_intdigest(b) for b in blocks
    ]
    assert (
        bytes(region[3 : 3 + size]) == blocks[0]
        and bytes(region[offsets[1] : offsets[1] + size]) == blocks[1]
    )


def test_a_hashed_scatter_takes_only_a_block_of_its_slots_size(copy_path: str) -> None:
    region = memoryview(bytearray(1 << 16))
    with pytest.raises(ValueError):
        inplace.scatter_hashed(region, [0], [8192], [os.urandom(4096)])  # its checksum would miss the rest
    assert bytes(region) == bytes(1 << 16), "nothing copied"
