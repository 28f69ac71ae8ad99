"""Salvage: a dead server's arena blocks copied into the persistent tier under the store's own
eviction rules, before the next server on the same data folder serves.

A server killed with SIGKILL (or the OOM killer) leaves its arena in ``/dev/shm``, and the
arena's journal names the slots that held acknowledged blocks (``tiers.dram.salvage``). The
next start copies them into `nvme` the way a clean stop's spill does (``Placement.copy_down``):
over an index rebuilt from `nvme`, parents first, each copy waiting for the write queue, room
made by evicting `nvme`'s coldest blocks (GDSF, never a parent whose child stays). A full `nvme`,
a cache's steady state, so makes room for the salvaged blocks as it does for the spill on close;
a salvaged block counts as freshly stored (it was, moments before the kill). A slot whose
bytes no longer match the checksum its block was committed with (the journal's record: a
process that mapped the arena wrote there since, or the memory was damaged) is dropped and
counted (``changed``), never copied. A block committed without one (written in place by a
same-host client: ``tiers.slab``) is copied as it is.

    s = Salvage(tier, config)                   the tier indexed, once per start
    s.into(blocks) -> Salvaged                  per dead arena; the builder removes the arena only
                                                when ``Salvaged.complete``
    s.held() -> [Block]                         what the tier holds after: the store takes it over
                                                (``TieredStore(indexed=...)``) rather than scan
                                                the tier a second time
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvstore.store.model import Block, StoreConfig, new_block, parse_meta, parse_tier_key
from kvstore.store.parts import StoreParts, wire
from kvstore.store.rebuild import index_tier
from tiers import Tier, TierKey
from tiers.journal import JournalRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Salvaged:
    blocks: int  # acknowledged blocks the arena's journal names
    copied: int  # copied into the tier
    present: int  # the tier held them already
    unnamed: int  # records whose key the store cannot parse: never findable, dropped
    changed: int  # slots whose bytes fail the checksum their block was committed with: dropped
    refused: int  # the tier failed to take them (an error, not the eviction rules)
    evicted: int  # the tier's blocks evicted to make room, salvaged ones included

    @property
    def complete(self) -> bool:
        """Every block is decided (copied, there already, or left out by the eviction rules, as
        the spill on close leaves them): the arena may go. Otherwise it holds blocks that are
        nowhere else, and must be kept for the next start to try again."""
        return self.refused == 0


class Salvage:
    """Salvages into ``tier`` over one index of it, built here; see the module docstring."""

    def __init__(self, tier: Tier, config: StoreConfig) -> None:
        self._tier, self._config = tier, config
        self._p = p = wire([tier], config, time.monotonic, time.time)
        index_tier(0, tier, config, p.index, p.eviction)
        p.index.order_by_age()
        self.trusted = True  # the index says what the tier holds

    def held(self) -> list[Block]:
        """The blocks the tier holds, as this index knows them (while ``trusted``)."""
        return [b for b in self._p.index.blocks.values() if b.tiers and not b.doomed]

    def into(self, blocks: Sequence[tuple[JournalRecord, memoryview]]) -> Salvaged:
        """Copy ``blocks`` (journal records with views of their arena bytes) into the tier and
        flush it; TierError from the flush propagates (nothing is known to be on the medium)."""
        refused_before = self._p.counts[f"{self._tier.name}_refused_blocks"]
        self.trusted = False  # until the flush: a failed one leaves the tier's contents unknown
        result = _salvage_into(self._tier, blocks, self._config, self._p)
        self.trusted = True
        return dataclasses.replace(result, refused=result.refused - refused_before)


def _salvage_into(
    tier: Tier, blocks: Sequence[tuple[JournalRecord, memoryview]], config: StoreConfig, p: StoreParts
) -> Salvaged:
    fresh: dict[TierKey, tuple[Block, memoryview]] = {}
    present: dict[TierKey, Block] = {}
    unnamed = changed = 0
    for record, view in blocks:
        ident = parse_tier_key(record.key)
        if ident is None or ident[0].fingerprint != record.fingerprint:
            unnamed += 1
            continue
        if record.checksum is not None and xxhash.xxh3_64_intdigest(view) != record.checksum:
            if not changed:  # one line for them all: the count goes in the builder's summary
                log.warning("salvage: block %s changed since its commit; dropped", record.key.hex())
            changed += 1
            continue
        tkey = TierKey(record.key)
        there = p.index.get(ident)
        if there is not None:
            present[tkey] = there
            continue
        if tkey in fresh:
            continue  # a key twice: a retired slot, and its block stored again since
        depth, parent, stored_at_s = parse_meta(record.meta)
        block = new_block(config, ident[0], ident[1], record.size_bytes, parent, depth, tkey, stored_at_s)
        p.index.admit(block)
        fresh[tkey] = (block, view)
    # What the arena held is the hot set, hotter than what only the tier holds: its blocks the
    # tier has already rank above those (touched, oldest first), the salvaged ones above all.
    p.eviction.touch_many(sorted(present.values(), key=lambda b: b.stored_at_s))
    evicted_before = p.counts[f"evicted_{tier.name}_blocks"]
    # Held while they are copied: room for one is made from the tier's older blocks, never by
    # evicting another salvaged one (parents go first, and a parent whose child is not copied
    # yet would be the coldest block there).
    salvaged = [b for b, _ in fresh.values()]
    p.pins.hold_many(salvaged)
    try:
        copied = p.placement.copy_down(salvaged, 0, lambda b: fresh[b.tkey][1], fresh=True)
    finally:
        p.pins.unhold_many(salvaged)
    for block in salvaged:  # not copied: out of the index, which says what the tier holds
        if not block.tiers:
            p.index.remove(block)
    tier.flush()
    return Salvaged(
        blocks=len(blocks),
        copied=copied,
        present=len(present),
        unnamed=unnamed,
        changed=changed,
        refused=p.counts[f"{tier.name}_refused_blocks"],
        evicted=p.counts[f"evicted_{tier.name}_blocks"] - evicted_before,
    )
