"""The same-host rows of ``bench service --quick`` alone, as one JSON line of each row's ratio
to its in-run reference: the quick way to A/B two trees on one machine, alternating
(``PYTHONPATH=<tree> python -m benchmarks.same_host_rows`` from each tree in turn)."""

from __future__ import annotations

import json

from benchmarks.service_same_host import bench_same_host
from benchmarks.service_setup import BLOCK, bench_server

COUNT = 64
ROUNDS = 9  # as bench service --quick: three times its rounds


def main() -> None:
    server = bench_server(arena_bytes=(3 * COUNT + 64) * BLOCK)
    try:
        ratios = {}
        for small in (False, True):
            for result in bench_same_host(server, COUNT, ROUNDS, small=small):
                if result.value is not None and result.reference_value:
                    ratios[result.metric] = round(result.value / result.reference_value, 3)
    finally:
        server.stop()
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
