"""Running a command in a process group of its own, with a deadline, leaving nothing behind.

Everything the harness starts (installers, workers, and through the workers the peers' servers)
goes through ``run_in_group``: the command leads a new session, every process it starts stays in
that group, and the whole group is ended when the command exits or its time is up. A signal or
exception in the caller (Ctrl-C) ends the group too. Not protected against: the harness itself
being killed with SIGKILL, which leaves the group to run on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finished:
    """How a command ended: ``returncode`` (negative: killed by that signal), its standard output,
    and ``timed_out`` when the deadline ended it."""

    returncode: int
    stdout: str
    timed_out: bool
    seconds: float


def run_in_group(
    argv: Sequence[str],
    timeout_s: float,
    log_path: Path,
    env: dict[str, str] | None = None,
    grace_s: float = 5.0,
) -> Finished:
    """Runs ``argv`` to completion or for ``timeout_s`` seconds, whichever comes first.

    Standard output is returned (keep it small: the workers print one line); standard error is
    appended to ``log_path`` after a line naming the command. Raises ``OSError`` only when the command cannot be started at all.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    # Standard output goes to a file, not a pipe: a server the command leaves running would hold a
    # pipe open, and reading to its end would wait for the deadline.
    with tempfile.TemporaryFile() as out, open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=log, env=env, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            end_group(proc, grace_s)
        out.seek(0)
        stdout = out.read().decode(errors="replace")
    return Finished(proc.returncode, stdout, timed_out, time.monotonic() - start)


def end_group(leader: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to every process of the group ``leader`` leads, SIGKILL to those still there after
    ``grace_s``; then waits for the leader (the others are not our children)."""
    pgid = leader.pid
    if _signal_group(pgid, signal.SIGTERM):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            leader.poll()  # an exited leader left unreaped would still count as present
            if not _signal_group(pgid, 0):
                break
            time.sleep(0.05)
        else:
            _signal_group(pgid, signal.SIGKILL)
    leader.wait()


def _signal_group(pgid: int, sig: int) -> bool:
    """Whether the group still had a process to signal."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
