"""``python -m benchmarks.peers [--quick] [--peer NAME]``: install, measure and print the peers alone.

Exits 0 when every requested peer was measured, 1 when any was unavailable (its reason is in the
table). Logs are kept, and their folder printed, only when something failed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from benchmarks.common import Result, print_results, write_json
from benchmarks.peers.harness import measure_peer
from benchmarks.peers.install import install_peer
from benchmarks.peers.outcome import PeerFigures, PeerUnavailable
from benchmarks.peers.specs import PEERS
from benchmarks.peers.workers.peerlib import MiB, Workload

QUICK = Workload(blocks=128, rounds=3, exists_calls=200)
FULL = Workload(blocks=512, rounds=5, exists_calls=500)


def results_for(outcome: PeerFigures | PeerUnavailable, workload: Workload) -> list[Result]:
    """Table rows for one peer: put, get, existence p50 and p99; one empty row when unavailable."""
    if isinstance(outcome, PeerUnavailable):
        return [Result(f"{outcome.peer}", None, "", note=outcome.reason)]
    size = (
        f"{workload.block_bytes // MiB} MiB" if workload.block_bytes >= MiB else f"{workload.block_bytes} B"
    )
    name = outcome.peer
    return [
        Result(f"{name} put {size} x{workload.blocks}", outcome.put_gbps, "GB/s", note=outcome.client),
        Result(f"{name} get {size} x{workload.blocks}", outcome.get_gbps, "GB/s", note=outcome.notes),
        Result(f"{name} exists 64 keys p50", outcome.exists64_p50_ms, "ms"),
        Result(f"{name} exists 64 keys p99", outcome.exists64_p99_ms, "ms"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.blocks} blocks, not {FULL.blocks}")
    parser.add_argument("--peer", action="append", choices=PEERS, help="only this peer (repeatable)")
    parser.add_argument("--blocks", type=int, help="number of distinct blocks")
    parser.add_argument("--block-bytes", type=int, help="bytes per block (default 2 MiB)")
    parser.add_argument("--rounds", type=int, help="timed rounds, after one warm-up round")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--workdir", type=Path, help="folder for logs (default: a temporary one)")
    args = parser.parse_args(argv)

    base = QUICK if args.quick else FULL
    try:
        workload = Workload(
            block_bytes=args.block_bytes or base.block_bytes,
            blocks=args.blocks or base.blocks,
            rounds=args.rounds or base.rounds,
            exists_calls=base.exists_calls,
        )
    except ValueError as e:
        parser.error(str(e))
    console = Console(stderr=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvstore-peers-"))
    outcomes: list[PeerFigures | PeerUnavailable] = []
    for name in args.peer or PEERS:
        with console.status(f"installing {name}"):
            installed = install_peer(name)
        if isinstance(installed, PeerUnavailable):
            outcomes.append(installed)
            continue
        how = f"installed in {installed.seconds:.0f} s" if installed.fresh else "already installed"
        console.print(f"{name}: {how} ({installed.python})")
        with console.status(f"measuring {name}"):
            outcomes.append(measure_peer(name, workload, workdir))

    results = [r for outcome in outcomes for r in results_for(outcome, workload)]
    command = "python -m benchmarks.peers" + (" --quick" if args.quick else "")
    print_results(f"{command} ({workload.blocks} blocks, {workload.rounds} rounds)", results)
    if args.json:
        peers = {o.peer: asdict(o) for o in outcomes}
        write_json(args.json, results, {"command": command, "workload": asdict(workload), "peers": peers})
    failed = any(isinstance(o, PeerUnavailable) for o in outcomes)
    if failed:
        console.print(f"logs kept in {workdir}")
    elif args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
