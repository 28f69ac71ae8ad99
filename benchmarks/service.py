"""``kvstore bench service``: the service's data planes against references from the same run.

- remote get and put of 2 MiB blocks over loopback TCP (the data port, token auth), against a
  raw TCP socket moving the same bytes between two processes: the plain ``client.get`` (views
  from the receive pool; target >= 0.7x) and ``get_into`` the caller's buffers (the data-port
  path, target >= 0.85x), put (target >= 0.6x); the same over the gRPC streams, for orientation;
- remote put and get of 2 MiB blocks kept in nvme, encrypted at rest (``nvme.encryption_keys_dir``)
  against the same server without it, rounds alternating (``benchmarks.sealed_costs``);
- same-host restore into a client buffer (Resolve + copy out of the mapped arena + Release),
  against memcpy of the same bytes between warm buffers (target >= 0.8x);
- Lookup of 64 keys (all present), one client calling in turn as Redis's ``EXISTS`` is measured,
  over the Unix socket and over TCP (Redis's socket kind), p50 against Redis ``EXISTS`` of 64 keys
  from the peers below (target <= 1.0x); and from 4 concurrent client processes over the Unix
  socket (48 of 64 present), p50 and p99 (target p99 <= 2 ms);
- same-host writes into a full arena, a pause between them, against the same writes into the
  empty arena (target >= 0.7x), with the cleaner and without it (``store.clean_ahead=0``);
- one tenant's 64-key lookup p99 over TCP, the Unix socket and gRPC while another holds 250
  data-port connections pipelining 500-key lookups (``benchmarks.fairness``; target <= 5 ms;
  ``--fairness`` runs this row alone);
- the pause a full garbage collection would impose with 100k blocks indexed (400k without
  ``--quick``), against what is left of it after the freeze ``kvstore serve`` makes
  (``benchmarks.gc_pause``; the server runs no full collection after start);
- the same put/get workload on Redis, Mooncake Store and LMCache's server (``benchmarks.peers``),
  where they are installed (``--install-peers`` installs them) and start here (target: faster
  than each), ours measured again just before and just after each peer
  (``benchmarks.service_peers``).

The server runs as its own process (``kvstore serve``), as it would be deployed.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from benchmarks.common import Result, print_results, write_json
from benchmarks.gc_pause import bench_gc_pause
from benchmarks.sealed_costs import nvme_rows
from benchmarks.service_lookup import bench_lookup, bench_lookup_under_writes, fairness_rows
from benchmarks.service_peers import bench_peers, say_what_peers_need
from benchmarks.service_remote import bench_remote, bench_tls, ours_now
from benchmarks.service_same_host import bench_full_arena, bench_same_host
from benchmarks.service_setup import BLOCK, bench_server


def run_service_bench(
    quick: bool,
    json_path: str | None,
    with_peers: bool = True,
    fairness_only: bool = False,
    install_peers: bool = False,
) -> int:
    """``install_peers``: install the peers that are missing (``benchmarks.service_peers``);
    without it nothing is installed and a missing peer is a row saying what it lacks."""
    count = 64 if quick else 256
    rounds = 5 if quick else 9
    console = Console(stderr=True)
    if fairness_only:
        console.print("[dim]lookup latency beside a noisy tenant …[/]")
        rows = fairness_rows(runs=3)
        print_results("kvstore bench service --fairness", rows)
        if json_path:
            write_json(json_path, rows, {"command": "kvstore bench service --fairness"})
        return 0
    server = bench_server(arena_bytes=(3 * count + 64) * BLOCK)
    results: list[Result] = []
    try:
        console.print("[dim]remote get/put against raw TCP …[/]")
        results += bench_remote(server, count, rounds, "auto")
        results += bench_remote(server, count, rounds, "grpc")
        console.print("[dim]remote get/put over TLS against plaintext …[/]")
        results += bench_tls(server, count, rounds)
        console.print("[dim]remote get/put from nvme encrypted at rest against plain …[/]")
        results += nvme_rows(min(count, 64), rounds)
        console.print("[dim]same-host restore against memcpy …[/]")
        # A server of their own: the blocks the rows above left would fill the arena, and each
        # write would then pay for demoting them to nvme, which is not what these rows measure.
        same_host = bench_server(arena_bytes=(3 * count + 64) * BLOCK)
        try:
            # Three times the rounds: a round is ~15 ms of copying here, and five of them, on a
            # machine whose memcpy moved 17-24 GB/s between runs, left the median to chance.
            results += bench_same_host(same_host, count, 3 * rounds)
            results += bench_same_host(same_host, count, 3 * rounds, small=True)
        finally:
            same_host.stop()
        console.print("[dim]lookup latency, 4 clients …[/]")
        results += bench_lookup(server, calls=500 if quick else 2000)
        console.print("[dim]lookup latency while a writer overflows the arena …[/]")
        results += bench_lookup_under_writes(count)
        console.print("[dim]writes into a full arena, with and without the cleaner …[/]")
        results += bench_full_arena(count)
        console.print("[dim]lookup latency beside a noisy tenant …[/]")
        results += fairness_rows(runs=1 if quick else 3)
        console.print("[dim]a full garbage collection's pause …[/]")
        results += bench_gc_pause(100_000 if quick else 400_000)
    finally:
        server.stop()
    if with_peers:
        say_what_peers_need(console, install_peers)
        by_metric = {r.metric: r.value or 0.0 for r in results}
        lookups = {
            "Unix socket": by_metric["lookup 64 keys p50, one client (Unix)"],
            "TCP": by_metric["lookup 64 keys p50, one client (TCP)"],
        }
        results += bench_peers(
            lambda: ours_now(count, rounds), count, rounds, lookups, console, install_peers
        )
    title = f"kvstore bench service{' --quick' if quick else ''}"
    print_results(title, results)
    if json_path:
        write_json(json_path, results, {"command": title})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_service_bench(quick="--quick" in sys.argv, json_path=None, with_peers=False))
