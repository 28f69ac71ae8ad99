"""One group of ``bench service --quick``'s rows alone, as one JSON line of each row's ratio to
its in-run reference: the quick way to A/B two trees on one machine, alternating
(``PYTHONPATH=<tree> python -m benchmarks.service_rows same-host|remote`` from each tree in turn)."""

from __future__ import annotations

import json
import sys

from benchmarks.common import Result
from benchmarks.server_process import ServerProcess
from benchmarks.service_remote import bench_remote
from benchmarks.service_same_host import bench_same_host
from benchmarks.service_setup import BLOCK, bench_server

COUNT = 64
ROUNDS = 5  # as bench service --quick (the same-host rows run three times as many)


def _same_host(server: ServerProcess) -> list[Result]:
    return bench_same_host(server, COUNT, 3 * ROUNDS) + bench_same_host(server, COUNT, 3 * ROUNDS, small=True)


def _remote(server: ServerProcess) -> list[Result]:
    return bench_remote(server, COUNT, ROUNDS, "auto")


GROUPS = {"same-host": _same_host, "remote": _remote}


def main() -> None:
    group = sys.argv[1] if len(sys.argv) > 1 else ""
    if group not in GROUPS:
        sys.exit(f"usage: python -m benchmarks.service_rows {'|'.join(GROUPS)}")
    server = bench_server(arena_bytes=(3 * COUNT + 64) * BLOCK)
    try:
        ratios = {
            r.metric: round(r.value / r.reference_value, 3)
            for r in GROUPS[group](server)
            if r.value is not None and r.reference_value
        }
    finally:
        server.stop()
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
