"""Installing a peer on demand: Debian packages system-wide, the rest in the peer's own venv.

``install_peer`` installs; ``peer_missing`` only says what is missing (what the benchmarks ask
unless told to install). ``install_peer`` is idempotent and fast when the peer is already there: a marker file in the venv
records what was installed, and the Debian packages are checked with one ``dpkg-query``. Two
processes installing the same peer at once take turns (a file lock beside the venv). Failures are
returned as ``PeerUnavailable`` with the command a person would run; nothing is raised.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers.outcome import Installed, PeerUnavailable
from benchmarks.peers.process import run_in_group
from benchmarks.peers.specs import DEFAULT_ROOT, SPECS, PeerSpec

APT_TIMEOUT_S = 600.0
PIP_TIMEOUT_S = 1200.0  # LMCache resolves and unpacks ~100 packages: 2-3 minutes here
VENV_TIMEOUT_S = 120.0
MARKER = ".kvstore-peer.json"


def install_peer(name: str, root: Path | None = None) -> Installed | PeerUnavailable:
    """Makes peer ``name`` ready to measure, installing what is missing."""
    spec = SPECS.get(name)
    if spec is None:
        return PeerUnavailable(name, f"unknown peer {name!r}; the peers are {', '.join(SPECS)}")
    return install_spec(spec, root or DEFAULT_ROOT)


def peer_missing(name: str, root: Path | None = None) -> list[str]:
    """What peer ``name`` lacks here, each as a person would install it; [] when it is ready.
    Installs and runs nothing (but ``dpkg-query``): ``measure_peer`` asks this unless told
    to install."""
    spec = SPECS.get(name)
    if spec is None:
        return [f"unknown peer {name!r}; the peers are {', '.join(SPECS)}"]
    root = root or DEFAULT_ROOT
    missing = []
    apt = _missing_apt(spec.apt)
    if apt is None:
        missing.append(f"the Debian packages {' '.join(spec.apt)} (and dpkg is absent here)")
    elif apt:
        missing.append(f"the Debian packages {' '.join(apt)} (apt-get install -y {' '.join(apt)}, as root)")
    if not _marker_matches(spec, root):
        steps = "; ".join(f"pip install {' '.join(step)}" for step in spec.pip_steps)
        missing.append(f"its venv {spec.venv(root)} ({steps})")
    return missing


def install_spec(spec: PeerSpec, root: Path, python: str = sys.executable) -> Installed | PeerUnavailable:
    """``install_peer`` for any spec; ``python`` creates the venv (kvstore's own by default)."""
    try:
        return _install(spec, root, python)
    except (OSError, subprocess.SubprocessError) as e:  # the one place these become a reason
        return PeerUnavailable(spec.name, f"cannot install {spec.name} under {root}: {e}")


def _install(spec: PeerSpec, root: Path, python: str) -> Installed | PeerUnavailable:
    start = time.monotonic()
    missing = _missing_apt(spec.apt)
    if missing is None:
        return PeerUnavailable(
            spec.name, f"{spec.name} needs the Debian packages {' '.join(spec.apt)}, and dpkg is absent here"
        )
    if not missing and _marker_matches(spec, root):
        return Installed(spec.name, spec.python(root), time.monotonic() - start, fresh=False)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it right now
        problem = _install_apt(spec, root)
        if problem is None and not _marker_matches(spec, root):
            problem = _install_venv(spec, root, python)
    if problem is not None:
        return PeerUnavailable(spec.name, problem)
    return Installed(spec.name, spec.python(root), time.monotonic() - start, fresh=True)


def _missing_apt(packages: tuple[str, ...]) -> list[str] | None:
    """The packages not installed; ``None`` when this system has no dpkg to ask."""
    if not packages:
        return []
    dpkg_query = shutil.which("dpkg-query")
    if dpkg_query is None:
        return None
    done = subprocess.run(
        [dpkg_query, "-W", "-f=${Package} ${db:Status-Status}\n", *packages],
        capture_output=True,
        text=True,
        timeout=30,
    )
    installed = {ln.split()[0] for ln in done.stdout.splitlines() if ln.endswith(" installed")}
    return [p for p in packages if p not in installed]


def _install_apt(spec: PeerSpec, root: Path) -> str | None:
    missing = _missing_apt(spec.apt)
    if not missing:
        return None
    command = f"apt-get install -y {' '.join(missing)}"
    if os.geteuid() != 0:
        return f"{spec.name} needs the Debian packages {' '.join(missing)}: run `sudo {command}`"
    log = root / f"{spec.name}-apt.log"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        done = run_in_group(argv, APT_TIMEOUT_S, log, env=env)
        if done.returncode != 0:
            verdict = "timed out" if done.timed_out else f"failed with status {done.returncode}"
            return f"`{' '.join(argv)}` {verdict} (log: {log}); run `{command}` by hand"
    return None


def _install_venv(spec: PeerSpec, root: Path, python: str) -> str | None:
    venv = spec.venv(root)
    log = root / f"{spec.name}-pip.log"
    if not spec.python(root).exists():
        done = run_in_group([python, "-m", "venv", str(venv)], VENV_TIMEOUT_S, log)
        if done.returncode != 0:
            return f"cannot create the {spec.name} venv at {venv} with {python} (log: {log})"
    for step in spec.pip_steps:
        argv = [str(spec.python(root)), "-m", "pip", "install", "--disable-pip-version-check", "-q", *step]
        done = run_in_group(argv, PIP_TIMEOUT_S, log)
        if done.returncode != 0:
            verdict = "timed out" if done.timed_out else f"failed with status {done.returncode}"
            return f"`pip install {' '.join(step)}` into {venv} {verdict}; see {log}"
    (venv / MARKER).write_text(json.dumps(_marker(spec)) + "\n")
    return None


def _marker(spec: PeerSpec) -> dict[str, object]:
    return {"peer": spec.name, "pip_steps": [list(step) for step in spec.pip_steps]}


def _marker_matches(spec: PeerSpec, root: Path) -> bool:
    try:
        doc = json.loads((spec.venv(root) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(doc == _marker(spec) and spec.python(root).exists())
