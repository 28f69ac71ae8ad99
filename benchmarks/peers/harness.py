"""Measuring one peer: install it if told to, run its worker with its interpreter, read the figures.

The worker starts the peer's servers on 127.0.0.1 (Mooncake: inside a network namespace of its
own), measures, stops them, and prints one JSON object; see ``workers/peerlib.py``. The worker
runs in a process group of its own that is ended whatever happens, so no server outlives a call.
Logs go to ``<workdir>/<peer>/``: the worker's standard error in ``worker.log``, each server's
output in ``<server>.log``. Without a ``workdir``, a temporary folder holds them, removed after a
measurement and kept (and named in the reason) after a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.peers.install import install_peer, peer_missing
from benchmarks.peers.outcome import PeerFigures, PeerUnavailable, parse_worker_output
from benchmarks.peers.process import run_in_group
from benchmarks.peers.specs import DEFAULT_ROOT, SPECS
from benchmarks.peers.workers.peerlib import Workload


def default_timeout_s(workload: Workload) -> float:
    """Generous: start-up, plus every byte moved at 0.1 GB/s, plus 50 ms per existence check."""
    moved_bytes = workload.total_bytes * 2 * (workload.rounds + 1)
    return 120.0 + moved_bytes / 0.1e9 + workload.exists_calls * 0.05


def measure_peer(
    name: str,
    workload: Workload,
    workdir: Path | None = None,
    root: Path | None = None,
    timeout_s: float | None = None,
    install: bool = False,
) -> PeerFigures | PeerUnavailable:
    """Measures peer ``name`` on ``workload``; never raises for a peer's failure, and returns
    within about ``timeout_s`` (default ``default_timeout_s``) plus the time an install takes.
    ``install``: install what is missing first (``install_peer``: apt-get as root, pip into the
    peer's venv); without it a peer not installed is unavailable, its reason saying what is
    missing. ``root`` holds the peers' venvs (default ``.kvstore/peers``)."""
    if install:
        installed = install_peer(name, root)
        if isinstance(installed, PeerUnavailable):
            return installed
        python = installed.python
    else:
        missing = peer_missing(name, root)
        if missing:
            return PeerUnavailable(name, f"{name} is not installed here: it needs {'; '.join(missing)}")
        python = SPECS[name].python(root or DEFAULT_ROOT)
    try:
        if workdir is not None:
            return _measure(name, python, workload, workdir, timeout_s)
        scratch = Path(tempfile.mkdtemp(prefix=f"kvstore-peer-{name}-"))
        outcome = _measure(name, python, workload, scratch, timeout_s)
    except OSError as e:  # the one place this becomes a reason: no folder, no such program
        return PeerUnavailable(name, f"cannot run the {name} worker: {e}")
    if isinstance(outcome, PeerFigures):
        shutil.rmtree(scratch, ignore_errors=True)
    return outcome


def _measure(
    name: str, python: Path, workload: Workload, workdir: Path, timeout_s: float | None
) -> PeerFigures | PeerUnavailable:
    spec = SPECS[name]
    logs = workdir / name
    logs.mkdir(parents=True, exist_ok=True)
    argv = [str(python), str(spec.worker), *workload.argv(), f"--workdir={logs}"]
    if spec.netns:
        unshare = shutil.which("unshare")
        if unshare is None:
            return PeerUnavailable(name, f"{name} runs in its own network namespace: install util-linux")
        # Without root, a user namespace grants the right to make the network namespace.
        argv = [unshare, "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), "--", *argv]
    log = logs / "worker.log"
    limit_s = default_timeout_s(workload) if timeout_s is None else timeout_s
    done = run_in_group(argv, limit_s, log)
    if done.timed_out:
        return PeerUnavailable(
            name, f"the {name} worker did not finish within {limit_s:.0f} s and was stopped; see {log}"
        )
    return parse_worker_output(name, done.stdout, done.returncode, log)
