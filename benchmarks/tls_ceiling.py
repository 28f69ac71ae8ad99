"""The native TLS ceiling of this machine: `benchmarks/native/tls_ceiling.c`, built with the C
compiler and OpenSSL headers when both are present, moves bytes over loopback as plain TCP and
as TLS 1.3 through OpenSSL, alternating, with no Python on the path. Its TLS/TCP ratio is the
most any user-space TLS transport reaches here, the yardstick for the TLS rows of bench service.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("native") / "tls_ceiling.c"


def measure(cert: Path, key: Path, nbytes: int = 1 << 30, rounds: int = 3) -> tuple[float, float] | str:
    """Median GB/s of (TLS, plain TCP) in the same run, or why it could not be measured."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler"
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "tls_ceiling"
        build = subprocess.run(
            [compiler, "-O2", str(SOURCE), "-o", str(binary), "-lssl", "-lcrypto", "-lpthread"],
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            return "could not build the C probe (OpenSSL headers missing?)"
        run = subprocess.run(
            [str(binary), str(cert), str(key), str(nbytes), str(rounds)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if run.returncode != 0:
        return f"the C probe failed: {run.stderr.strip().splitlines()[0] if run.stderr.strip() else run.returncode}"
    figures: dict[str, list[float]] = {"tcp": [], "tls": []}
    for line in run.stdout.splitlines():
        kind, _, value = line.partition(" ")
        figures[kind].append(float(value))
    return statistics.median(figures["tls"]), statistics.median(figures["tcp"])
