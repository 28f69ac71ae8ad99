"""The data port's protocol has one owner, ``kvstore.wire``: every message encodes and decodes
there and comes back as it went (round trips below), its bytes are the documented layout (the
pinned messages, written out here field by field), and no other module writes a layout of its own
(the scan at the end)."""

from __future__ import annotations

import ast
import io
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore import wire
from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.status import Status
from kvstore.stream import Stream

FP = bytes(range(32))
KEYS = [bytes([i]) * 32 for i in range(1, 4)]
PARENT = b"\xaa" * 32
ROOT = Path(__file__).resolve().parent.parent


def reader(data: bytes) -> tuple[wire.Read, io.BytesIO]:
    """A ``Stream.read`` over ``data``: exactly n bytes, or the test fails."""
    buf = io.BytesIO(data)

    def read(n: int) -> bytes:
        got = buf.read(n)
        assert len(got) == n, f"read {n} bytes past the message's end"
        return got

    return read, buf


def whole(buf: io.BytesIO) -> bool:
    """Whether the decoder read the message to its last byte."""
    return buf.read() == b""


@dataclass(frozen=True)
class Slot:
    offset: int
    size_bytes: int


def u(n: int, width: int) -> bytes:
    return n.to_bytes(width, "little")


# ----------------------------------------------------------------- requests


def test_hello_round_trips_and_is_magic_then_two_counted_strings() -> None:
    raw = wire.hello(b"tok-a", b"scope")
    assert raw == b"KVD3" + u(5, 2) + b"tok-a" + u(5, 2) + b"scope"
    read, buf = reader(raw)
    assert wire.read_hello(read) == ("tok-a", "scope") and whole(buf)
    with pytest.raises(wire.InvalidArgument, match="magic"):
        wire.read_hello(reader(b"HTTP" + raw[4:])[0])


@pytest.mark.parametrize("op", sorted(wire.KEYS_OPS))
@pytest.mark.parametrize("count", [0, 3, 1100], ids=["none", "few", "past-the-cached-layouts"])
def test_a_request_on_keys_round_trips(op: int, count: int) -> None:
    keys = [i.to_bytes(32, "little") for i in range(count)]
    ttl = None if op == wire.OP_GET else 2.5
    read, buf = reader(wire.keys_request(op, FP, keys, ttl))
    assert wire.read_op(read) == op
    assert wire.read_keys(read, 65536) == (FP, keys)
    if ttl is not None:
        assert wire.read_ttl(read) == ttl
    assert whole(buf)


def test_a_lookup_is_op_fingerprint_count_keys_and_ttl() -> None:
    raw = wire.keys_request(wire.OP_LOOKUP, FP, KEYS[:1], 1.5)
    assert raw == bytes([3]) + FP + u(1, 4) + KEYS[0] + bytes.fromhex("000000000000f83f")
    assert wire.small_request_size(memoryview(raw)) == len(raw)
    assert wire.small_request_size(memoryview(raw[:36])) == -1  # the count not here yet
    assert wire.lookup_slots_request(FP, KEYS[:1], 1.5) == bytes([10]) + raw[1:]


def test_the_server_refuses_more_keys_than_its_bound() -> None:
    with pytest.raises(wire.InvalidArgument, match="at most 2 blocks"):
        wire.read_keys(reader(wire.keys_request(wire.OP_GET, FP, KEYS)[1:])[0], 2)


def test_ids_of_the_wrong_length_are_refused_before_they_go_out() -> None:
    with pytest.raises(wire.InvalidArgument, match="32 bytes"):
        wire.keys_request(wire.OP_LOOKUP, FP, [b"short"], 0.0)
    with pytest.raises(wire.InvalidArgument, match="32 bytes"):
        wire.put_head(FP[:31], KEYS, [1, 2, 3], None)
    with pytest.raises(wire.InvalidArgument, match="parent"):
        wire.reserve_request(FP, KEYS, [1, 2, 3], b"p", 1.0)
    with pytest.raises(wire.InvalidArgument, match="2 sizes for 3 keys"):
        wire.reserve_request(FP, KEYS, [1, 2], None, 1.0)


@pytest.mark.parametrize("parent", [None, PARENT], ids=["root", "child"])
def test_a_reserve_round_trips(parent: bytes | None) -> None:
    raw = wire.reserve_request(FP, KEYS, [10, 20, 1 << 40], parent, 7.0)
    read, buf = reader(raw)
    assert wire.read_op(read) == wire.OP_RESERVE
    assert wire.read_keys(read, 8) == (FP, KEYS)
    assert wire.read_reserve_tail(read, len(KEYS)) == (parent, 7.0, [10, 20, 1 << 40])
    assert whole(buf)
    tail = bytes([parent is not None]) + (parent or bytes(32)) + bytes.fromhex("0000000000001c40")
    assert raw.endswith(tail + u(10, 8) + u(20, 8) + u(1 << 40, 8))


@pytest.mark.parametrize("op", sorted(wire.ID_OPS))
def test_a_request_on_an_id_round_trips_and_is_op_then_u64(op: int) -> None:
    raw = wire.id_request(op, 2**64 - 2)
    assert raw == bytes([op]) + u(2**64 - 2, 8)
    assert wire.small_request_size(memoryview(raw)) == len(raw)
    read, buf = reader(raw)
    assert wire.read_op(read) == op and wire.read_id(read) == 2**64 - 2 and whole(buf)


def test_a_release_request_is_its_id_request() -> None:
    assert wire.release_request(7) == wire.id_request(wire.OP_RELEASE_NOWAIT, 7)


@pytest.mark.parametrize("checksums", [[], [0, 2**64 - 1, 12345]], ids=["none", "three"])
def test_a_commit_round_trips_and_is_op_id_then_counted_checksums(checksums: list[int]) -> None:
    raw = wire.commit_request(7, checksums)
    assert raw == bytes([wire.OP_COMMIT]) + u(7, 8) + u(len(checksums), 4) + b"".join(
        u(c, 8) for c in checksums
    )
    read, buf = reader(raw)
    assert wire.read_op(read) == wire.OP_COMMIT and wire.read_id(read) == 7
    assert wire.read_commit_tail(read, 16) == checksums and whole(buf)


def test_a_commit_with_more_checksums_than_a_request_may_hold_blocks_is_refused() -> None:
    read, _ = reader(wire.commit_request(7, [1, 2, 3]))
    assert wire.read_op(read) == wire.OP_COMMIT and wire.read_id(read) == 7
    with pytest.raises(InvalidArgument, match="at most 2 blocks"):
        wire.read_commit_tail(read, 2)


@pytest.mark.parametrize("count", [3, 1100], ids=["few", "past-the-cached-layouts"])
@pytest.mark.parametrize("parent", [None, PARENT], ids=["root", "child"])
def test_a_put_head_round_trips(count: int, parent: bytes | None) -> None:
    keys = [i.to_bytes(32, "little") for i in range(count)]
    sizes = [i * 4096 for i in range(count)]
    raw = wire.put_head(FP, keys, sizes, parent)
    read, buf = reader(raw + b"payloads")
    assert wire.read_op(read) == wire.OP_PUT
    assert wire.read_put_head(read, 65536) == (FP, parent, keys, sizes)
    assert buf.read() == b"payloads"  # the head ends where the payloads begin
    assert raw[:70] == bytes([2]) + FP + bytes([parent is not None]) + (parent or bytes(32)) + u(count, 4)
    assert raw[70:110] == keys[0] + u(sizes[0], 8)


# ----------------------------------------------------------------- answers


def test_status_frames_round_trip_with_their_detail() -> None:
    assert bytes(5) == wire.OK_FRAME  # code 0, no message
    ends = socket.socketpair()
    with ends[0], ends[1]:
        ends[0].sendall(wire.error_frame(LeaseExpired("lease 7 expired")) * 2 + wire.OK_FRAME)
        code, message = wire.read_status(ends[1], time.monotonic() + 5)  # off the socket
        error = wire.status_error(code, message)
        assert code != Status.OK and isinstance(error, LeaseExpired) and str(error) == "lease 7 expired"
        stream = Stream(ends[1], 5.0)  # and through a stream's buffer
        assert wire.read_stream_status(stream) == (code, message)
        assert wire.read_stream_status(stream) == (Status.OK, "")


def _answer(raw: bytes) -> tuple[wire.Read, io.BytesIO]:
    """The answer's body, its OK status checked and taken off as a client's ``_check`` does."""
    assert raw[:5] == wire.OK_FRAME
    return reader(raw[5:])


def test_a_resolve_answer_round_trips() -> None:
    slots = [Slot(0, 4096), Slot(1 << 33, 2 << 20)]
    read, buf = _answer(wire.resolve_answer(b"kvstore-arena", slots, ["dram", "nvme"], 42))
    assert wire.read_resolve_answer(read) == (
        "kvstore-arena",
        [(0, 4096), (1 << 33, 2 << 20)],
        ("dram", "nvme"),
        42,
    )
    assert whole(buf)


def test_a_reserve_answer_round_trips_with_a_block_given_no_slot() -> None:
    raw = wire.reserve_answer(b"arena", 9, [Slot(64, 8), None, Slot(128, 8)])
    read, buf = _answer(raw)
    name, reservation_id, given, offsets, sizes = wire.read_reserve_answer(read, 3)
    assert (name, reservation_id, list(given), list(offsets), list(sizes)) == (
        "arena", 9, [1, 0, 1], [64, 0, 128], [8, 0, 8],
    )  # fmt: skip
    assert whole(buf)
    assert raw[5:] == u(5, 2) + b"arena" + u(9, 8) + b"\1" + u(64, 8) + u(8, 8) + bytes(17) + b"\1" + u(
        128, 8
    ) + u(8, 8)


def test_stored_and_held_answers_round_trip() -> None:
    read, buf = _answer(wire.stored_answer(65536))
    assert wire.read_stored(read) == 65536 and whole(buf)
    for held in (True, False):
        read, buf = _answer(wire.held_answer(held))
        assert wire.read_held(read) is held and whole(buf)


def test_a_lookup_answer_round_trips() -> None:
    raw = wire.lookup_answer(3, ["hbm", "dram", "remote"], 5)
    assert raw[5:] == u(3, 4) + bytes([1, 2, 4]) + u(5, 8)
    read, buf = _answer(raw)
    assert wire.read_lookup_answer(read) == (3, bytes([1, 2, 4]), 5) and whole(buf)


def test_a_lookup_answer_with_slots_round_trips_the_hits_without_one() -> None:
    """Three hits: the first in the arena, the second not (nvme), the third past the slots the
    store gave (none either)."""
    raw = wire.lookup_answer(3, ["dram", "nvme", "nvme"], 8, [Slot(4096, 512), None], b"arena")
    read, buf = _answer(raw)
    hit, tiers, lease_id, name, offsets, sizes = wire.read_lookup_slots_answer(read)
    assert (hit, tiers, lease_id, name) == (3, bytes([2, 3, 3]), 8, "arena")
    assert (list(offsets), list(sizes)) == ([4096, 0, 0], [512, 0, 0])
    assert whole(buf)


def test_a_get_answer_is_block_heads_then_the_end() -> None:
    read, buf = reader(wire.block_head(4096, 0xDEADBEEF) + b"x" * 4096 + wire.BLOCKS_END)
    assert wire.read_block_head(read) == (4096, 0xDEADBEEF)
    assert read(4096) == b"x" * 4096
    assert wire.read_block_head(read) is None
    assert read(5) == wire.OK_FRAME and whole(buf)


# ----------------------------------------------------------------- one owner

# Modules that speak the data port, or could: none of them may lay out bytes of its own.
SPEAKERS = [
    "kvstore/client",
    "kvstore/server",
    "kvstore/remote",
    "kvstore/stream.py",
    "benchmarks/fairness.py",
    "benchmarks/noisy_tenant.py",
]


def _production_files() -> list[Path]:
    return sorted(p for d in ("kvstore", "benchmarks", "engine_plugin") for p in (ROOT / d).rglob("*.py"))


def _layouts_written(path: Path) -> list[str]:
    """What in ``path`` writes a message layout: ``struct`` imported, an ``OP_*`` constant
    assigned, the hello's magic spelled out."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "struct" for a in node.names):
            found.append(f"line {node.lineno}: import struct")
        elif isinstance(node, ast.ImportFrom) and node.module == "struct":
            found.append(f"line {node.lineno}: from struct import")
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id.startswith("OP_"):
                        found.append(f"line {node.lineno}: {name.id} assigned")
        elif isinstance(node, ast.Constant) and isinstance(node.value, bytes) and b"KVD" in node.value:
            found.append(f"line {node.lineno}: the magic {node.value!r}")
    return found


def _speaks_the_data_port(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    if any(rel == s or rel.startswith(s + "/") for s in SPEAKERS):
        return True
    return "kvstore.wire" in path.read_text() or "kvstore.stream" in path.read_text()


def test_no_module_but_wire_writes_a_data_port_layout() -> None:
    files = [p for p in _production_files() if p.relative_to(ROOT).as_posix() != "kvstore/wire.py"]
    assert len(files) > 100
    offenders = {}
    for path in files:
        found = _layouts_written(path)
        if not _speaks_the_data_port(path):  # struct elsewhere is other formats' business
            found = [f for f in found if "struct" not in f]
        if found:
            offenders[path.relative_to(ROOT).as_posix()] = found
    assert offenders == {}


def test_the_scan_finds_a_layout_written_by_hand(tmp_path: Path) -> None:
    """The scan above would catch what the data port's modules did before: their own structs and
    opcodes."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text('import struct\nOP_GET = 1\nHELLO = b"KVD2"\n_COUNT = struct.Struct("<I")\n')
    assert len(_layouts_written(rogue)) == 3
