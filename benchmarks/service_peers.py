"""The peers' rows of ``kvstore bench service``: Redis, Mooncake Store and LMCache's server on
the same put/get workload as ours, ours measured just before and just after each.

Nothing is installed unless ``install`` says so (``kvstore bench service --install-peers``):
installing means ``apt-get install`` as root and a venv per peer under ``.kvstore/peers``, which
a benchmark run must not do behind its caller's back. Without it a peer that is missing is a row
naming what it lacks and the flag, and a line on stderr says the same before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from benchmarks import peers
from benchmarks.common import Result

BLOCK = 2 << 20
INSTALL_FLAG = "--install-peers"


def say_what_peers_need(
    console: Console, install: bool, names: Sequence[str] = peers.PEERS, root: Path | None = None
) -> dict[str, list[str]]:
    """Tell the caller, before anything runs, which peers are missing what, and whether this run
    installs it; what each lacks."""
    missing = {name: lacks for name in names if (lacks := peers.peer_missing(name, root))}
    for name, lacks in missing.items():
        if install:
            console.print(f"{INSTALL_FLAG}: installing {name}: {'; '.join(lacks)}")
        else:
            console.print(
                f"peer {name} not installed ({'; '.join(lacks)}): not measured; {INSTALL_FLAG} "
                "installs it (apt-get as root, pip into its own venv), --no-peers skips the peers"
            )
    return missing


def bench_peers(
    ours: Callable[[], dict[str, float]],
    count: int,
    rounds: int,
    lookups: dict[str, float],
    console: Console,
    install: bool = False,
    names: Sequence[str] = peers.PEERS,
    root: Path | None = None,
) -> list[Result]:
    """Our remote get and put (``ours()``: GB/s by "get" and "put" on a server of their own)
    against each peer's on the same workload, ours measured just before and just after it (the
    mean of the two passes: a pass minutes apart saw this machine's loopback at another speed,
    up to 1.5x); ``lookups``: our one-client lookup p50 in ms by socket kind, against Redis
    ``EXISTS``. ``install``: install missing peers first; else they are rows saying what they lack."""
    results: list[Result] = []
    for name in names:
        if install:  # first: ours is measured just around the peer's run, not its install
            installed = peers.install_peer(name, root)
            if isinstance(installed, peers.PeerUnavailable):
                results.append(Result(f"vs {name}", None, "GB/s", note=f"not installed: {installed.reason}"))
                continue
        elif lacks := peers.peer_missing(name, root):
            note = (
                f"not measured: {name} is not installed here ({'; '.join(lacks)}); {INSTALL_FLAG} installs it"
            )
            results.append(Result(f"vs {name}", None, "GB/s", note=note))
            continue
        console.print(f"[dim]peer {name}: measuring, between two passes of ours …[/]")
        before = ours()
        workload = peers.Workload(block_bytes=BLOCK, blocks=count, rounds=rounds)
        outcome = peers.measure_peer(name, workload, root=root)
        if isinstance(outcome, peers.PeerUnavailable):
            results.append(Result(f"vs {name}", None, "GB/s", note=f"not measured: {outcome.reason}"))
            continue
        after = ours()
        for op in ("get", "put"):
            theirs = getattr(outcome, f"{op}_gbps")
            results.append(
                Result(
                    f"remote {op} 2 MiB vs {name}",
                    (before[op] + after[op]) / 2,
                    "GB/s",
                    f"{name} ({outcome.client})",
                    theirs,
                    ">= 1.0",
                    f"same blocks, same machine; our {'plain get' if op == 'get' else op} "
                    f"{before[op]:.2f} GB/s just before it, {after[op]:.2f} just after",
                )
            )
        if outcome.exists64_p50_ms is not None:
            results.append(
                Result(
                    f"{name} exists 64 keys p50",
                    outcome.exists64_p50_ms,
                    "ms",
                    note=f"{name} ({outcome.client})",
                )
            )
            if name == "redis":
                results += _vs_redis_exists(lookups, outcome.exists64_p50_ms)
    return results


def _vs_redis_exists(lookups: dict[str, float], redis_p50_ms: float) -> list[Result]:
    return [
        Result(
            f"lookup 64 keys p50 vs redis exists ({socket_kind})",
            p50,
            "ms",
            "redis EXISTS of 64 keys",
            redis_p50_ms,
            "<= 1.0",
            "one client calling in turn on both sides, all 64 keys present; "
            f"kvstore over {socket_kind}, redis-py over TCP",
        )
        for socket_kind, p50 in lookups.items()
    ]
