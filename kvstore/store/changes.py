"""What the store tells a listener about the copies it holds (``TieredStore.listen``).

Calls, each made with the store lock held, in the order the changes happen:
    stored(blocks, tier)    tier ``tier`` (an index into ``TieredStore.tiers``) now holds a copy
                            of each block; a commit's chain comes as one call, parents first
    removed(blocks, tier)   the copy in ``tier`` is gone (evicted, demoted, dropped, freed)
    cleared()               every block was invalidated: forget the earlier changes

Because they run under the store lock, a listener must not block, take other locks that wait on
I/O, or raise: it copies what it needs (keys, parents and scopes never change on a block) into a
bounded queue of its own and returns. The store's blocks are live objects: a listener keeps none
of them past the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.store.model import Block


class BlockChanges(Protocol):
    def stored(self, blocks: Sequence[Block], tier: int) -> None: ...

    def removed(self, blocks: Sequence[Block], tier: int) -> None: ...

    def cleared(self) -> None: ...
