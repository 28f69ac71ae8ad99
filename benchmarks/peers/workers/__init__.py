"""Peer benchmark workers: scripts, one per peer, run by the harness with the peer's own interpreter.

They are not imported by the harness. Each runs as ``python <peer>_worker.py <workload flags>`` in
the peer's virtual environment (and, for Mooncake, inside a private network namespace), so they
use only the standard library, the peer's client package and ``peerlib`` beside them (found on
``sys.path[0]``, the script's folder). Each starts its peer's servers, measures, stops them, and
prints one JSON object on its standard output (see ``peerlib.emit``).
"""
