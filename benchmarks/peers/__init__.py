"""Peer KV stores measured on the same blocks as kvstore: Redis 7, Mooncake Store, LMCache's server.

Use::

    from benchmarks.peers import PEERS, Workload, measure_peer, PeerFigures

    for name in PEERS:
        outcome = measure_peer(name, Workload(blocks=128), workdir)
        if isinstance(outcome, PeerFigures): ...   # put_gbps, get_gbps, exists64_p50_ms, ...
        else: ...                                  # PeerUnavailable: outcome.reason

Contract:
- ``install_peer(name)`` installs what is missing (Debian packages when root, a venv per peer
  under ``.kvstore/peers/``) and returns ``Installed`` or ``PeerUnavailable``; when everything
  is there it answers in milliseconds. ``measure_peer(..., install=True)`` calls it first;
  without ``install`` nothing is installed: ``peer_missing(name)`` says what is missing and the
  peer is unavailable with that reason.
- ``measure_peer`` runs the peer's worker script with the peer's interpreter, in a process group
  of its own with a deadline; the worker starts the servers on 127.0.0.1 (Mooncake in a private
  network namespace), measures, stops them. When the call returns, nothing it started runs.
- A peer that cannot be installed, started or measured gives ``PeerUnavailable(reason)``, a
  sentence a person can act on; neither function raises for a peer's failure.
- Calls for different peers may run one after another in one process; running two at once
  makes them compete for the same cores and is not meant for figures.

Standalone: ``python -m benchmarks.peers [--quick] [--peer NAME]``.
"""

from benchmarks.peers.harness import default_timeout_s, measure_peer
from benchmarks.peers.install import install_peer, peer_missing
from benchmarks.peers.outcome import Installed, PeerFigures, PeerUnavailable, parse_worker_output
from benchmarks.peers.specs import PEERS
from benchmarks.peers.workers.peerlib import Workload

__all__ = [
    "PEERS",
    "Installed",
    "PeerFigures",
    "PeerUnavailable",
    "Workload",
    "default_timeout_s",
    "install_peer",
    "measure_peer",
    "parse_worker_output",
    "peer_missing",
]
