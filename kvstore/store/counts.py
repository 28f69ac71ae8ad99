"""The store's counters: each one all told (``stats().counters``) and per namespace.

``Counts`` is a ``Counter`` of the totals, so rooms that count only totals (placement,
governance) take it as one; ``count(scope, name)`` adds to both. Edited under the store lock.
"""

from __future__ import annotations

from collections import Counter

from kvstore.store.model import Scope


class Counts(Counter[str]):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.by_namespace: dict[str, Counter[str]] = {}

    def count(self, scope: Scope, name: str, n: int = 1) -> None:
        self[name] += n
        counters = self.by_namespace.get(scope.namespace)
        if counters is None:  # (not setdefault: that made a Counter on every call)
            counters = self.by_namespace[scope.namespace] = Counter()
        counters[name] += n
