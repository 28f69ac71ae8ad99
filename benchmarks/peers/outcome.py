"""What measuring or installing a peer gives back, and how a worker's output becomes one of them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.workers.peerlib import FIGURE_KEYS

_NUMBERS = FIGURE_KEYS[:4]
_TEXTS = FIGURE_KEYS[4:]


@dataclass(frozen=True)
class PeerFigures:
    """One peer measured on the workload: throughputs in GB/s (1e9 bytes per second), latency of
    one existence check of 64 keys in milliseconds, the client used and how it was driven."""

    peer: str
    put_gbps: float
    get_gbps: float
    exists64_p50_ms: float
    exists64_p99_ms: float
    client: str
    notes: str


@dataclass(frozen=True)
class PeerUnavailable:
    """The peer could not be installed, started or measured; ``reason`` says what to do about it."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Installed:
    """The peer is ready: its interpreter, and how long this call took (``fresh`` if it installed)."""

    peer: str
    python: Path
    seconds: float
    fresh: bool


def parse_worker_output(
    peer: str, stdout: str, returncode: int, log_path: Path | None = None
) -> PeerFigures | PeerUnavailable:
    """The figures of the last JSON object line a worker printed, or why there are none.

    A worker prints ``{"unavailable": reason}`` when it knows what went wrong; anything else
    without figures (a crash, a malformed line) names the exit status and the worker's log.
    """
    doc = _last_json_object(stdout)
    where = f"; see {log_path}" if log_path is not None else ""
    if doc is None:
        last = _last_line(log_path)
        return PeerUnavailable(
            peer,
            f"the {peer} worker exited with status {returncode} without printing figures"
            + (f" ({last})" if last else "")
            + where,
        )
    reason = doc.get("unavailable")
    if isinstance(reason, str):
        return PeerUnavailable(peer, reason)
    problems = [k for k in _NUMBERS if not _is_figure(doc.get(k))]
    problems += [k for k in _TEXTS if not isinstance(doc.get(k), str)]
    if problems:
        return PeerUnavailable(
            peer, f"the {peer} worker printed figures with missing or invalid {', '.join(problems)}{where}"
        )
    numbers = {k: float(doc[k]) for k in _NUMBERS}  # type: ignore[arg-type]
    return PeerFigures(
        peer=peer,
        put_gbps=numbers["put_gbps"],
        get_gbps=numbers["get_gbps"],
        exists64_p50_ms=numbers["exists64_p50_ms"],
        exists64_p99_ms=numbers["exists64_p99_ms"],
        client=str(doc["client"]),
        notes=str(doc["notes"]),
    )


def _last_json_object(text: str) -> dict[str, object] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


def _last_line(log_path: Path | None) -> str:
    """The last line of the worker's log: for a crash, the exception."""
    if log_path is None:
        return ""
    try:
        lines = log_path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def _is_figure(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
