"""Cache-aware routing for a fleet of engines, each with its kvstore sidecar.

policies.py   round robin, consistent hashing, bounded-load rendezvous, and kvstore's own
              cost-aware policy (the connector's cost model over what each replica holds)
router.py     the prefix key of a prompt, the sidecars' answers, loads and figures
"""

from kvstore.routing.policies import (
    BoundedRendezvous,
    Choice,
    ConsistentHash,
    CostAware,
    RoundRobin,
    RouteRequest,
)
from kvstore.routing.router import Routed, Router, RouterStats, SidecarProbe

__all__ = [
    "BoundedRendezvous",
    "Choice",
    "ConsistentHash",
    "CostAware",
    "RoundRobin",
    "RouteRequest",
    "Routed",
    "Router",
    "RouterStats",
    "SidecarProbe",
]
