"""A hypothesis state machine drives the tiered store against a plain dict model.

The store may forget blocks (it is a cache), but it must never: return bytes other than those
put under a key, serve a block that was deleted or invalidated, lose a pinned block, strand a
child by evicting its parent, strand a block where eviction can no longer find it, exceed a
tier's capacity or a tenant's quota.
"""

from __future__ import annotations

import contextlib
import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.errors import QuotaExceeded, StoreFull
from kvstore.keys import BlockKey, Fingerprint, block_keys
from kvstore.store import Scope, StoreConfig, TieredStore
from tiers.dram import DramConfig, DramTier
from tiers.hbm import HbmConfig, HbmTier

PAGE = 4096
FP = Fingerprint(b"\x07" * 32)
NAMESPACES = ["a", "b"]
QUOTA_A = 4 * PAGE
CHAINS = {c: block_keys(FP, list(range(c * 100, c * 100 + 16)), 4) for c in range(3)}  # 3 chains x 4 blocks

Ident = tuple[str, BlockKey]


def payload(ns: str, key: BlockKey) -> bytes:
    seed = hashlib.sha256(ns.encode() + key).digest()
    return (seed * (PAGE // 32))[:PAGE]


class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class StoreMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.clock = FakeClock()
        fast = HbmTier(HbmConfig(capacity_bytes=3 * PAGE, page_bytes=PAGE, device="cpu"))
        slow = DramTier(DramConfig(capacity_bytes=4 * PAGE, page_bytes=PAGE, prefault=False))
        self.store = TieredStore([fast, slow], StoreConfig(quota_bytes={"a": QUOTA_A}), clock=self.clock)
        self.model: dict[Ident, bytes] = {}  # what may be served: put and not removed since
        self.leases: dict[int, tuple[float, set[Ident]]] = {}
        self.removed_now: set[Ident] = set()
        self.before: set[Ident] = set()

    def teardown(self) -> None:
        self.store.close()

    def present(self) -> set[Ident]:
        return {(s.namespace, k) for s, k, _ in self.store.blocks()}

    def step(self) -> None:
        self.before = self.present()
        self.removed_now = set()

    # ------------------------------------------------------------------ rules

    @rule(
        ns=st.sampled_from(NAMESPACES),
        c=st.sampled_from(sorted(CHAINS)),
        start=st.integers(0, 3),
        n=st.integers(1, 4),
    )
    def put(self, ns: str, c: int, start: int, n: int) -> None:
        self.step()
        keys = CHAINS[c][start : start + n]
        parent = CHAINS[c][start - 1] if start else None
        with contextlib.suppress(StoreFull, QuotaExceeded):
            self.store.put(Scope(ns, FP), keys, [payload(ns, k) for k in keys], parent=parent)
        for k in keys:
            self.model[(ns, k)] = payload(ns, k)

    @rule(ns=st.sampled_from(NAMESPACES), c=st.sampled_from(sorted(CHAINS)), i=st.integers(0, 3))
    def get(self, ns: str, c: int, i: int) -> None:
        self.step()
        key = CHAINS[c][i]
        (got,) = self.store.get(Scope(ns, FP), [key])
        if got is not None:
            assert (ns, key) in self.model, "served a block that was never put or was removed"
            assert got == self.model[(ns, key)], "served the wrong bytes"

    @rule(ns=st.sampled_from(NAMESPACES), c=st.sampled_from(sorted(CHAINS)))
    def restore(self, ns: str, c: int) -> None:
        """A whole chain in one call, as a connector restores (hits raise priorities lazily)."""
        self.step()
        buffers = [bytearray(PAGE) for _ in CHAINS[c]]
        sizes = self.store.get_into_many(Scope(ns, FP), CHAINS[c], [memoryview(b) for b in buffers])
        for key, n, buf in zip(CHAINS[c], sizes, buffers, strict=True):
            if n is not None:
                assert bytes(buf[:n]) == self.model.get((ns, key)), "restored the wrong bytes"

    @rule(ns=st.sampled_from(NAMESPACES), c=st.sampled_from(sorted(CHAINS)))
    def lookup(self, ns: str, c: int) -> None:
        self.step()
        result = self.store.lookup(Scope(ns, FP), CHAINS[c])
        for k in CHAINS[c][: result.hit_blocks]:
            assert (ns, k) in self.model

    @rule(ns=st.sampled_from(NAMESPACES), c=st.sampled_from(sorted(CHAINS)), i=st.integers(0, 3))
    def delete(self, ns: str, c: int, i: int) -> None:
        self.step()
        key = CHAINS[c][i]
        self.store.delete(Scope(ns, FP), [key])
        self.model.pop((ns, key), None)
        self.removed_now.add((ns, key))
        self.unpin_removed()

    def unpin_removed(self) -> None:
        """A removed block is no longer expected to stay, even while a lease names it."""
        for _, held in self.leases.values():
            held -= self.removed_now

    @rule(ns=st.one_of(st.none(), st.sampled_from(NAMESPACES)))
    def invalidate(self, ns: str | None) -> None:
        self.step()
        self.store.invalidate(namespace=ns)
        gone = {ident for ident in self.model if ns is None or ident[0] == ns}
        for ident in gone:
            del self.model[ident]
        self.removed_now |= gone | {i for i in self.before if ns is None or i[0] == ns}
        self.unpin_removed()

    @rule(ns=st.one_of(st.none(), st.sampled_from(NAMESPACES)))
    def demote(self, ns: str | None) -> None:
        """Moving blocks down loses none of them, and moves no parent below a child of its own
        that stays in the fast tier. (A hit can promote a child alone; that is not demote's.)"""
        self.step()
        tiers_before = {(s.namespace, k): t for s, k, t in self.store.blocks()}
        self.store.demote("hbm", namespace=ns)
        assert self.present() == self.before
        tiers_after = {(s.namespace, k): t for s, k, t in self.store.blocks()}
        for (namespace, key), tier in tiers_after.items():
            for keys in CHAINS.values():
                if key in keys and keys.index(key) > 0 and tier == "hbm":
                    parent = (namespace, keys[keys.index(key) - 1])
                    if tiers_before.get(parent) == "hbm":
                        assert tiers_after.get(parent) == "hbm", "demote moved a parent below its child"

    @rule(ns=st.sampled_from(NAMESPACES), c=st.sampled_from(sorted(CHAINS)), ttl=st.sampled_from([1.0, 5.0]))
    def pin(self, ns: str, c: int, ttl: float) -> None:
        self.step()
        lease = self.store.pin(Scope(ns, FP), CHAINS[c], ttl_s=ttl)
        held = {(ns, k) for k in CHAINS[c] if (ns, k) in self.before}
        assert lease.blocks == len(held)
        self.leases[lease.lease_id] = (self.clock.now + ttl, held)

    @rule(ns=st.sampled_from(NAMESPACES), c=st.sampled_from(sorted(CHAINS)))
    def resolve(self, ns: str, c: int) -> None:
        """Same host: pin the present prefix in the arena (promoting what only hbm holds) and
        read it in place, as the connector does; the lease is released by the release rule."""
        self.step()
        resolved = self.store.resolve(Scope(ns, FP), CHAINS[c], ttl_s=5.0)
        arena = self.store.arena
        assert arena is not None
        for key, slot in zip(CHAINS[c], resolved.slots, strict=False):
            assert bytes(arena.arena.view[slot.offset : slot.offset + slot.size_bytes]) == self.model.get(
                (ns, key)
            )
        if resolved.lease is not None:
            held = {(ns, k) for k in CHAINS[c][: len(resolved.slots)]}
            self.leases[resolved.lease.lease_id] = (self.clock.now + 5.0, held)

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.step()
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        expires, _ = self.leases.pop(lease_id)
        if expires > self.clock.now:
            self.store.release(lease_id)

    @rule(seconds=st.sampled_from([0.5, 2.0]))
    def advance_clock(self, seconds: float) -> None:
        self.step()
        self.clock.now += seconds
        for lease_id, (expires, _) in list(self.leases.items()):
            if expires <= self.clock.now:
                del self.leases[lease_id]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def only_live_blocks_are_present(self) -> None:
        assert self.present() <= set(self.model)

    @invariant()
    def pinned_blocks_stay(self) -> None:
        present = self.present()
        for expires, held in self.leases.values():
            if expires > self.clock.now:
                assert held & set(self.model) <= present, "a pinned block was evicted"

    @invariant()
    def eviction_never_strands_a_child(self) -> None:
        present = self.present()
        for ns, key in present:
            for keys in CHAINS.values():
                if key in keys and keys.index(key) > 0:
                    parent = (ns, keys[keys.index(key) - 1])
                    if parent in self.before and parent not in self.removed_now and (ns, key) in self.before:
                        assert parent in present, "a parent was evicted before its resident child"

    @invariant()
    def every_block_stays_evictable(self) -> None:
        stranded = self.store._reads._eviction.stranded()
        assert not stranded, f"blocks eviction can no longer find: {stranded}"

    @invariant()
    def capacities_and_quotas_hold(self) -> None:
        stats = self.store.stats()
        for usage in stats.tiers:
            assert usage.used_bytes <= usage.capacity_bytes
        assert stats.namespace_bytes.get("a", 0) <= QUOTA_A
        assert stats.blocks == len(self.present())


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
