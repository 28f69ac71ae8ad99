"""The restore-versus-recompute cost model and its calibration, as pure functions."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_plugin.calibration import Calibration, fit_prefill
from kvstore.cost_model import Plan, PrefillModel, TierCost, plan_restore

MB = 1_000_000
PREFILL = PrefillModel(fixed_s=0.005, per_token_s=0.0004, per_token_context_s=1e-8)  # ~2.5k tok/s
FAST = {"dram": TierCost(5_000 * MB, 0.0002), "nvme": TierCost(1_000 * MB, 0.001)}
BLOCK_BYTES, TPB = 2 * MB, 16


def brute_force(tiers: list[str], prompt: int, costs: dict[str, TierCost], local: int = 0) -> float:
    best = PREFILL.seconds(local, prompt - local)
    usable = min(len(tiers), max(0, (prompt - 1) // TPB - local // TPB))
    for k in range(1, usable + 1):
        load = sum(costs[t].latency_s for t in set(tiers[:k])) + sum(
            BLOCK_BYTES * costs[t].seconds_per_byte() for t in tiers[:k]
        )
        held = local + k * TPB
        best = min(best, load + PREFILL.seconds(held, prompt - held))
    return best


def test_fast_tiers_restore_everything() -> None:
    plan = plan_restore(["dram"] * 100, BLOCK_BYTES, TPB, 2000, FAST, PREFILL)
    assert plan.restore_blocks == 100 and plan.decision == "restore"
    assert plan.predicted_ttft_s < plan.all_recompute_s


def test_slow_tier_means_recompute() -> None:
    slow = {"nvme": TierCost(1 * MB, 0.01)}  # 2 s per block
    plan = plan_restore(["nvme"] * 10, BLOCK_BYTES, TPB, 500, slow, PREFILL)
    assert plan.restore_blocks == 0 and plan.decision == "recompute"
    assert plan.predicted_ttft_s == plan.all_recompute_s


def test_fast_head_slow_tail_restores_a_partial_prefix() -> None:
    costs = {"dram": TierCost(5_000 * MB, 0.0002), "nvme": TierCost(5 * MB, 0.002)}
    tiers = ["dram"] * 20 + ["nvme"] * 20
    plan = plan_restore(tiers, BLOCK_BYTES, TPB, 1000, costs, PREFILL)
    assert plan.restore_blocks == 20 and plan.decision == "partial"
    assert plan.predicted_ttft_s < min(plan.all_recompute_s, plan.all_restore_s)


def test_at_least_one_token_is_computed() -> None:
    plan = plan_restore(["dram"] * 4, BLOCK_BYTES, TPB, 64, FAST, PREFILL)  # the hit covers it all
    assert plan.restore_tokens == 48


def test_no_hits_and_bad_input() -> None:
    plan = plan_restore([], BLOCK_BYTES, TPB, 100, FAST, PREFILL)
    assert plan.restore_blocks == 0 and plan.all_restore_s == plan.all_recompute_s
    with pytest.raises(KeyError):
        plan_restore(["tape"], BLOCK_BYTES, TPB, 100, FAST, PREFILL)
    with pytest.raises(ValueError):
        TierCost(0)


def test_the_engines_own_prefix_is_neither_restored_nor_counted() -> None:
    # The engine holds 20 blocks (320 tokens); the 30 blocks after them hit in dram.
    plan = plan_restore(["dram"] * 30, BLOCK_BYTES, TPB, 1000, FAST, PREFILL, local_tokens=320)
    assert plan.restore_blocks == 30 and plan.restore_tokens == 480 and plan.decision == "restore"
    assert plan.local_tokens == 320
    assert plan.all_recompute_s == PREFILL.seconds(320, 680)  # recompute starts after the engine's part
    assert plan.predicted_prefill_s == pytest.approx(PREFILL.seconds(800, 200))
    load = FAST["dram"].latency_s + 30 * BLOCK_BYTES * FAST["dram"].seconds_per_byte()
    assert plan.predicted_load_s == pytest.approx(load)


def test_nothing_to_decide_when_the_engine_holds_every_usable_block() -> None:
    # 62 blocks held of a 1000-token prompt: only the last 8 tokens are computed; a hit on the
    # 63rd block (the prompt's last token is in it) cannot be used.
    plan = plan_restore(["dram"], BLOCK_BYTES, TPB, 1000, FAST, PREFILL, local_tokens=992)
    assert plan.restore_blocks == 0 and plan.usable_blocks == 0 and plan.decision == "recompute"
    assert plan.predicted_ttft_s == plan.all_recompute_s == PREFILL.seconds(992, 8)
    assert plan_restore([], BLOCK_BYTES, TPB, 1000, FAST, PREFILL, local_tokens=992) == plan


def test_a_local_prefix_is_whole_blocks() -> None:
    with pytest.raises(ValueError):
        plan_restore(["dram"], BLOCK_BYTES, TPB, 1000, FAST, PREFILL, local_tokens=17)
    with pytest.raises(ValueError):
        plan_restore(["dram"], BLOCK_BYTES, TPB, 1000, FAST, PREFILL, local_tokens=-16)


def test_a_codec_slows_the_tier_down() -> None:
    plain = TierCost(1_000 * MB)
    zstd = TierCost(1_000 * MB, decode_bytes_per_s=500 * MB)
    assert zstd.seconds_per_byte() == pytest.approx(3 * plain.seconds_per_byte())


@given(
    tiers=st.lists(st.sampled_from(["dram", "nvme", "remote"]), max_size=40),
    prompt=st.integers(1, 1000),
    bw=st.floats(0.5, 20_000),
    lat=st.floats(0, 0.05),
    local_blocks=st.integers(0, 70),
)
def test_the_plan_is_the_best_prefix(
    tiers: list[str], prompt: int, bw: float, lat: float, local_blocks: int
) -> None:
    costs = {**FAST, "remote": TierCost(bw * MB, lat)}
    tiers = sorted(tiers, key=["dram", "nvme", "remote"].index)  # a chain is fast at its head
    local = min(local_blocks, max(0, prompt - 1) // TPB) * TPB  # the engine holds at most n - 1
    plan = plan_restore(tiers, BLOCK_BYTES, TPB, prompt, costs, PREFILL, local_tokens=local)
    assert math.isclose(plan.predicted_ttft_s, brute_force(tiers, prompt, costs, local), rel_tol=1e-9)
    assert plan.predicted_ttft_s <= plan.all_recompute_s and plan.predicted_ttft_s <= plan.all_restore_s
    assert local + plan.restore_tokens <= max(0, prompt - 1)  # one token is always computed


def test_fit_recovers_prefill_coefficients() -> None:
    truth = PrefillModel(0.01, 0.0003, 2e-8)
    points = [(p, s, truth.seconds(p, s)) for p in (0, 512, 2048, 8192) for s in (16, 256, 1024)]
    fitted = fit_prefill(points)
    for p, s, t in points:
        assert fitted.seconds(p, s) == pytest.approx(t, rel=1e-6)


def test_fit_never_goes_negative() -> None:
    fitted = fit_prefill([(0, 100, 0.05), (0, 200, 0.05), (0, 300, 0.05), (0, 400, 0.049)])
    assert fitted.fixed_s >= 0 and fitted.per_token_s >= 0 and fitted.per_token_context_s >= 0


def test_calibration_round_trips_and_learns_online(tmp_path: Path) -> None:
    cal = Calibration(dict(FAST), PREFILL, ewma_weight=0.5)
    cal.save(tmp_path / "cal.json", {"model": "tiny"})
    again = Calibration.load(tmp_path / "cal.json")
    assert again.snapshot() == cal.snapshot()
    for _ in range(40):  # the disk turned out 10x slower than calibrated
        again.observe_transfer("nvme", 100 * MB, 1.0 + FAST["nvme"].latency_s)
    assert again.snapshot().tiers["nvme"].bandwidth_bytes_per_s == pytest.approx(100 * MB, rel=0.01)
    truth = PrefillModel(0.002, 0.001, 0.0)
    for p, s in [(0, 100), (100, 50), (400, 200), (0, 800), (800, 16), (32, 32), (64, 640), (256, 128)]:
        again.observe_prefill(p, s, truth.seconds(p, s))
    assert again.snapshot().prefill.seconds(1000, 100) == pytest.approx(truth.seconds(1000, 100), rel=1e-6)


def test_a_forced_restore_count_is_predicted_too() -> None:
    tiers = ["dram"] * 10
    best = plan_restore(tiers, BLOCK_BYTES, TPB, 1000, FAST, PREFILL)
    none = plan_restore(tiers, BLOCK_BYTES, TPB, 1000, FAST, PREFILL, restore_blocks=0)
    some = plan_restore(tiers, BLOCK_BYTES, TPB, 1000, FAST, PREFILL, restore_blocks=4)
    over = plan_restore(tiers, BLOCK_BYTES, TPB, 1000, FAST, PREFILL, restore_blocks=99)
    assert (best.decision, none.decision, some.decision, over.decision) == (
        "restore",
        "recompute",
        "partial",
        "restore",
    )
    assert none.predicted_ttft_s == best.all_recompute_s and over.restore_blocks == 10
    assert best.predicted_ttft_s <= some.predicted_ttft_s <= none.predicted_ttft_s


def test_the_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    Calibration(dict(FAST), PREFILL).save(path)
    cal = Calibration.load(path)
    cal.observe_transfer("dram", 100 * MB, 10.0)  # an online update, forgotten on reload
    assert not cal.reload_if_changed()
    slow = {"dram": TierCost(10 * MB, 0.01), "nvme": TierCost(1 * MB, 0.02)}
    Calibration(slow, PREFILL).save(path)
    assert cal.reload_if_changed()
    assert cal.snapshot().tiers == slow
    path.write_text("{ torn")  # a half-written file keeps the figures in use
    assert not cal.reload_if_changed()
    assert cal.snapshot().tiers == slow
    Calibration(dict(FAST), PREFILL).save(path)
    assert cal.reload_if_changed() and cal.snapshot().tiers == FAST


def test_online_prefill_fit_keeps_the_calibrated_shapes(tmp_path: Path) -> None:
    truth = PrefillModel(0.002, 0.0004, 2e-8)
    calibrated = [(0, s, truth.seconds(0, s)) for s in (128, 512, 1024, 2048, 3072)]
    cal = Calibration(dict(FAST), fit_prefill(calibrated), calibrated)
    cal.save(tmp_path / "cal.json")
    cal = Calibration.load(tmp_path / "cal.json")
    # The engine now only sees long restored prefixes with short suffixes, 2x slower than before
    # (another tenant on the CPU): the fit follows, and still predicts a full recompute sensibly.
    slower = PrefillModel(0.004, 0.0008, 4e-8)
    for p in (1024, 2048, 3008, 2048, 1024, 3008, 2048, 1024) * 4:
        cal.observe_prefill(p, 64, slower.seconds(p, 64))
    fitted = cal.snapshot().prefill
    assert fitted.seconds(2048, 64) == pytest.approx(slower.seconds(2048, 64), rel=0.15)
    assert truth.seconds(0, 3072) * 0.8 <= fitted.seconds(0, 3072) <= slower.seconds(0, 3072) * 1.2


@pytest.mark.parametrize(
    ("remote_mb_per_s", "restored"),
    [(200, 3), (2_000, 8)],  # 10 ms a block vs ~6.5 ms of prefill a block; then 1 ms a block
    ids=["slow-remote-recomputed", "fast-remote-restored"],
)
def test_local_and_remote_parts_are_restored_only_where_each_pays(
    remote_mb_per_s: int, restored: int
) -> None:
    # 3 blocks in this replica's dram, then 5 that only the fleet's remote tier holds
    costs = {**FAST, "remote": TierCost(remote_mb_per_s * MB, 0.002)}
    hits = ["dram"] * 3 + ["remote"] * 5
    plan = plan_restore(hits, BLOCK_BYTES, TPB, 4000, costs, PREFILL)
    assert plan.restore_blocks == restored
    assert math.isclose(plan.predicted_ttft_s, brute_force(hits, 4000, costs))


def test_the_first_observed_prefills_correct_the_starting_curve() -> None:
    from kvstore.cost_model import DEFAULT_PREFILL

    # The tiny test model on vLLM CPU: ~11 ms a request, 0.1 ms a token; the defaults said
    # 2 ms and 0.4 ms, 3.6x too slow for a 1000-token prompt and 2.5x too fast for a restore.
    truth = PrefillModel(0.011, 0.0001, 0.0)
    cal = Calibration(dict(FAST), DEFAULT_PREFILL)
    assert DEFAULT_PREFILL.seconds(0, 1000) / truth.seconds(0, 1000) > 3
    cal.observe_prefill(0, 1000, truth.seconds(0, 1000))  # one size seen: the curve is scaled
    scaled = cal.snapshot().prefill
    assert scaled.seconds(0, 1000) == pytest.approx(truth.seconds(0, 1000))
    assert 0.67 < scaled.seconds(0, 400) / truth.seconds(0, 400) < 1.5
    cal.observe_prefill(992, 8, truth.seconds(992, 8))  # a restore's short suffix: both parts fitted
    fitted = cal.snapshot().prefill
    for p, s in [(0, 1000), (992, 8), (0, 300), (512, 64)]:
        assert fitted.seconds(p, s) == pytest.approx(truth.seconds(p, s), rel=0.05)
    noisy = Calibration(dict(FAST), DEFAULT_PREFILL)
    noisy.observe_prefill(0, 400, 0.5)  # a slow stretch of the machine
    noisy.observe_prefill(0, 900, 0.25)  # longer, yet faster: no per-token cost would fit
    assert noisy.snapshot().prefill.per_token_s > 0  # the scaled curve, which still restores


def test_the_probe_at_start_sets_the_starting_per_token_cost_but_not_a_files(tmp_path: Path) -> None:
    from kvstore.cost_model import DEFAULT_PREFILL

    cal = Calibration(dict(FAST), DEFAULT_PREFILL)  # no file: the built-in curve
    cal.start_from_probe(0.0001)
    probed = cal.snapshot().prefill
    assert probed == PrefillModel(DEFAULT_PREFILL.fixed_s, 0.0001, DEFAULT_PREFILL.per_token_context_s)
    # the engine's timed prefills still correct it: one size seen scales the probed curve
    cal.observe_prefill(0, 400, 2 * probed.seconds(0, 400))
    assert cal.snapshot().prefill.seconds(0, 200) == pytest.approx(2 * probed.seconds(0, 200))
    cal.start_from_probe(0.5)  # a probe arriving after timed prefills does not undo them
    assert cal.snapshot().prefill.seconds(0, 200) == pytest.approx(2 * probed.seconds(0, 200))

    # a calibration file was measured on this machine (`kvstore bench calibrate`): it stands
    path = tmp_path / "calibration.json"
    Calibration(dict(FAST), PREFILL).save(path)
    from_file = Calibration.load(path)
    from_file.start_from_probe(0.0001)
    assert from_file.snapshot().prefill == PREFILL


def test_exploring_takes_the_other_side_only_near_the_crossover_and_only_sometimes() -> None:
    from kvstore.cost_model import EXPLORE_BAND, EXPLORE_FRACTION, explore

    def plan_at(mb_per_s: float) -> Plan:
        return plan_restore(
            ["nvme"] * 60, BLOCK_BYTES, TPB, 1000, {"nvme": TierCost(mb_per_s * MB, 0.001)}, PREFILL
        )

    restores, recomputes = plan_at(400), plan_at(160)  # restoring ~1.3x faster; recomputing ~1.9x
    assert restores.decision == "restore" and recomputes.decision == "recompute"
    assert restores.all_recompute_s < (1 + EXPLORE_BAND) * restores.predicted_ttft_s
    assert explore(restores, 0.0) == 0  # the other side of restoring: recompute
    assert explore(recomputes, 0.0) == recomputes.usable_blocks  # and of recomputing: restore all
    assert explore(restores, EXPLORE_FRACTION) is None  # a draw past the fraction follows the plan
    far = plan_at(50_000)  # recomputing predicted ~17x slower: never worth a look
    assert far.all_recompute_s > (1 + EXPLORE_BAND) * far.predicted_ttft_s and explore(far, 0.0) is None
    nothing = plan_restore([], BLOCK_BYTES, TPB, 1000, FAST, PREFILL)
    assert explore(nothing, 0.0) is None  # nothing to restore: no other side
    rng = random.Random(7)
    taken = sum(explore(restores, rng.random()) is not None for _ in range(10_000))
    assert 0.04 < taken / 10_000 < 0.06  # the share the fraction says


def test_a_restores_fixed_cost_is_fitted_beside_its_bandwidth() -> None:
    # a tier that pays 3 ms a restore plus 200 MB/s, calibrated at 0.5 ms and 1 GB/s
    truth = TierCost(200 * MB, 0.003)
    cal = Calibration({"nvme": TierCost(1_000 * MB, 0.0005)}, PREFILL)
    rng = random.Random(3)
    for _ in range(30):
        nbytes = rng.randint(1, 60) * 64 * 1024
        seconds = (truth.latency_s + nbytes / truth.bandwidth_bytes_per_s) * rng.uniform(0.95, 1.05)
        cal.observe_transfer("nvme", nbytes, seconds)
    fitted = cal.snapshot().tiers["nvme"]
    assert fitted.latency_s == pytest.approx(truth.latency_s, rel=0.2)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(truth.bandwidth_bytes_per_s, rel=0.1)
    one_block = 64 * 1024  # mostly the fixed cost: a kept 0.5 ms would predict it 2.5x short
    assert fitted.latency_s + one_block / fitted.bandwidth_bytes_per_s == pytest.approx(
        truth.latency_s + one_block / truth.bandwidth_bytes_per_s, rel=0.15
    )


def test_the_transfer_fit_floors_latency_and_refuses_what_it_cannot_tell() -> None:
    from engine_plugin.calibration import fit_transfer

    # per-byte only, the small ones a little slow: the line crosses below zero; floored at zero
    fitted = fit_transfer([(1 * MB, 0.0012), (2 * MB, 0.002), (4 * MB, 0.0041), (8 * MB, 0.0079)])
    assert fitted is not None
    assert fitted[0] >= 0 and fitted[1] == pytest.approx(1_000 * MB, rel=0.05)
    assert fit_transfer([(4 * MB, 0.01)] * 8) is None  # one size: no telling latency from bandwidth
    assert fit_transfer([(1 * MB, 0.01), (2 * MB, 0.005), (4 * MB, 0.004), (8 * MB, 0.002)]) is None  # noise


@pytest.mark.parametrize(
    "start", [0, 1], ids=["restore-wins-calibrated-slow", "recompute-wins-calibrated-fast"]
)
def test_a_wrong_calibration_converges_only_with_exploring(start: int) -> None:
    from benchmarks.decisions_converge import STARTS, run

    for seed in (0, 1):
        stuck = run(STARTS[start], 0.0, seed, requests=400)
        assert stuck.converged_at() is None  # the wrong side to the end: the other is never measured
        explored = run(STARTS[start], 0.05, seed, requests=400)
        at = explored.converged_at()
        assert at is not None and at < 300, at
        assert explored.ttft_s < stuck.ttft_s
