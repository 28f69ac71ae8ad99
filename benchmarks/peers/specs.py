"""The peers: what each needs installed, where its environment lives, which worker measures it.

Versions are pinned to the ones these figures were taken with, so that a later run measures the
same software. Each peer gets its own virtual environment under ``<root>/<name>``, created with
the interpreter running kvstore, so that its dependencies (LMCache pins an older numpy and pulls
~100 packages) never touch kvstore's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WORKERS = Path(__file__).resolve().parent / "workers"
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / ".kvstore" / "peers"


@dataclass(frozen=True)
class PeerSpec:
    """How to install and measure one peer.

    ``apt`` packages are installed system-wide (root only); ``pip_steps`` run in order in the
    peer's own virtual environment (a step before the peer itself can pin what it would otherwise
    pull: LMCache takes any torch, and any torch but the CPU build here is several GB of CUDA).
    ``netns``: the worker runs under ``unshare -n`` in a network namespace of its own.
    """

    name: str
    apt: tuple[str, ...]
    pip_steps: tuple[tuple[str, ...], ...]
    worker: Path
    netns: bool = False

    def venv(self, root: Path) -> Path:
        return root / self.name

    def python(self, root: Path) -> Path:
        return self.venv(root) / "bin" / "python"


SPECS: dict[str, PeerSpec] = {
    spec.name: spec
    for spec in (
        PeerSpec(
            name="redis",
            apt=("redis-server",),
            pip_steps=(("redis[hiredis]==8.1.0",),),
            worker=WORKERS / "redis_worker.py",
        ),
        PeerSpec(
            name="mooncake",
            apt=("libibverbs1", "iproute2"),
            pip_steps=(("mooncake-transfer-engine-non-cuda==0.3.13.post1",),),
            worker=WORKERS / "mooncake_worker.py",
            netns=True,
        ),
        PeerSpec(
            name="lmcache",
            apt=(),
            pip_steps=(("torch==2.13.0",), ("lmcache==0.5.6",)),
            worker=WORKERS / "lmcache_worker.py",
        ),
    )
}
PEERS: tuple[str, ...] = tuple(SPECS)
