"""A same-host client's commit carries the xxh3-64 of each block it copied into the arena
(``kvstore.client.inplace.scatter_hashed``): the server keeps it from the commit on, in the
block's entry and in the arena journal's commit record, and checks the block against it when its
bytes leave the process. Against a real ``kvstore serve``."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.errors import InvalidArgument
from kvstore.keys import block_keys
from kvstore.server.datadir import ARENA_ID_FILE
from tests.service_fixtures import MODEL, process_settings
from tiers.dram import JOURNAL_SUFFIX, Arena
from tiers.journal import COMMIT, SUMMED


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(process_settings(), tcp=True)
    try:
        yield process
    finally:
        process.stop()


def _journal_of(data_dir: Path) -> Path:
    folder_id = (data_dir / ARENA_ID_FILE).read_text().strip()
    (name,) = [p.name for p in Path("/dev/shm").glob(f"kvstore-{folder_id}-*") if "." not in p.name]
    return Path(Arena.path_of(name) + JOURNAL_SUFFIX)


def _records(journal: Path) -> list[tuple[int, bytes, int | None]]:
    """(kind, key, checksum or None) of each commit and summed record, in the file's order."""
    data, pos, out = journal.read_bytes(), 0, []
    while pos + 4 <= len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        kind = data[pos + 4]
        if kind in (COMMIT, SUMMED):
            at = pos + 4 + 1 + 16
            (key_len,) = struct.unpack_from("<H", data, at)
            key = data[at + 2 : at + 2 + key_len]
            at += 2 + key_len + 32
            (meta_len,) = struct.unpack_from("<H", data, at)
            summed, checksum = struct.unpack_from("<BQ", data, at + 2 + meta_len)
            out.append((kind, key, checksum if summed else None))
        pos += 4 + length
    return out


def _keys(salt: str, n: int) -> list[bytes]:
    fp = MODEL.fingerprint()
    return block_keys(fp, list(range(n * MODEL.tokens_per_block)), MODEL.tokens_per_block, cache_salt=salt)


def _block(i: int) -> bytes:
    return bytes([i + 1]) * MODEL.block_bytes


def test_a_write_in_place_commits_its_blocks_with_their_checksums(server: ServerProcess) -> None:
    keys, blocks = _keys("written", 6), [_block(i) for i in range(6)]
    with connect(server.unix, token="tok-a") as kv:
        fp = kv.register(MODEL)
        assert kv.write(fp, keys, blocks) == 6
    records = [r for r in _records(_journal_of(server.data_dir)) if any(r[1].endswith(k) for k in keys)]
    by_key = {key: (kind, checksum) for kind, key, checksum in records}
    assert len(by_key) == 6
    for key, block in zip(keys, blocks, strict=True):
        (full,) = [k for k in by_key if k.endswith(key)]
        # in the commit record itself: no block left for the hasher to take after the commit
        assert by_key[full] == (COMMIT, xxhash.xxh3_64_intdigest(block))
    assert not [r for r in records if r[0] == SUMMED]


def test_a_commit_with_another_count_of_checksums_than_slots_stores_nothing(server: ServerProcess) -> None:
    keys, blocks = _keys("miscounted", 3), [_block(10 + i) for i in range(3)]
    with connect(server.unix, token="tok-a") as kv:
        fp = kv.register(MODEL)
        pending = kv.reserve(fp, keys, [len(b) for b in blocks])
        for view, block in zip(pending.views, blocks, strict=True):
            assert view is not None
            view[:] = block
        with pytest.raises(InvalidArgument, match="carries 2 checksums"):
            kv.commit(pending.reservation_id, checksums=[1, 2])
    with connect(server.unix, token="tok-a") as kv:
        assert kv.lookup(fp, keys) == 0
        assert kv.write(fp, keys, blocks) == 3, "the refused reservation's slots went back"


def test_a_block_unlike_its_commits_checksum_never_leaves_the_server(server: ServerProcess) -> None:
    keys, blocks = _keys("lied", 3), [_block(20 + i) for i in range(3)]
    with connect(server.unix, token="tok-a") as kv:
        fp = kv.register(MODEL)
        failures_before = next(t for t in kv.stats()["tiers"] if t["name"] == "dram")["checksum_failures"]
        pending = kv.reserve(fp, keys, [len(b) for b in blocks])
        for view, block in zip(pending.views, blocks, strict=True):
            assert view is not None
            view[:] = block
        sums = [xxhash.xxh3_64_intdigest(b) for b in blocks]
        sums[1] ^= 1  # the second block's bytes are not what its writer said it wrote
        assert kv.commit(pending.reservation_id, checksums=sums) == 3
    with connect(server.tcp, token="tok-a") as remote:  # its bytes leave the process: checked
        assert [bytes(b) for b in remote.get(fp, keys)] == blocks[:1]
        dram = next(t for t in remote.stats()["tiers"] if t["name"] == "dram")
        assert dram["checksum_failures"] == failures_before + 1
