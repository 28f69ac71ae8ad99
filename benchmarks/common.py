"""What every ``kvstore bench`` command shares: the result shape, machine facts, timing, output.

JSON shape (the same for every bench command):
    {"machine": {...}, "results": [{"metric", "value", "unit", "reference", "reference_value",
                                    "ratio", "target", "target_op", "target_ratio",
                                    "meets_target", "note"}]}
``ratio`` is value / reference_value, both measured in the same run; ``target`` is the ratio the
brief holds us to (``">= 0.8"``) or null where none applies, also as ``target_op`` (``">="``)
and the number ``target_ratio`` (0.8), with ``meets_target`` (true, false, or null without
both a target and a ratio); ``note`` says how a figure was taken
or why it is missing.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Result:
    metric: str
    value: float | None
    unit: str
    reference: str | None = None
    reference_value: float | None = None
    target: str | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.reference_value:
            return None
        return self.value / self.reference_value

    @property
    def meets_target(self) -> bool | None:
        if self.target is None or self.ratio is None:
            return None
        op, _, bound = self.target.partition(" ")
        compare = {">=": float.__ge__, "<=": float.__le__, ">": float.__gt__, "<": float.__lt__}[op]
        return bool(compare(float(self.ratio), float(bound)))

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out["ratio"] = self.ratio
        op, _, bound = (self.target or "").partition(" ")
        out["target_op"], out["target_ratio"] = (op, float(bound)) if self.target else (None, None)
        out["meets_target"] = self.meets_target
        return out


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes a second)."""
    return nbytes / seconds / 1e9


def size_label(size_bytes: int) -> str:
    """``256 KiB``, ``2 MiB``: a block size as the rows name it."""
    return f"{size_bytes >> 20} MiB" if size_bytes >= 1 << 20 else f"{size_bytes >> 10} KiB"


def machine_info() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for pkg in ("kvstore", "torch", "numpy", "lmdb", "grpcio", "zstandard", "xxhash"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "packages": versions,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def plot_title(what: str, model: str, conditions: str, machine: dict[str, object] | None = None) -> str:
    """A plot's title: what it shows, the model, the machine, and what was emulated."""
    m = machine or machine_info()
    gpu = m.get("cuda") or "no GPU"
    return f"{what}\nmodel: {model}; {m['cpu']} ({m['cores']} cores, {gpu}); {conditions}"


def interleaved(
    subject: Callable[[], float], reference: Callable[[], float], rounds: int
) -> tuple[float, float]:
    """Median of each, measured alternately so that machine noise hits both alike."""
    a, b = [], []
    for _ in range(rounds):
        b.append(reference())
        a.append(subject())
    return statistics.median(a), statistics.median(b)


def print_results(title: str, results: Sequence[Result], console: Console | None = None) -> None:
    table = Table(title=title)
    # CI logs and a 100-column terminal: long cells wrap inside their column
    console = console or Console(width=min(100, shutil.get_terminal_size((100, 24)).columns))
    for col in ("metric", "value", "reference", "ratio", "target", "verdict, note"):
        table.add_column(col, justify="right" if col in ("value", "ratio") else "left")
    for r in results:
        value = "—" if r.value is None else f"{r.value:,.2f} {r.unit}"
        ref = (
            ""
            if r.reference is None
            else f"{r.reference}"
            + ("" if r.reference_value is None else f" {r.reference_value:,.2f} {r.unit}")
        )
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        verdict = {True: "[green]meets[/]", False: "[red]misses[/]", None: ""}[r.meets_target]
        table.add_row(r.metric, value, ref, ratio, r.target or "", verdict + (f" {r.note}" if r.note else ""))
    console.print(table)


def write_json(path: str | Path, results: Sequence[Result], extra: dict[str, object] | None = None) -> None:
    doc: dict[str, object] = {"machine": machine_info(), "results": [r.as_json() for r in results]}
    if extra:
        doc.update(extra)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
