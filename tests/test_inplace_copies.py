"""The client's batched copies into and out of arena slots (``kvstore.client.inplace``): one
native call when ``tiers._gather`` is built, the Python loop a build without a C compiler runs
otherwise; both checked the same way before a byte moves."""

from __future__ import annotations

import os

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
