"""A start after a kill -9 indexes what `nvme` holds once: the salvage of the dead server's arena
builds the store's view of `nvme` (to make room under the eviction rules) and the store takes
that view over, rather than scanning `nvme` again. Run on a real `kvstore serve`."""

from __future__ import annotations

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import block_keys
from tests.service_fixtures import MODEL

SETTINGS = {"dram.capacity_bytes": "4MiB", "dram.page_bytes": "1MiB", "nvme.capacity_bytes": "64MiB"}


def test_a_start_after_a_kill_indexes_nvme_once_and_serves_every_block() -> None:
    server = ServerProcess(SETTINGS)
    try:
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            keys = block_keys(fp, list(range(8 * MODEL.tokens_per_block)), MODEL.tokens_per_block)
            values = [bytes([i + 1]) * MODEL.block_bytes for i in range(8)]
            kv.write(fp, keys[:4], values[:4])
        server.restart()  # a clean stop: the first four on nvme
        with connect(server.unix) as kv:
            kv.write(fp, keys[4:], values[4:])  # acknowledged in dram only
        server.kill()
        log = server.data_dir / "serve.log"
        before = len(log.read_text().splitlines())
        server.start()  # salvages the dead arena into nvme, then serves
        started = log.read_text().splitlines()[before:]
        assert any("a killed server left 4 blocks" in line for line in started), started
        scans = [line for line in started if "indexed tier nvme" in line]  # the salvage's
        assert len(scans) == 1 and "4 blocks" in scans[0], started
        builds = [line for line in started if "rebuilt the index" in line]  # the store's, taken over
        assert len(builds) == 1 and "8 blocks" in builds[0], builds
        with connect(server.unix) as kv:
            assert kv.lookup(fp, keys) == 8
            assert [bytes(v) for v in kv.get(fp, keys)] == values
    finally:
        assert server.stop() == 0
