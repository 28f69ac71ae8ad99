"""Loads from the slots the scheduler's pinning lookup found (``TransferJob.in_place``), against
a real sidecar: the worker copies those arena slots without a resolve of its own, then checks
the lookup's lease held; a lease released or collected before that check makes the load's
blocks load errors (vLLM recomputes them), whole or layer-wise."""

from __future__ import annotations

import pytest
import torch

from engine_plugin.vllm_lookup import in_place_slots, lookup_ranks
from engine_plugin.vllm_metadata import KvstoreConnectorMetadata, TransferJob
from kvstore.client import Client, connect
from kvstore.server.serve import RunningServer
from tests.service_fixtures import MODEL
from tests.test_vllm_layerwise import LAYERS, caches, forward, sidecar, stored_prefix, worker

__all__ = ["sidecar"]


def in_place_load(kv: Client, keys: list[bytes], block_ids: list[int]) -> tuple[TransferJob, int]:
    """The scheduler's pinning lookup of ``keys`` and the load it sends: (job, its lease)."""
    hit = lookup_ranks(kv, [MODEL.fingerprint()], [keys])
    in_place = in_place_slots(hit.lookups, len(keys))
    assert hit.hit_blocks == len(keys) and in_place[0] is not None
    job = TransferJob("r", [keys], block_ids, 5.0, tiers=hit.tiers, in_place=in_place)
    return job, hit.lease_ids[0]


@pytest.fixture
def no_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load given its slots must not resolve them again: make any resolve fail the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a load given its slots resolved them again")

    monkeypatch.setattr(Client, "resolve", refuse)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_load_copies_the_lookups_slots_and_leaves_its_lease_to_the_scheduler(
    sidecar: RunningServer, layerwise: bool, no_resolve: None
) -> None:
    keys, source = stored_prefix(sidecar, 5000 + layerwise)
    target = caches()
    side = worker(sidecar, target, layerwise)
    try:
        with connect(sidecar.unix_address) as kv:
            job, lease = in_place_load(kv, keys, [6, 2, 5])
            side.step_started()
            side.start_load_kv(KvstoreConnectorMetadata(loads=[job]))
            forward(side)
            assert side.get_block_ids_with_load_errors() == set()
            for name in LAYERS:
                for dst, src in ((6, 0), (2, 1), (5, 2)):
                    assert torch.equal(target[name][dst], source[name][src])
            assert kv.lease_held(lease)  # the worker never releases the scheduler's pin
            kv.release(lease)
    finally:
        side.shutdown()


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_load_whose_pin_ended_is_recomputed(sidecar: RunningServer, layerwise: bool) -> None:
    """The scheduler's lease went before the worker confirmed its copy (released, as when the
    request finished meanwhile; an expired one reads alike): the slots may hold other blocks by
    now, so the copy does not stand."""
    keys, _ = stored_prefix(sidecar, 6000 + layerwise)
    side = worker(sidecar, caches(), layerwise)
    try:
        with connect(sidecar.unix_address) as kv:
            job, lease = in_place_load(kv, keys, [1, 3, 7])
            kv.release(lease)
            side.step_started()
            side.start_load_kv(KvstoreConnectorMetadata(loads=[job]))
            forward(side)
            assert side.get_block_ids_with_load_errors() == {1, 3, 7}
    finally:
        side.shutdown()


def test_a_rank_reads_in_place_only_when_the_arena_holds_every_block_it_loads() -> None:
    """The plan may load a prefix of the hit: slots past it do not matter, a block before it
    that only a slower tier holds sends that rank's worker through a resolve."""
    from kvstore.client import Lookup

    tail_below = Lookup(4, ("dram", "dram", "nvme", "nvme"), 7, "arena", ((0, 8), (8, 8), None, None))
    head_below = Lookup(4, ("nvme", "dram", "dram", "dram"), 9, "arena", (None, (8, 8), (16, 8), (24, 8)))
    unpinned = Lookup(4, ("dram",) * 4, 0, "arena", ((0, 8), (8, 8), (16, 8), (24, 8)))
    first, second, third = in_place_slots([tail_below, head_below, unpinned], 2)
    assert first is not None and (first.arena, first.lease_id, first.slots) == ("arena", 7, [(0, 8), (8, 8)])
    assert second is None and third is None
    assert in_place_slots([tail_below], 3) == [None]
