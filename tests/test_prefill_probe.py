"""The prefill probe at the connector's start (engine_plugin.prefill_probe): the model's linear
layers read from vLLM's own model config, and timed on this machine. How close its figure
lands to the engine's real prefills is tests/test_vllm_first_run.py's (and
benchmarks/first_run.py's) to show."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the probe reads vLLM's model config (scripts/setup.sh --with-vllm)")

import torch

from benchmarks.tiny_model import SIZES, build_tiny_llama
from engine_plugin.prefill_probe import ModelShapes, probe_per_token_s, shapes_from_vllm


@pytest.fixture(scope="module")
def configs() -> Iterator[dict[str, SimpleNamespace]]:
    from vllm.config import ModelConfig, ParallelConfig

    folder = Path(tempfile.mkdtemp(prefix="kvprobe-"))
    try:
        found = {}
        for size in SIZES:
            model = ModelConfig(
                model=str(build_tiny_llama(folder / size, seed=0, size=size)), dtype="bfloat16"
            )
            found[size] = SimpleNamespace(model_config=model, parallel_config=ParallelConfig())
        yield found
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("size", list(SIZES))
def test_the_shapes_are_the_models_linear_layers(configs: dict[str, SimpleNamespace], size: str) -> None:
    s = SIZES[size]
    head = s["hidden_size"] // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * head, s["num_key_value_heads"] * head
    hidden, intermediate = s["hidden_size"], s["intermediate_size"]
    assert shapes_from_vllm(configs[size]) == ModelShapes(
        ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * intermediate), (intermediate, hidden)),
        s["num_hidden_layers"],
        torch.bfloat16,
    )


def test_a_model_with_more_work_a_token_probes_slower(configs: dict[str, SimpleNamespace]) -> None:
    # The small model's layers hold ~80x the tiny one's products a token: far beyond any noise.
    tiny, small = (shapes_from_vllm(configs[size]) for size in ("tiny", "small"))
    assert tiny is not None and small is not None
    tiny_s, small_s = (probe_per_token_s(shapes, torch.device("cpu")) for shapes in (tiny, small))
    assert 0 < tiny_s < small_s / 5, (tiny_s, small_s)


def test_a_config_without_the_shapes_gives_no_probe() -> None:
    assert shapes_from_vllm(SimpleNamespace(model_config=object(), parallel_config=object())) is None
