"""Cache-aware routing for a fleet of engines, each with its kvstore sidecar.

policies.py   round robin, consistent hashing, bounded-load rendezvous, and kvstore's own
              cost-aware policy (the connector's cost model over what each replica holds)
router.py     the prefix key of a prompt, the sidecars' answers, loads and figures
http.py       the OpenAI-compatible front door on aiohttp (``kvstore route``), with
callers.py    API keys to tenants, each tenant's cache salt, who may read /metrics and /health,
bodies.py     request bodies checked before anything reads them, and
replicas.py   which replicas answer (ejected on failure, back when their /health answers)
events.py     the sidecars' KV event feeds followed instead of asking them each prompt
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
