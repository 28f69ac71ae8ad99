"""Rendezvous (highest-random-weight) hashing: which node of a list owns a key.

Each (node, key) pair gets a pseudo-random weight; the key belongs to the node with the highest.
Adding a node moves to it only the keys it now wins (about 1/N of them); removing one moves only
its own keys, each to its runner-up. Every client computes the same owner from the node list
alone: no coordination, no ring to keep. ``owners(key, k)`` gives the first k in order (a key's
fallbacks, or the replicas of a replicated placement).

Weights are xxh3-64 of the node's name and the key: fast (a 32-byte key costs ~50 ns), stable
across processes and versions (never Python's salted ``hash``).
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


class Rendezvous:
    def __init__(self, nodes: Sequence[str]) -> None:
        if not nodes:
            raise ValueError("rendezvous hashing needs at least one node")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node names must be distinct: {list(nodes)}")
        self.nodes = tuple(nodes)
        self._seeds = [xxhash.xxh3_64_intdigest(node.encode()) for node in self.nodes]

    def owner(self, key: bytes) -> int:
        """The index in ``nodes`` of the node that owns ``key``."""
        best, best_weight = 0, -1
        for i, seed in enumerate(self._seeds):
            weight = xxhash.xxh3_64_intdigest(key, seed=seed)
            if weight > best_weight:
                best, best_weight = i, weight
        return best

    def owners(self, key: bytes, k: int) -> list[int]:
        """The first ``k`` nodes for ``key``, best first."""
        weights = sorted(
            ((xxhash.xxh3_64_intdigest(key, seed=seed), i) for i, seed in enumerate(self._seeds)),
            reverse=True,
        )
        return [i for _, i in weights[:k]]
