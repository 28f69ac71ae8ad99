"""Remote tiers that speak kvstore's own protocol (the contract is ``tiers/remote.py``; backends
that need nothing of kvstore, such as Redis Cluster, live in ``tiers/``).

    rendezvous.py   which node of a list owns a key
    nodes.py        other kvstore servers, in the shared role, as a sidecar's remote tier
"""
