"""A killed server's arena is salvaged by its journal, and a slot whose bytes changed after its
block was acknowledged (a process that mapped the arena wrote there, damaged memory) is dropped
and counted, never copied into nvme and served: a block the server received carries the checksum
of the bytes it was committed with, and a block a same-host client wrote in place the checksum
the dram tier's hasher took just after its commit (``tiers.dram_hasher``)."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import block_keys
from kvstore.server.datadir import ARENA_ID_FILE
from tests.service_fixtures import MODEL, process_settings
from tiers.dram import JOURNAL_SUFFIX, Arena
from tiers.journal import replay


def _arena_of(data_dir: Path) -> str:
    """The path of the one arena in /dev/shm the server on ``data_dir`` made."""
    folder_id = (data_dir / ARENA_ID_FILE).read_text().strip()
    (name,) = [p.name for p in Path("/dev/shm").glob(f"kvstore-{folder_id}-*") if "." not in p.name]
    return Arena.path_of(name)


def _block(i: int) -> bytes:
    return bytes([i + 1]) * MODEL.block_bytes


def test_a_slot_changed_after_its_commit_is_not_salvaged_and_is_counted() -> None:
    # clean_ahead off: no block may reach nvme before the kill other than by salvage
    server = ServerProcess(process_settings(**{"store.clean_ahead": "0"}), tcp=True)
    try:
        with connect(server.tcp, token="tok-a") as kv:  # remote: the server copies the bytes in
            fp = kv.register(MODEL)
            remote = block_keys(fp, list(range(8 * MODEL.tokens_per_block)), MODEL.tokens_per_block)
            assert kv.put(fp, remote, [_block(i) for i in range(8)]) == 8
        with connect(server.unix, token="tok-a") as kv:  # same host: written in place
            assert kv.register(MODEL) == fp
            local = block_keys(
                fp, list(range(4 * MODEL.tokens_per_block)), MODEL.tokens_per_block, cache_salt="l"
            )
            assert kv.write(fp, local, [_block(20 + i) for i in range(4)]) == 4
        arena = _arena_of(server.data_dir)
        deadline = time.monotonic() + 10
        while True:  # the hasher journals the in-place blocks' checksums just after their commit
            by_key = {r.key: r for r in replay(arena + JOURNAL_SUFFIX).values()}
            summed = [r for k, r in by_key.items() if any(k.endswith(key) for key in local)]
            if len(summed) == 4 and all(r.checksum is not None for r in summed):
                break
            assert time.monotonic() < deadline, (
                f"{sum(r.checksum is None for r in summed)} of 4 in-place blocks without a checksum"
            )
            time.sleep(0.05)
        altered = [remote[5], remote[7], local[2]]  # the blocks before the first stay a servable prefix
        for key in altered:
            (record,) = [r for k, r in by_key.items() if k.endswith(key)]
            assert record.checksum is not None, "committed without its checksum"
            with open(arena, "r+b") as f:
                f.seek(record.offset + 100)
                f.write(b"\xee" * 16)
        server.kill()
        server.start()
        with connect(server.unix, token="tok-a") as kv:
            assert kv.lookup(fp, remote) == 5
            assert [bytes(b) for b in kv.get(fp, remote)] == [_block(i) for i in range(5)]
            assert [bytes(b) for b in kv.get(fp, local)] == [_block(20 + i) for i in range(2)]
            dram = [t for t in kv.stats()["tiers"] if t["name"] == "dram"]
            assert dram[0]["checksum_failures"] == 3
        log = (server.data_dir / "serve.log").read_text()
        assert "3 changed since their commit dropped" in log
        assert log.count("changed since its commit") == 1, "one line for them all"
    finally:
        server.stop()
