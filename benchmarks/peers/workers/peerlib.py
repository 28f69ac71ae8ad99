"""What every peer worker shares: the workload, servers it starts, the timing loop, the JSON it prints.

Standard library only: this module is imported both by the harness (in kvstore's environment) and
by the workers (in each peer's own virtual environment).

Worker protocol, in order:
1. The harness runs ``python <peer>_worker.py`` + ``Workload.argv()`` + ``--workdir DIR`` in a new
   process group, with a deadline.
2. ``worker_main`` points file descriptor 1 at standard error (peer libraries print logs there),
   keeping the original standard output for the result alone.
3. The worker starts its servers (``Servers``, logs under DIR), measures with ``measure``, stops
   them, and ``worker_main`` prints exactly one JSON object: either the figures (``FIGURE_KEYS``)
   or ``{"unavailable": reason}`` when a ``PeerFailure`` was raised.
Anything else (an uncaught exception, a signal) exits non-zero with a traceback on standard error;
the harness turns that into an unavailable peer and kills what is left of the process group.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

MiB = 1 << 20
EXISTS_KEYS = 64
FIGURE_KEYS = ("put_gbps", "get_gbps", "exists64_p50_ms", "exists64_p99_ms", "client", "notes")
Figures = dict[str, float | str]


class PeerFailure(Exception):
    """The peer could not be started or measured; the message says what a person can do about it."""


@dataclass(frozen=True)
class Workload:
    """The same blocks for every peer: ``blocks`` distinct keys of ``block_bytes`` random bytes.

    Each timed round puts every block, then gets every block; one untimed round warms the
    servers and buffers first. ``exists_calls`` existence checks of ``EXISTS_KEYS`` stored keys
    give the latency percentiles.
    """

    block_bytes: int = 2 * MiB
    blocks: int = 128
    rounds: int = 3
    exists_calls: int = 200

    def __post_init__(self) -> None:
        if self.block_bytes < 1024 or self.block_bytes % 1024:
            raise ValueError(f"block_bytes must be a positive multiple of 1024, not {self.block_bytes}")
        if self.blocks < 1 or self.rounds < 1 or self.exists_calls < 1:
            raise ValueError(f"blocks, rounds and exists_calls must be at least 1: {self}")

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.blocks

    def argv(self) -> list[str]:
        return [
            f"--block-bytes={self.block_bytes}",
            f"--blocks={self.blocks}",
            f"--rounds={self.rounds}",
            f"--exists-calls={self.exists_calls}",
        ]

    def keys(self) -> list[str]:
        return [f"kvbench-{i:06d}" for i in range(self.blocks)]

    def exists_keys(self) -> list[str]:
        """``EXISTS_KEYS`` stored keys (repeating when there are fewer blocks)."""
        keys = self.keys()
        return [keys[i % len(keys)] for i in range(EXISTS_KEYS)]

    def source_bytes(self) -> bytes:
        """Every block's contents back to back, generated once (seeded, so runs compare)."""
        rng, step = random.Random(0), 64 * MiB  # randbytes takes at most 2**31 bits at a time
        return b"".join(
            rng.randbytes(min(step, self.total_bytes - at)) for at in range(0, self.total_bytes, step)
        )


def parse_args(argv: Sequence[str]) -> tuple[Workload, Path]:
    parser = argparse.ArgumentParser(description="Measure one peer KV store; prints one JSON object.")
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--exists-calls", type=int, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    ns = parser.parse_args(argv)
    workload = Workload(ns.block_bytes, ns.blocks, ns.rounds, ns.exists_calls)
    return workload, ns.workdir


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before the server does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Servers:
    """Server processes a worker starts; ``stop_all`` (or leaving the ``with``) ends each of them.

    Servers stay in the worker's process group, so the harness can end them too should the worker
    die. Each one's output goes to ``<workdir>/<name>.log``.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> Servers:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it open
        try:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        except OSError as e:
            raise PeerFailure(f"cannot start {name} ({argv[0]}): {e}") from e
        finally:
            log.close()
        self._procs.append((name, proc))

    def wait_port(self, name: str, port: int, timeout_s: float) -> None:
        """Returns once ``port`` on 127.0.0.1 accepts connections; raises ``PeerFailure`` if ``name``
        exits or ``timeout_s`` passes first."""
        proc = next(p for n, p in self._procs if n == name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PeerFailure(f"{name} exited with status {proc.returncode}; {self.log_tail(name)}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise PeerFailure(f"{name} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")

    def log_tail(self, name: str, lines: int = 3) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "no log"
        tail = " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:])
        return f"last log lines: {tail}" if tail else "its log is empty"

    def stop_all(self, grace_s: float = 5.0) -> None:
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self._procs):
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()


class PeerOps(Protocol):
    """What ``measure`` drives; each call does the whole working set, blocking until done."""

    def clear(self) -> None:
        """Empty the store before a put round (untimed), where the peer can."""

    def put_all(self) -> None:
        """Store every block; returns once the server holds them all."""

    def get_all(self) -> None:
        """Read every block back (into the worker's destination buffers where the API allows)."""

    def check(self) -> None:
        """Raise ``PeerFailure`` unless the blocks read back equal the blocks put."""

    def exists64(self) -> None:
        """One existence check of the ``EXISTS_KEYS`` keys."""


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(workload: Workload, ops: PeerOps) -> dict[str, float]:
    """One untimed warm-up round, then ``rounds`` timed ones; medians of put and get, and the
    existence-check latency percentiles."""
    ops.clear()
    ops.put_all()
    ops.get_all()
    ops.check()
    puts, gets = [], []
    for _ in range(workload.rounds):
        ops.clear()
        puts.append(_timed(ops.put_all))
        gets.append(_timed(ops.get_all))
    ops.check()
    exists = sorted(_timed(ops.exists64) for _ in range(workload.exists_calls))
    total = workload.total_bytes
    return {
        "put_gbps": total / statistics.median(puts) / 1e9,
        "get_gbps": total / statistics.median(gets) / 1e9,
        "exists64_p50_ms": statistics.median(exists) * 1e3,
        "exists64_p99_ms": exists[min(len(exists) - 1, int(0.99 * len(exists)))] * 1e3,
    }


def worker_main(run: Callable[[Workload, Path], Figures], argv: Sequence[str] | None = None) -> int:
    """Entry point of every worker: parse the workload, keep standard output for the one JSON
    object, run, print figures or ``{"unavailable": reason}``."""
    workload, workdir = parse_args(sys.argv[1:] if argv is None else argv)
    workdir.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        doc: dict[str, object] = dict(run(workload, workdir))
    except PeerFailure as e:
        doc = {"unavailable": str(e)}
    sys.stdout.flush()
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps(doc) + "\n")
    return 0
