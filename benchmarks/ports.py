"""Ports on 127.0.0.1 for the processes tests and benchmarks start: one free now, and waiting
until something listens on one."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick; another process could take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, what: str, timeout_s: float) -> None:
    """Return once 127.0.0.1:``port`` accepts a connection; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s"
                ) from None
            time.sleep(0.05)
