"""The block index: every block the store holds, by id, by namespace and by parent.

Calls (all with the store lock held; nothing here touches a tier):
    intern(scope)            the one Scope object the index uses for a scope
    visible(ident)           the block readers may see: present, not deleted, not past retention
    visible_many(scope, keys)  the same for a batch of keys of one scope, the clock read once
    admit(block)             a new block joins (its birth time and retention deadline set);
                             admit_many(blocks) several, the clock read once
    remove(block)            it leaves (its copies are already gone)
    depth_after(scope, key)  the chain depth of a child of ``key``
    children(ident)          keys of its children in the index
    usage by fingerprint / by tier, and per-namespace bytes

Chains: a parent remembers its children even while it is absent itself, so a parent stored
after its child still knows it has one (eviction never lets a child outlive its parent in a
faster tier). Retained namespaces keep their blocks in birth order for the retention sweep.
"""

from __future__ import annotations

import collections
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from kvstore.keys import BlockKey, Fingerprint
from kvstore.store.model import MARK_FINGERPRINT, Block, BlockId, Scope


class BlockIndex:
    """See the module docstring. Not thread-safe: the store calls it under its lock."""

    def __init__(self, wall_clock: Callable[[], float], retention_of: Callable[[str], float | None]) -> None:
        self._wall = wall_clock
        self._retention_of = retention_of
        self.blocks: dict[BlockId, Block] = {}
        self.by_namespace: dict[str, dict[BlockId, Block]] = {}
        self.namespace_bytes: Counter[str] = Counter()
        self.by_age: dict[str, collections.deque[BlockId]] = {}  # retained namespaces, oldest first
        self._children: dict[BlockId, set[BlockKey]] = {}
        self._scopes: dict[Scope, Scope] = {}
        # The same entries by scope, then key: a batch's probes hash only its keys (bytes cache
        # their hash), not a (scope, key) tuple each, whose hash called Scope's in Python.
        self._by_scope: dict[Scope, dict[BlockKey, Block]] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def intern(self, scope: Scope) -> Scope:
        """Index probes then compare scopes by identity instead of the dataclass __eq__."""
        return self._scopes.setdefault(scope, scope)

    def scopes(self) -> list[Scope]:
        """Every scope seen here: held, or asked about (the fleet's invalidation marks to read)."""
        return list(self._scopes.keys() | self._by_scope.keys())  # rebuilt blocks are not interned

    def get(self, ident: BlockId) -> Block | None:
        """The entry under ``ident``, visible or not."""
        return self.blocks.get(ident)

    def visible(self, ident: BlockId) -> Block | None:
        block = self.blocks.get(ident)
        if block is None or block.doomed:
            return None
        if block.expires_at_s != math.inf and block.expires_at_s <= self._wall():
            return None  # past its retention: gone for readers now, for the tiers at the sweep
        return block

    def visible_many(
        self, scope: Scope, keys: Sequence[BlockKey], prefix: bool = False
    ) -> list[Block | None]:
        """``visible((scope, key))`` for each key, in order; one loop for a whole restore
        (``scope`` interned). Retention is judged against one reading of the wall clock.
        ``prefix``: stop before the first miss (a lookup's answer: only blocks, no None)."""
        get = self._by_scope.get(scope, {}).get
        now: float | None = None  # read at the first block with a deadline: most have none
        out: list[Block | None] = []
        for key in keys:
            block = get(key)
            if block is not None:
                if block.doomed:
                    block = None
                elif block.expires_at_s != math.inf:
                    if now is None:
                        now = self._wall()
                    if block.expires_at_s <= now:
                        block = None
            if block is None and prefix:
                break
            out.append(block)
        return out

    def prefix(self, scope: Scope, keys: Sequence[BlockKey]) -> list[Block]:
        """The visible blocks of ``keys`` up to the first that is not (``scope`` interned)."""
        return cast(list[Block], self.visible_many(scope, keys, prefix=True))

    def is_current(self, block: Block) -> bool:
        """Whether ``block`` is still the live entry under its id (not replaced, not deleted)."""
        return self.blocks.get(block.ident) is block and not block.doomed

    def pool(self, namespace: str | None) -> Iterable[Block]:
        """Every entry of one namespace, or of all."""
        return self.blocks.values() if namespace is None else self.by_namespace.get(namespace, {}).values()

    def depth_after(self, scope: Scope, parent: BlockKey | None) -> int:
        if parent is None:
            return 0
        block = self.blocks.get((scope, parent))
        return 0 if block is None else block.depth + 1

    def children(self, ident: BlockId) -> set[BlockKey]:
        return self._children.get(ident, set())

    def parent_of(self, block: Block) -> Block | None:
        return None if block.parent is None else self.blocks.get((block.scope, block.parent))

    def admit(self, block: Block) -> None:
        self.admit_many((block,))

    def admit_many(self, blocks: Sequence[Block]) -> None:
        """``admit`` of each new block, the clock read once (a commit admits a chunk of them)."""
        now = self._wall()
        children = self._children
        index = self.blocks
        last_ns: str | None = None  # a commit's blocks share one namespace: looked up once
        retention: float | None = None
        in_namespace: dict[BlockId, Block] = {}
        last_scope: Scope | None = None
        in_scope: dict[BlockKey, Block] = {}
        for block in blocks:
            scope = block.scope
            ns = scope.namespace
            ident = (scope, block.key)
            if scope is not last_scope:
                last_scope, in_scope = scope, self._by_scope.setdefault(scope, {})
            if not block.stored_at_s:
                block.stored_at_s = now
            if ns is not last_ns:
                last_ns, retention = ns, self._retention_of(ns)
                in_namespace = self.by_namespace.setdefault(ns, {})
            if retention is not None and scope.fingerprint != MARK_FINGERPRINT:  # marks outlive it
                block.expires_at_s = block.stored_at_s + retention
                self._by_age_add(self.by_age.setdefault(ns, collections.deque()), block)
            index[ident] = block
            in_namespace[ident] = block
            in_scope[block.key] = block
            self.namespace_bytes[ns] += block.size_bytes
            if block.parent is not None:
                siblings = children.get((scope, block.parent))
                if siblings is None:
                    siblings = children[scope, block.parent] = set()
                siblings.add(block.key)

    def remove(self, block: Block) -> None:
        ident = block.ident
        if self.blocks.get(ident) is not block:
            return
        del self.blocks[ident]
        in_scope = self._by_scope[block.scope]
        del in_scope[block.key]
        if not in_scope:
            del self._by_scope[block.scope]
        ns = block.scope.namespace
        del self.by_namespace[ns][ident]
        self.namespace_bytes[ns] -= block.size_bytes
        if not self.namespace_bytes[ns]:
            del self.namespace_bytes[ns]
        if block.parent is not None:
            siblings = self._children.get((block.scope, block.parent))
            if siblings is not None:
                siblings.discard(block.key)
                if not siblings:
                    del self._children[(block.scope, block.parent)]

    def _by_age_add(self, queue: collections.deque[BlockId], block: Block) -> None:
        """Queue ``block`` for the retention sweep in deadline order: at the end, unless it was
        born before the blocks there (read through from the remote tier with its birth time),
        then after the last one due no later. An entry gone from the index stops the walk (its
        deadline is unknown), so a put after many deletes still appends in O(1)."""
        i = len(queue)
        while i:
            there = self.blocks.get(queue[i - 1])
            if there is None or there.expires_at_s <= block.expires_at_s:
                break
            i -= 1
        if i == len(queue):
            queue.append(block.ident)
        else:
            queue.insert(i, block.ident)

    def order_by_age(self) -> None:
        """After a rebuild from disk (disk order is no age order)."""
        for queue in self.by_age.values():
            ordered = sorted(queue, key=lambda ident: self.blocks[ident].expires_at_s)
            queue.clear()
            queue.extend(ordered)

    def live_count(self) -> int:
        return sum(1 for b in self.blocks.values() if not b.doomed)

    def fingerprint_usage(self, namespace: str | None) -> dict[Fingerprint, tuple[int, int]]:
        usage: dict[Fingerprint, list[int]] = {}
        for b in self.pool(namespace):
            if not b.doomed:
                entry = usage.setdefault(b.scope.fingerprint, [0, 0])
                entry[0] += 1
                entry[1] += b.size_bytes
        return {fp: (n, nbytes) for fp, (n, nbytes) in usage.items()}

    def tier_usage(self, namespace: str, names: list[str]) -> dict[str, tuple[int, int]]:
        usage = {name: [0, 0] for name in names}
        for b in self.pool(namespace):
            if not b.doomed:
                for t in b.tiers:
                    entry = usage[names[t]]
                    entry[0] += 1
                    entry[1] += b.size_bytes
        return {name: (n, nbytes) for name, (n, nbytes) in usage.items()}
